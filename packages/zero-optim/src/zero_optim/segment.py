"""Where one parameter's partition lives in its optimizer group's flat buffers."""

from __future__ import annotations

import dataclasses

from torch import nn

__all__ = ["Segment"]


@dataclasses.dataclass(frozen=True)
class Segment:
    """Where one parameter's partition lives in its group's flat buffers.

    Attributes:
        param: The model parameter.
        name: Its qualified name (for messages and state dicts).
        offset: First element in the flat buffers.
        numel: Elements of this rank's partition (padding included).
    """

    param: nn.Parameter
    name: str
    offset: int
    numel: int
