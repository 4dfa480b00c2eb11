"""PyTorch Lightning: ``Trainer(strategy="zero_stage_1" | "zero_stage_2" | "zero_stage_3")``.

Importing this module registers the three names in Lightning's strategy registry
(Lightning discovers strategies only in its own package: there is no entry-point hook, so
the import is needed). Every other setting goes through the class::

    import zero_full.lightning
    trainer = lightning.pytorch.Trainer(strategy="zero_stage_3", accelerator="cpu", devices=2)
    trainer = lightning.pytorch.Trainer(
        strategy=zero_full.lightning.ZeroStrategy(config={"zero_optimization": {"stage": 3,
                                                              "mics_shard_size": 2}}))

Lightning Fabric: ``Fabric(strategy=zero_full.lightning.ZeroFabricStrategy(config=...))``.

Needs ``lightning`` (``pip install zero-full[lightning]``).
"""

from zero_full.lightning.fabric import ZeroFabricStrategy
from zero_full.lightning.precision import ZeroPrecision
from zero_full.lightning.strategy import ZeroStrategy

try:
    from lightning.pytorch.strategies import StrategyRegistry
except ImportError as exc:  # the extra is not installed
    raise ImportError("zero_full.lightning needs Lightning: pip install 'zero-full[lightning]'") from exc

__all__ = ["ZeroFabricStrategy", "ZeroPrecision", "ZeroStrategy"]

for _stage in (1, 2, 3):
    if f"zero_stage_{_stage}" not in StrategyRegistry:
        StrategyRegistry.register(
            f"zero_stage_{_stage}", ZeroStrategy, description=f"zero, ZeRO stage {_stage}", stage=_stage
        )
del _stage
