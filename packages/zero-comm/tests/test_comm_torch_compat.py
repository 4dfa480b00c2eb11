"""torch_compat: the collectives zero calls by their torch 2.13 names, on every supported torch (2.9 on)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as torch_dist
from torch.torch_version import TorchVersion

from zero_comm import torch_compat

pytestmark = pytest.mark.smoke


def test_the_older_name_is_taken_where_the_newer_one_is_missing():
    older = SimpleNamespace(all_gather_into_tensor=len)
    assert torch_compat.newest(older, "all_gather_single", "all_gather_into_tensor") is len
    both = SimpleNamespace(all_gather_single=max, all_gather_into_tensor=len)
    assert torch_compat.newest(both, "all_gather_single", "all_gather_into_tensor") is max


@pytest.mark.parametrize(
    "name,older",
    [("all_gather_single", "all_gather_into_tensor"), ("reduce_scatter_single", "reduce_scatter_tensor")],
)
def test_this_torch_gets_its_own_function(name, older):
    """The newer function where this torch has it (2.13 on), the older one before."""
    newer_torch = TorchVersion(torch.__version__) >= (2, 13)
    assert getattr(torch_compat, name) is getattr(torch_dist, name if newer_torch else older)


def _older_against_newer(rank):
    world = torch_dist.get_world_size()
    mine = torch.arange(5, dtype=torch.float32) + 10 * rank.rank  # odd size
    gathered = [torch.empty(world * 5) for _ in range(2)]
    torch_dist.all_gather_into_tensor(gathered[0], mine)
    torch_compat.all_gather_single(gathered[1], mine)
    rows = torch.arange(world * 3, dtype=torch.float32) * (rank.rank + 1)
    reduced = [torch.empty(3) for _ in range(2)]
    torch_dist.reduce_scatter_tensor(reduced[0], rows.clone())
    torch_compat.reduce_scatter_single(reduced[1], rows.clone())
    return gathered, reduced


@pytest.mark.parametrize("world", [1, 2])
def test_the_older_collectives_match_the_newer_ones(dist, world):
    for gathered, reduced in dist.run(world, _older_against_newer):
        torch.testing.assert_close(gathered[0], gathered[1], rtol=0, atol=0)
        torch.testing.assert_close(reduced[0], reduced[1], rtol=0, atol=0)
        expected = torch.cat([torch.arange(5, dtype=torch.float32) + 10 * r for r in range(world)])
        torch.testing.assert_close(gathered[0], expected, rtol=0, atol=0)
