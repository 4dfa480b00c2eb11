"""Coalesced, hierarchical and quantized collectives over torch.distributed; topology, groups and byte accounting."""
