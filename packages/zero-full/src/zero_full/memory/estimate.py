"""Model-state memory per rank for each ZeRO stage, from the ZeRO paper's formulas."""

from __future__ import annotations

import dataclasses
import decimal
import enum
import re
import types
from collections.abc import Mapping
from fractions import Fraction

__all__ = [
    "EstimatePrecision",
    "MemoryEstimate",
    "StageMemory",
    "estimate_model_states",
    "parse_count",
]

STAGE_NAMES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}


class EstimatePrecision(str, enum.Enum):
    """Training precision of the estimate: bytes per parameter of each model state."""

    MIXED = "mixed"
    FP32 = "fp32"

    @property
    def bytes_per_param(self) -> tuple[int, int, int]:
        """Bytes per parameter of (parameters, gradients, optimizer state)."""
        return (2, 2, 12) if self is EstimatePrecision.MIXED else (4, 4, 8)

    def formula(self, stage: int) -> str:
        """The paper's formula of one rank's model states at ``stage``, e.g. ``"4P + 12P/N"``.

        ``P`` is the number of parameters and ``N`` the number of ranks (the partition group's
        size under MiCS); :func:`estimate_model_states` computes the same numbers.
        """
        if stage not in STAGE_NAMES:
            raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
        return _FORMULAS[self][stage]


_FORMULAS: Mapping[EstimatePrecision, tuple[str, ...]] = types.MappingProxyType(
    {
        EstimatePrecision.MIXED: ("16P", "4P + 12P/N", "2P + 14P/N", "16P/N"),
        EstimatePrecision.FP32: ("16P", "8P + 8P/N", "4P + 12P/N", "16P/N"),
    }
)


@dataclasses.dataclass(frozen=True)
class StageMemory:
    """Model-state bytes one rank holds at one stage (formula values, may be fractional)."""

    stage: int
    params_bytes: float
    gradients_bytes: float
    optimizer_bytes: float
    shard_size: int | None = None
    hpz_size: int | None = None
    frozen_int8: int | None = None

    @property
    def name(self) -> str:
        """``DDP``, ``ZeRO-1``, ``ZeRO-2``, ``ZeRO-3``, ``MiCS shard <s>``, then `` + hpZ <n>`` and
        `` + int8 frozen`` for what the entry includes (e.g. ``ZeRO-3 + hpZ 2 + int8 frozen``)."""
        if self.shard_size is not None:
            name = f"MiCS shard {self.shard_size}"
        elif self.hpz_size is not None or self.frozen_int8 is not None:
            name = "ZeRO-3"
        else:
            return STAGE_NAMES[self.stage]
        if self.hpz_size is not None:
            name += f" + hpZ {self.hpz_size}"
        if self.frozen_int8 is not None:
            name += " + int8 frozen"
        return name

    def formula(self, precision: EstimatePrecision) -> str:
        """The entry's formula in ``P`` (parameters), ``N`` (ranks; ``S`` under MiCS), ``n`` (hpZ
        group), ``T`` / ``F`` (trainable / int8-frozen parameters), e.g. ``16T/N + 1.002F/N + 4P/n``."""
        if self.shard_size is None and self.hpz_size is None and self.frozen_int8 is None:
            return precision.formula(self.stage)
        over = "S" if self.shard_size is not None else "N"
        text = f"16T/{over} + 1.002F/{over}" if self.frozen_int8 is not None else f"16P/{over}"
        if self.hpz_size is not None:
            text += " + " + ("2P/n" if precision is EstimatePrecision.MIXED else "4P/n")
        return text

    @property
    def total_bytes(self) -> float:
        """Parameters + gradients + optimizer state."""
        return self.params_bytes + self.gradients_bytes + self.optimizer_bytes


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Result of :func:`estimate_model_states`."""

    num_params: int
    world_size: int
    precision: EstimatePrecision
    stages: tuple[StageMemory, ...]

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready dict (bytes, and totals in GB = 1e9 bytes)."""
        return {
            "num_params": self.num_params,
            "world_size": self.world_size,
            "precision": self.precision.value,
            "bytes_per_param": dict(
                zip(("params", "gradients", "optimizer"), self.precision.bytes_per_param)
            ),
            "stages": [
                {
                    "stage": s.stage,
                    "name": s.name,
                    "shard_size": s.shard_size,
                    "hpz_size": s.hpz_size,
                    "frozen_int8": s.frozen_int8,
                    "params_bytes": s.params_bytes,
                    "gradients_bytes": s.gradients_bytes,
                    "optimizer_bytes": s.optimizer_bytes,
                    "total_bytes": s.total_bytes,
                    "total_gb": s.total_bytes / 1e9,
                }
                for s in self.stages
            ],
        }


