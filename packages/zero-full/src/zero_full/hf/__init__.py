"""Hugging Face checkpoints: load straight into shards, save in the Hugging Face layout."""
