"""Partitioned parameters for ZeRO-3: ShardedParam state, partition / gather / release, Init, GatheredParameters."""