def estimate_model_states(
    num_params: int,
    world_size: int,
    precision: EstimatePrecision | str = EstimatePrecision.MIXED,
    stages: tuple[int, ...] = (0, 1, 2, 3),
    mics_shard_size: int | None = None,
    hpz_partition_size: int | None = None,
    frozen_int8_params: int | None = None,
) -> MemoryEstimate:
    """Model-state bytes per rank at each stage (ZeRO paper, Adam).

    The options build on one another, as the engine combines them: the hpZ entry is over the
    MiCS group when ``mics_shard_size`` is given (``N`` becomes ``S``), and the int8-frozen entry
    includes MiCS's group and hpZ's secondary shard when given. The last entry is therefore the
    configuration with every option asked for.
    """
    for what, value in (("num_params", num_params), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{what} must be an integer >= 1, got {value!r}")
    try:
        prec = EstimatePrecision(precision)
    except ValueError:
        raise ValueError(f"precision must be 'mixed' or 'fp32', got {precision!r}") from None
    bad = [s for s in stages if s not in STAGE_NAMES]
    if bad or not stages:
        raise ValueError(f"stages must be a non-empty selection of 0, 1, 2, 3, got {stages!r}")
    p_bytes, g_bytes, o_bytes = prec.bytes_per_param
    psi, share = Fraction(num_params), Fraction(num_params, world_size)
    result = []
    for stage in sorted(set(stages)):
        params = p_bytes * (share if stage >= 3 else psi)
        grads = g_bytes * (share if stage >= 2 else psi)
        optim = o_bytes * (share if stage >= 1 else psi)
        result.append(StageMemory(stage, float(params), float(grads), float(optim)))
    group = world_size
    if mics_shard_size is not None:
        _check_shard_size(mics_shard_size, world_size)
        group = mics_shard_size
        result.append(_stage3_entry(num_params, prec, group, mics_shard_size))
    if hpz_partition_size is not None:
        _check_hpz_size(hpz_partition_size, world_size)
        result.append(_stage3_entry(num_params, prec, group, mics_shard_size, hpz_partition_size))
    if frozen_int8_params is not None:
        frozen = frozen_int8_params
        if isinstance(frozen, bool) or not isinstance(frozen, int) or not 0 <= frozen <= num_params:
            raise ValueError(
                f"frozen_int8_params={frozen!r} must be an integer between 0 and the number of "
                f"parameters ({num_params})"
            )
        result.append(_stage3_entry(num_params, prec, group, mics_shard_size, hpz_partition_size, frozen))
    return MemoryEstimate(num_params, world_size, prec, tuple(result))


FROZEN_INT8_BYTES = Fraction(2048 + 4, 2048)
"""Bytes per element of an int8-stored frozen shard: one code, plus one fp32 scale per 2048."""


def _stage3_entry(
    num_params: int,
    prec: EstimatePrecision,
    group: int,
    shard_size: int | None,
    hpz_size: int | None = None,
    frozen: int | None = None,
) -> StageMemory:
    """ZeRO-3 over ``group`` ranks: ``16T/group`` for the trainable parameters, ``1.002F/group``
    for the int8-frozen ones and, with hpZ, every parameter's secondary shard (``Ψ/hpz_size`` in
    the working precision: the frozen ones' too, as :func:`zero_params.build_secondary` keeps it)."""
    p_bytes, g_bytes, o_bytes = prec.bytes_per_param
    trainable = Fraction(num_params - (frozen or 0), group)
    params = p_bytes * trainable + FROZEN_INT8_BYTES * Fraction(frozen or 0, group)
    if hpz_size is not None:
        params += p_bytes * Fraction(num_params, hpz_size)
    return StageMemory(
        3,
        float(params),
        float(g_bytes * trainable),
        float(o_bytes * trainable),
        shard_size=shard_size,
        hpz_size=hpz_size,
        frozen_int8=frozen,
    )


def _check_hpz_size(hpz_size: int, world_size: int) -> None:
    if isinstance(hpz_size, bool) or not isinstance(hpz_size, int) or hpz_size < 1 or world_size % hpz_size:
        raise ValueError(
            f"zero_hpz_partition_size={hpz_size!r} must be an integer >= 1 dividing the world "
            f"size {world_size} (normally the ranks per node)"
        )


def _check_shard_size(shard_size: int, world_size: int) -> None:
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
        raise ValueError(f"mics_shard_size must be an integer >= 1, got {shard_size!r}")
    if world_size % shard_size:
        raise ValueError(
            f"mics_shard_size={shard_size} does not divide world size {world_size}: MiCS needs "
            f"world_size / mics_shard_size replicas; pick a divisor of {world_size}"
        )


_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_COUNT = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9_]*)?(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]?)\s*$")


def parse_count(text: str) -> int:
    """Parse a parameter count: ``7.5B``, ``125M``, ``350k``, ``1T``, ``1e9``, ``1_000_000``.

    Suffixes (case-insensitive): k = 1e3, M = 1e6, B or G = 1e9, T = 1e12.

    Raises:
        ValueError: not a number, an unknown suffix, or not a whole number >= 1.
    """
    match = _COUNT.match(text)
    if not match or match.group(2).lower() not in _SUFFIXES:
        raise ValueError(f"cannot read {text!r} as a count: write e.g. 7.5B, 125M, 350k or 1e9")
    value = decimal.Decimal(match.group(1).replace("_", "")) * _SUFFIXES[match.group(2).lower()]
    if value != value.to_integral_value() or value < 1:
        raise ValueError(f"{text!r} is {value:f}, not a whole number >= 1")
    return int(value)
