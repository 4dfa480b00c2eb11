"""``import zero_full.deepspeed as deepspeed``: a DeepSpeed training script on zero, unchanged.

The calls a DeepSpeed script makes, with DeepSpeed's signatures and return values, over
zero's own API (which stays as it is):

```python
import zero_full.deepspeed as deepspeed

deepspeed.init_distributed()
engine, optimizer, loader, scheduler = deepspeed.initialize(
    args=args, model=model, model_parameters=model.parameters(), training_data=dataset,
    config="ds_config.json")
for batch in loader:
    loss = engine(batch)
    engine.backward(loss)
    engine.step()
engine.save_checkpoint("ckpt", client_state={"epoch": 1})
path, client_state = engine.load_checkpoint("ckpt")
```

Modules: :mod:`~zero_full.deepspeed.initialization` (``initialize``),
:mod:`~zero_full.deepspeed.engine` (``DeepSpeedEngine``), :mod:`~zero_full.deepspeed.launch`
(``init_distributed``, ``add_config_arguments``), :mod:`~zero_full.deepspeed.zero`
(``zero.Init``, ``zero.GatheredParameters``, ``zero.register_external_parameter``),
:mod:`~zero_full.deepspeed.checkpointing` (activation checkpointing),
:mod:`~zero_full.deepspeed.comm` (rank and collective forwards to ``torch.distributed``),
:mod:`~zero_full.deepspeed.accelerator` (``get_accelerator``).
"""

from zero_full.deepspeed import accelerator, checkpointing, comm, zero
from zero_full.deepspeed.accelerator import get_accelerator
from zero_full.deepspeed.engine import DeepSpeedEngine
from zero_full.deepspeed.initialization import initialize
from zero_full.deepspeed.launch import add_config_arguments, init_distributed

__all__ = [
    "DeepSpeedEngine",
    "accelerator",
    "add_config_arguments",
    "checkpointing",
    "comm",
    "get_accelerator",
    "init_distributed",
    "initialize",
    "zero",
]
