"""The zero training product: DeepSpeed-style config, initialize() -> engine, checkpoints, the `zero` CLI.

```python
import zero_full

cfg = zero_full.ZeroConfig.model_validate({"zero_optimization": {"stage": 3}})
with zero_full.Init(config=cfg):                 # optional: partition while constructing
    model = build_model()
engine = zero_full.initialize(model, config=cfg,
                              optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))
loss = engine(batch)
engine.backward(loss)
engine.step()
```
"""

from zero_full.checkpoint import CheckpointError
from zero_full.config.zero_config import ZeroConfig
from zero_full.engine import Engine, EngineStats, Init, initialize
from zero_full.guards.agreement import RankMismatchError
from zero_full.guards.nonfinite import NonFiniteGradientError
from zero_full.hf.load import LoadReport, from_pretrained, load_safetensors_into
from zero_full.hf.save import SavedPretrained
from zero_full.memory.report import MemoryReport
from zero_params import GatheredParameters, register_external_parameter

__all__ = [
    "CheckpointError",
    "Engine",
    "EngineStats",
    "GatheredParameters",
    "Init",
    "LoadReport",
    "MemoryReport",
    "NonFiniteGradientError",
    "RankMismatchError",
    "SavedPretrained",
    "ZeroConfig",
    "from_pretrained",
    "initialize",
    "load_safetensors_into",
    "register_external_parameter",
]
