"""Two-hop all-gather for groups that span several nodes.

Hop 1 gathers across nodes among the group members with this rank's local rank
(``groups.inter``), so each inter-node link carries every shard once; hop 2 gathers
those node-stacked blocks inside the node (``groups.intra``). The result, indexed
``[local, node]``, is reordered into group-rank order (``node * intra_size + local``)
by the same single fused copy as the flat gather uses.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.profiler import record_function

from zero_comm.checks import check_flat_inputs, require_process_group
from zero_comm.coalesced import GatherLayout, adjacent_flat_view, issue_all_gather, result_or_handle
from zero_comm.handles import AllGatherHandle
from zero_comm.ledger import record, ring_wire_bytes
from zero_comm.pairwise import gather_rows
from zero_comm.topology import HierarchicalGroups

__all__ = ["hierarchical_all_gather_coalesced", "issue_hierarchical_all_gather"]


def hierarchical_all_gather_coalesced(
    shards: Sequence[torch.Tensor],
    groups: HierarchicalGroups,
    *,
    async_op: bool = False,
    out: torch.Tensor | None = None,
) -> list[torch.Tensor] | AllGatherHandle:
    """All-gather over a multi-node group in two hops; see :func:`issue_hierarchical_all_gather`.

    Returns:
        What :func:`~zero_comm.all_gather_coalesced` returns: the gathered tensors, or with
        ``async_op=True`` the handle whose ``wait()`` returns them.
    """
    return result_or_handle(
        issue_hierarchical_all_gather(shards, groups, async_op=async_op, out=out), async_op
    )


def issue_hierarchical_all_gather(
    shards: Sequence[torch.Tensor],
    groups: HierarchicalGroups,
    *,
    async_op: bool = False,
    out: torch.Tensor | None = None,
) -> AllGatherHandle:
    """All-gather over a multi-node group in two hops (inter-node, then intra-node); always a handle."""
    what = "hierarchical_all_gather_coalesced"
    require_process_group(what)
    nodes, local = groups.inter_size, groups.intra_size
    if nodes == 1:
        return issue_all_gather(shards, groups.intra, async_op=async_op, out=out)
    if local == 1:
        return issue_all_gather(shards, groups.inter, async_op=async_op, out=out)
    with record_function("zero.all_gather.issue"):
        check_flat_inputs(shards, what, require_1d=True)
        layout = GatherLayout.plan(shards, nodes * local, out, what)
        shard_bytes = layout.total * shards[0].element_size()
        record(
            "all_gather",
            groups.inter,
            payload_bytes=shard_bytes,
            wire_bytes=ring_wire_bytes("all_gather", shard_bytes, nodes),
        )
        record(
            "all_gather",
            groups.intra,
            payload_bytes=nodes * shard_bytes,
            wire_bytes=ring_wire_bytes("all_gather", nodes * shard_bytes, local),
        )
        return _issue_two_hops(shards, layout, groups, async_op)


def _issue_two_hops(
    shards: Sequence[torch.Tensor], layout: GatherLayout, groups: HierarchicalGroups, async_op: bool
) -> AllGatherHandle:
    nodes, local, total = groups.inter_size, groups.intra_size, layout.total
    if total == 0:
        outputs = layout.outputs
        return AllGatherHandle("all_gather", None, lambda: outputs)
    send = adjacent_flat_view(shards)
    if send is None:
        send = torch.cat(list(shards))
    across = torch.empty(nodes * total, dtype=send.dtype, device=send.device)
    gather_rows(across, send, groups.inter, async_op=False)
    staging = torch.empty(local * nodes * total, dtype=send.dtype, device=send.device)
    work = gather_rows(staging, across, groups.intra, async_op=async_op)
    rank_major = staging.view(local, nodes, total).transpose(0, 1)  # [node, local] = group-rank order
    return AllGatherHandle("all_gather", work, lambda: layout.copy_out(rank_major), keepalive=(across,))
