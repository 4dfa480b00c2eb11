"""Checks across ranks during training: agreement at ``initialize``, non-finite gradients."""
