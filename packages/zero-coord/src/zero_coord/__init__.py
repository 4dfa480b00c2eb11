"""Module hooks, execution trace, prefetch and release for ZeRO-3."""
