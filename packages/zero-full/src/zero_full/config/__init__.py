"""The zero configuration: DeepSpeed-style JSON validated into frozen, typed sections."""

from zero_full.config.zero_config import Precision, ZeroConfig

__all__ = ["Precision", "ZeroConfig"]
