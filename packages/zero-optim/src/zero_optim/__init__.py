"""Partitioned optimizers: ZeRO stage 1/2, stage 3 and MiCS, loss scaling, clipping."""
