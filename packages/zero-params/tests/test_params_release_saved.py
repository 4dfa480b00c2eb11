"""Release frees the gathered bytes also where autograd saved views of the parameter, and the
next gather refills the storage those views read: backward then computes the gradients of a
plain model."""

from __future__ import annotations

import copy

import torch
from params_cases import run
from torch import nn

import zero_params as zp

pytest_plugins = ("params_worlds",)


def _model() -> nn.Module:
    torch.manual_seed(0)
    # odd sizes: every parameter is padded on 2 and 4 ranks
    return nn.Sequential(nn.Linear(7, 13, bias=False), nn.Tanh(), nn.Linear(13, 5), nn.LayerNorm(5))


def _saved_views_are_emptied_then_refilled():
    model = _model()
    ref = copy.deepcopy(model)
    params = list(model.parameters())
    zp.partition(model)
    x = torch.randn(3, 7, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)

    saved: list[tuple[str, torch.Tensor]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if zp.is_partitioned(base):
            saved.append((zp.state_of(base).name, t))
        return t

    zp.gather(params).wait()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x).square().sum()
    zp.release(params)
    emptied = {name: t.untyped_storage().nbytes() for name, t in saved}
    views = sorted(name for name, t in saved if t._base is not None)
    # backward's gathers: other buckets than forward's (one parameter at a time, in reverse)
    for p in reversed(params):
        zp.gather([p]).wait()
    fills = [zp.state_of(p).unsharded.fills for p in params]
    loss.backward()
    grads = {zp.state_of(p).name: p.grad.clone() for p in params}
    zp.release(params)
    ref(x_ref).square().sum().backward()
    errors = {n: (grads[n] - p.grad).abs().max().item() for n, p in ref.named_parameters()}
    errors["input"] = (x.grad - x_ref.grad).abs().max().item()
    return emptied, views, fills, errors


def test_release_empties_saved_views_and_backward_reads_the_refilled_storage(dist, world):
    for emptied, views, fills, errors in run(dist, world, _saved_views_are_emptied_then_refilled):
        assert views == ["0.weight", "2.weight"]  # F.linear saved weight.t() of both Linears
        assert emptied and all(n == 0 for n in emptied.values()), emptied
        assert fills == [2] * len(fills)  # forward's gather and backward's, into one storage each
        assert max(errors.values()) <= 1e-6, errors
