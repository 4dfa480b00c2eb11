"""Comparisons against references, in the terms of the project's correctness yardstick.

A tensor matches its reference when ``max|actual - expected| <= rel * max|expected|`` (relative
to the tensor's largest magnitude, e.g. ``rel = 1e-5`` for fp32 parameters against a
single-process run); per-step losses compare relative to each step's value.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


def max_rel_to_magnitude(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max|actual - expected| divided by max|expected| (0 when both are all-zero)."""
    if actual.shape != expected.shape:
        raise AssertionError(f"shape mismatch: {tuple(actual.shape)} vs expected {tuple(expected.shape)}")
    a = actual.detach().double().cpu()
    e = expected.detach().double().cpu()
    if a.numel() == 0:
        return 0.0
    diff = (a - e).abs().max().item()
    scale = e.abs().max().item()
    if scale == 0.0:
        return diff
    return diff / scale


def assert_tensors_close(
    actual: torch.Tensor, expected: torch.Tensor, rel: float, what: str = "tensor"
) -> None:
    """Assert ``max|a - e| <= rel * max|e|`` with a message that says by how much it missed."""
    err = max_rel_to_magnitude(actual, expected)
    if not err <= rel:
        raise AssertionError(f"{what}: max error relative to its largest magnitude is {err:.3e} > {rel:.1e}")


def assert_state_close(
    actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], rel: float
) -> None:
    """Compare two name -> tensor mappings tensor by tensor (same keys required)."""
    missing = sorted(set(expected) - set(actual))
    extra = sorted(set(actual) - set(expected))
    if missing or extra:
        raise AssertionError(f"state keys differ: missing {missing}, unexpected {extra}")
    worst = max(((max_rel_to_magnitude(actual[k], expected[k]), k) for k in expected), default=(0.0, ""))
    if not worst[0] <= rel:
        raise AssertionError(f"parameter {worst[1]!r}: relative error {worst[0]:.3e} > {rel:.1e}")


def assert_losses_close(actual: Sequence[float], expected: Sequence[float], rel: float) -> None:
    """Per-step losses equal within ``rel`` relative error; names the first step that is not."""
    if len(actual) != len(expected):
        raise AssertionError(f"{len(actual)} losses vs {len(expected)} expected")
    for step, (a, e) in enumerate(zip(actual, expected)):
        bound = rel * max(abs(e), 1e-30)
        if not abs(a - e) <= bound:
            raise AssertionError(
                f"step {step}: loss {a!r} vs reference {e!r} (rel err {abs(a - e) / abs(e):.3e} > {rel:.1e})"
            )
