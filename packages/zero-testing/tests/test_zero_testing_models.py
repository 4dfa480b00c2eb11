"""The model zoo: seeded builds are identical, and the losses are the formulas the docstrings give."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zero_testing.models import PathNet, TanhMLP, TiedLM


def test_tanh_mlp_is_linear_layers_joined_by_tanh() -> None:
    model = TanhMLP(11, 13, 5, 3)
    x, y = torch.randn(4, 11), torch.randn(4, 3)
    a, b, c = model.a, model.b, model.c
    out = c(torch.tanh(b(torch.tanh(a(x)))))
    assert [n for n, _ in model.named_children()] == ["a", "b", "c"]
    assert torch.equal(model(x), out.pow(2).mean())
    assert torch.equal(model(x, y), ((out - y) ** 2).mean())


def test_seeded_builds_are_bit_identical_and_seeds_differ() -> None:
    one, two, other = TanhMLP(11, 13, 3), TanhMLP(11, 13, 3), TanhMLP(11, 13, 3, seed=1)
    for (name, p), q, r in zip(one.named_parameters(), two.parameters(), other.parameters(), strict=True):
        assert torch.equal(p, q), name
        assert not torch.equal(p, r), name


def test_unseeded_build_follows_the_callers_rng() -> None:
    torch.manual_seed(7)
    first = TanhMLP(5, 3, seed=None)
    torch.manual_seed(7)
    assert torch.equal(first.a.weight, TanhMLP(5, 3, seed=None).a.weight)


def test_path_net_extra_runs_mid_twice() -> None:
    model = PathNet(7, 13, 3)
    x = torch.randn(2, 7)
    h = model.mid(torch.tanh(model.inp(x)))
    assert torch.equal(model(x), model.out(h).pow(2).mean())
    assert torch.equal(model(x, extra=True), model.out(model.mid(h)).pow(2).mean())


def test_tied_lm_shares_one_parameter() -> None:
    model = TiedLM(vocab=31)
    assert model.head.weight is model.embed.weight
    assert len(list(model.parameters())) == len({id(p) for p in model.parameters()})
    loss = model(torch.randint(0, 31, (2, 9)))
    assert loss.shape == () and torch.isfinite(loss)


@pytest.mark.parametrize(("widths", "names"), [((3,), None), ((3, 4), ("a", "b"))])
def test_tanh_mlp_refuses_bad_shapes(widths: tuple[int, ...], names: tuple[str, ...] | None) -> None:
    with pytest.raises(ValueError, match="TanhMLP needs|layers need"):
        TanhMLP(*widths, names=names)


def test_models_are_plain_torch() -> None:
    assert all(isinstance(m, nn.Module) for m in (TanhMLP(2, 2), PathNet(), TiedLM(vocab=5)))
