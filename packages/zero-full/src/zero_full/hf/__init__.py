"""Hugging Face checkpoints: load straight into shards, save in the Hugging Face layout.

The Hugging Face Trainer integration sits above the engine, in :mod:`zero_full.hf_trainer`.
"""
