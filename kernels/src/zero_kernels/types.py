"""Value types of the quantization API: the config, the quantized payload and the qgZ layout."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

MAX_GROUP_SIZE = 1 << 16
"""Largest accepted ``group_size``: one group is one row of a Triton tile."""


@dataclass(frozen=True)
class QuantConfig:
    """How to quantize: bit width and group size.

    Quantization is symmetric with one fp32 scale per group of ``group_size`` consecutive
    elements: ``scale = absmax / 2**(bits-1)`` and ``code = clamp(round_half_even(x / scale),
    -2**(bits-1), 2**(bits-1) - 1)``. This is DeepSpeed's symmetric scheme (step ``2·absmax/2**bits``);
    it bounds the round-trip error by ``absmax / 2**bits``, and by ``absmax / 2**(bits-1)`` for a
    value clamped to the top code.
    """

    bits: Literal[4, 8]
    group_size: int = 2048

    def __post_init__(self) -> None:
        if type(self.bits) is not int or self.bits not in (4, 8):
            raise ValueError(f"QuantConfig.bits must be 4 or 8, got {self.bits!r}")
        gs = self.group_size
        if isinstance(gs, bool) or not isinstance(gs, int) or not 1 <= gs <= MAX_GROUP_SIZE:
            raise ValueError(f"QuantConfig.group_size must be an int in [1, {MAX_GROUP_SIZE}], got {gs!r}")
        if self.bits == 4 and gs % 2:
            raise ValueError(
                f"QuantConfig.group_size must be even for bits=4 (two codes per byte share a group), "
                f"got {gs}; use an even size such as {gs + 1}"
            )

    @property
    def qmax(self) -> int:
        """Top code, ``2**(bits-1) - 1`` (127 or 7); the bottom code is ``-qmax - 1``."""
        return (1 << (self.bits - 1)) - 1

    def n_groups(self, numel: int) -> int:
        """Number of groups (= scales) for ``numel`` elements: ``ceil(numel / group_size)``."""
        return -(-numel // self.group_size)

    def code_bytes(self, numel: int) -> int:
        """Bytes of codes for ``numel`` elements once padded to whole groups."""
        return self.n_groups(numel) * self.group_size * self.bits // 8

    def payload_bytes(self, numel: int) -> int:
        """Wire payload (codes + fp32 scales) for ``numel`` elements."""
        return self.code_bytes(numel) + 4 * self.n_groups(numel)


@dataclass(frozen=True, eq=False)
class QuantizedTensor:
    """A flat tensor quantized in groups: the codes and scales that go on the wire.

    Group ``g`` covers logical elements ``[g*group_size, (g+1)*group_size)``; the last group is
    zero-padded, so padding codes are 0. For ``bits == 8`` ``codes`` is int8 with one code per
    padded element; for ``bits == 4`` it is uint8 with two codes per byte: element ``2i`` in the low
    nibble, element ``2i+1`` in the high nibble, each a 4-bit two's complement value in [-8, 7].
    """

    codes: torch.Tensor
    scales: torch.Tensor
    numel: int
    bits: int
    group_size: int

    def __post_init__(self) -> None:
        config = QuantConfig(self.bits, self.group_size)  # validates bits and group_size
        want = torch.int8 if self.bits == 8 else torch.uint8
        if self.codes.dtype != want or self.codes.dim() != 1:
            raise ValueError(
                f"QuantizedTensor.codes must be a 1-D {want} tensor for bits={self.bits}, "
                f"got {self.codes.dtype} of shape {tuple(self.codes.shape)}"
            )
        if self.scales.dtype != torch.float32 or self.scales.dim() != 1:
            raise ValueError(
                f"QuantizedTensor.scales must be a 1-D float32 tensor, got {self.scales.dtype} "
                f"of shape {tuple(self.scales.shape)}"
            )
        if self.codes.device != self.scales.device:
            raise ValueError(
                f"QuantizedTensor.codes is on {self.codes.device} but scales on {self.scales.device}"
            )
        n_groups = self.scales.numel()
        if isinstance(self.numel, bool) or not isinstance(self.numel, int) or self.numel < 0:
            raise ValueError(f"QuantizedTensor.numel must be a non-negative int, got {self.numel!r}")
        if config.n_groups(self.numel) != n_groups:
            raise ValueError(
                f"QuantizedTensor has {n_groups} scales but numel={self.numel} with group_size="
                f"{self.group_size} needs {config.n_groups(self.numel)}"
            )
        if self.codes.numel() != config.code_bytes(self.numel):
            raise ValueError(
                f"QuantizedTensor.codes has {self.codes.numel()} entries, expected "
                f"{config.code_bytes(self.numel)} for {n_groups} groups of {self.group_size} "
                f"at {self.bits} bits"
            )

    @property
    def config(self) -> QuantConfig:
        """The :class:`QuantConfig` this tensor was quantized with."""
        return QuantConfig(self.bits, self.group_size)  # type: ignore[arg-type]

    @property
    def n_groups(self) -> int:
        """Number of groups (= number of scales)."""
        return self.scales.numel()

    @property
    def padded_numel(self) -> int:
        """Elements including the zero padding of the last group: ``n_groups * group_size``."""
        return self.n_groups * self.group_size

    @property
    def nbytes(self) -> int:
        """Wire payload in bytes: codes plus fp32 scales."""
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * 4


@dataclass(frozen=True)
class SwizzleLayout:
    """Where each partition sits in the output of :func:`zero_kernels.swizzled_quantize`.

    The input is a flat gradient of ``world_size * partition_numel`` elements; partition ``p``
    (elements ``[p*P, (p+1)*P)``, ``P = partition_numel``) is owned, after the full reduction, by
    global rank ``p = node * ranks_per_node + local_rank``. Each partition is zero-padded to
    ``padded_partition_numel`` (whole groups) and the padded partitions are stored in *slot* order

        slot(p) = local_rank(p) * num_nodes + node(p)
    """

    num_nodes: int
    ranks_per_node: int
    partition_numel: int
    group_size: int

    def __post_init__(self) -> None:
        for name in ("num_nodes", "ranks_per_node", "group_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SwizzleLayout.{name} must be a positive int, got {value!r}")
        p = self.partition_numel
        if isinstance(p, bool) or not isinstance(p, int) or p < 0:
            raise ValueError(f"SwizzleLayout.partition_numel must be a non-negative int, got {p!r}")

    @classmethod
    def for_numel(cls, numel: int, num_nodes: int, ranks_per_node: int, group_size: int) -> SwizzleLayout:
        """Layout for a flat tensor of ``numel`` elements split over ``num_nodes * ranks_per_node`` ranks.

        Raises:
            ValueError: ``numel`` is not divisible by the world size.
        """
        world = num_nodes * ranks_per_node
        if world < 1 or numel % world:
            raise ValueError(
                f"numel={numel} must be divisible by world size num_nodes*ranks_per_node="
                f"{num_nodes}*{ranks_per_node}={world}; pad the flat gradient to a multiple of it"
            )
        return cls(num_nodes, ranks_per_node, numel // world, group_size)

    @property
    def world_size(self) -> int:
        """``num_nodes * ranks_per_node``."""
        return self.num_nodes * self.ranks_per_node

    @property
    def padded_partition_numel(self) -> int:
        """``partition_numel`` rounded up to whole groups."""
        return math.ceil(self.partition_numel / self.group_size) * self.group_size

    @property
    def groups_per_partition(self) -> int:
        """Groups (= scales) per padded partition."""
        return self.padded_partition_numel // self.group_size

    @property
    def chunk_numel(self) -> int:
        """Padded elements sent to one local rank in the intra-node hop: ``num_nodes`` partitions."""
        return self.num_nodes * self.padded_partition_numel

    @property
    def numel(self) -> int:
        """Padded elements in the whole swizzled tensor: ``world_size * padded_partition_numel``."""
        return self.world_size * self.padded_partition_numel

    def slot(self, partition: int) -> int:
        """Position of ``partition`` in the swizzled order (see the class docstring)."""
        if not 0 <= partition < self.world_size:
            raise ValueError(f"partition must be in [0, {self.world_size}), got {partition}")
        node, local = divmod(partition, self.ranks_per_node)
        return local * self.num_nodes + node

    def partition_order(self) -> list[int]:
        """Partition index stored in each slot: ``[n*R + j for j in range(R) for n in range(N)]``."""
        r, n_nodes = self.ranks_per_node, self.num_nodes
        return [n * r + j for j in range(r) for n in range(n_nodes)]
