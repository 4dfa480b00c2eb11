"""The zero training product: DeepSpeed-compatible config, initialize() -> engine, checkpoints, the `zero` CLI."""
