"""What ``initialize`` builds from a config: stages, MiCS and ZeRO++ groups, strategies."""
