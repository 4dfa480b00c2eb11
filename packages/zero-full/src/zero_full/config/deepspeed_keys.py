"""DeepSpeed keys that no zero section declares, each declared once here with what zero does with it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["DEEPSPEED_KEYS", "Known", "known_key"]


def _never(_: Any) -> bool:
    return False


def _always(_: Any) -> bool:
    return True


def _disabled(value: Any) -> bool:
    """A section that turns itself off (``{"enabled": false}``), or an empty one / ``false`` / ``null``."""
    if isinstance(value, Mapping):
        return not value or value.get("enabled") is False
    return value is None or value is False


@dataclasses.dataclass(frozen=True)
class Known:
    """A DeepSpeed key without a zero field."""

    why: str
    silent: Callable[[Any], bool] = _never
    refuses: Callable[[Any], bool] = _never
    rewrite: Callable[[dict[str, Any], Any], None] | None = None


def _equals(*values: Any) -> Callable[[Any], bool]:
    return lambda v: any(v == x and isinstance(v, bool) == isinstance(x, bool) for x in values)


def _is_true(value: Any) -> bool:
    return value is True


def _not_disabled(value: Any) -> bool:
    return not _disabled(value)


def _offload(target: str) -> Callable[[dict[str, Any], Any], None]:
    def rewrite(section: dict[str, Any], value: Any) -> None:
        if value is True:
            section.setdefault(target, {"device": "cpu"})

    return rewrite


def _pin_memory(section: dict[str, Any], value: Any) -> None:
    if value is True:
        for target in ("offload_optimizer", "offload_param"):
            if isinstance(section.get(target), dict):
                section[target].setdefault("pin_memory", True)


_NO_FEATURE = 'zero has no {what}; remove the section (or set "enabled": false) to train with zero'
_LOSS_SCALE_BF16 = "bf16 uses no loss scaling (as in DeepSpeed, where these keys have no effect under bf16)"
_FP32_MASTERS = "zero keeps fp32 master weights and gradients"
_FP32_STATES = "zero keeps optimizer states in fp32"
_NONFINITE_BF16 = "robustness.nonfinite_gradients governs non-finite gradients under bf16"
_ALL_GATHER = "zero gathers parameters with all-gather"
_OWN_SWAP_PIPELINE = "zero swaps parameters with its own pipelining"


def _feature(what: str) -> Known:
    return Known(_NO_FEATURE.format(what=what), silent=_disabled, refuses=_not_disabled)


def _no_effect(why: str) -> Known:
    """A key whose value changes nothing in zero: never reported."""
    return Known(why, silent=_always)


def _silent_if_false(why: str) -> Known:
    """A key reported unless ``false`` (its DeepSpeed default, which asks for nothing)."""
    return Known(why, silent=_equals(False))


def _refused_if_true(why: str) -> Known:
    """A key zero cannot honour when ``true``: silent when ``false``, reported otherwise."""
    return Known(why, silent=_equals(False), refuses=_is_true)


DEEPSPEED_KEYS: dict[tuple[str, ...], Known] = {
    # ---------------------------------------------------------------- top level
    ("prescale_gradients",): _silent_if_false(
        "zero sums gradients, then divides by the world size (prescaling changes only rounding)"
    ),
    ("gradient_predivide_factor",): Known(
        "zero sums gradients, then divides by the world size (a predivide factor changes only rounding)",
        silent=_equals(1, 1.0),
    ),
    ("sparse_gradients",): _silent_if_false("zero reduces gradients dense"),
    ("zero_allow_untested_optimizer",): _no_effect("zero runs any torch optimizer"),
    ("zero_force_ds_cpu_optimizer",): _silent_if_false(
        "zero steps offloaded optimizers with its own CPU optimizer"
    ),
    ("fp16_master_weights_and_grads",): _refused_if_true(_FP32_MASTERS),
    ("bf16_master_weights_and_grads",): _refused_if_true(_FP32_MASTERS),
    ("bf16_optimizer_states",): _refused_if_true(_FP32_STATES),
    ("amp",): Known(
        'Apex AMP is not supported; use "fp16" or "bf16"', silent=_disabled, refuses=_not_disabled
    ),
    ("torch_autocast",): Known(
        "torch autocast from the config is not supported; use torch.autocast in the model, or bf16",
        silent=_disabled,
        refuses=_not_disabled,
    ),
    ("data_types",): Known(
        "gradients are accumulated in the working precision (fp32 masters)",
        silent=lambda v: isinstance(v, Mapping) and v.get("grad_accum_dtype") in (None, "fp32"),
    ),
    ("activation_checkpointing",): Known(
        "not applied from the config: checkpoint in the model with torch.utils.checkpoint, or call "
        "zero_full.deepspeed.checkpointing.checkpoint (torch's non-reentrant checkpoint; its configure() "
        "reads this section); partition_activations and cpu_checkpointing are not offered"
    ),
    ("memory_breakdown",): _silent_if_false("use engine.memory_report()"),
    ("dump_state",): _silent_if_false("zero prints no state dump"),
    ("disable_allgather",): _silent_if_false("zero always all-gathers partitions"),
    ("disable_python_gc",): _silent_if_false("zero leaves Python's garbage collector alone"),
    ("dataloader_drop_last",): _silent_if_false("zero builds no data loader from the config"),
    ("gradient_allreduce_op",): Known("zero averages gradients", silent=_equals("mean")),
    ("checkpoint",): Known(
        "zero's checkpoints are written and checked their own way (tag validation, node-local "
        "storage, parallel writes and universal loading do not apply)",
        silent=_disabled,
    ),
    ("aio",): Known("zero's NVMe offload chooses its own I/O settings", silent=_disabled),
    ("autotuning",): Known(
        "autotuning is a DeepSpeed launcher feature; the run trains with the config as given",
        silent=_disabled,
    ),
    ("compile",): Known("use engine.compile()", silent=_disabled),
    ("nebula",): Known("zero has no Nebula checkpoint service", silent=_disabled),
    ("timers",): Known("zero marks its phases with torch.profiler", silent=_disabled),
    ("graph_harvesting",): _silent_if_false("zero does not capture CUDA graphs"),
    ("use_data_before_expert_parallelism",): _silent_if_false("zero has no expert parallelism"),
    ("seq_parallel_communication_data_type",): _no_effect("zero has no sequence parallelism"),
    ("vocabulary_size",): _no_effect("used by DeepSpeed's pipeline engine only"),
    ("elasticity",): _feature("elastic training"),
    ("pipeline",): _feature("pipeline parallelism"),
    ("moe",): _feature("mixture-of-experts parallelism"),
    ("compression_training",): _feature("compression training"),
    ("sparse_attention",): _feature("sparse attention kernels"),
    ("curriculum_learning",): _feature("curriculum learning"),
    ("data_efficiency",): _feature("data-efficiency pipeline (curriculum, random-LTD)"),
    ("progressive_layer_drop",): _feature("progressive layer drop"),
    ("eigenvalue",): _feature("eigenvalue computation"),
    ("quantize_training",): _feature("quantization-aware training"),
    ("weight_quantization",): _feature("weight quantization"),
    ("hybrid_engine",): _feature("hybrid (RLHF) engine"),
    ("tensor_parallel",): _feature("tensor parallelism"),
    ("sequence_parallel_size",): Known(
        "zero has no sequence parallelism", silent=_equals(1), refuses=lambda v: v != 1
    ),
    # ---------------------------------------------------------------- precision sections
    ("fp16", "fp16_master_weights_and_grads"): _refused_if_true(_FP32_MASTERS),
    ("fp16", "bf16_master_weights_and_grads"): _silent_if_false("bf16 key, no effect under fp16"),
    ("bf16", "loss_scale"): Known(_LOSS_SCALE_BF16, silent=_equals(0, 0.0)),
    ("bf16", "initial_scale_power"): Known(_LOSS_SCALE_BF16),
    ("bf16", "loss_scale_window"): Known(_LOSS_SCALE_BF16),
    ("bf16", "hysteresis"): Known(_LOSS_SCALE_BF16),
    ("bf16", "consecutive_hysteresis"): Known(_LOSS_SCALE_BF16),
    ("bf16", "min_loss_scale"): Known(_LOSS_SCALE_BF16),
    ("bf16", "auto_cast"): _refused_if_true("bf16: inputs are not cast"),
    ("bf16", "immediate_grad_update"): _no_effect(
        "zero accumulates gradients into its flat partitions as they are reduced"
    ),
    ("bf16", "check_overflow"): _silent_if_false(_NONFINITE_BF16),
    ("bf16", "check_grad_overflow"): _silent_if_false(_NONFINITE_BF16),
    ("bf16", "bf16_master_weights_and_grads"): _refused_if_true(_FP32_MASTERS),
    ("bf16", "bf16_optimizer_states"): _refused_if_true(_FP32_STATES),
    # ---------------------------------------------------------------- zero_optimization
    ("zero_optimization", "cpu_offload"): Known(
        'a deprecated DeepSpeed key: true means "offload_optimizer": {"device": "cpu"}',
        silent=_equals(False),
        rewrite=_offload("offload_optimizer"),
    ),
    ("zero_optimization", "cpu_offload_param"): Known(
        'a deprecated DeepSpeed key: true means "offload_param": {"device": "cpu"}',
        silent=_equals(False),
        rewrite=_offload("offload_param"),
    ),
    ("zero_optimization", "cpu_offload_use_pin_memory"): Known(
        "a deprecated DeepSpeed key: true means pin_memory in the offload sections",
        silent=_equals(False),
        rewrite=_pin_memory,
    ),
    ("zero_optimization", "elastic_checkpoint"): _no_effect("zero's checkpoints load at any world size"),
    ("zero_optimization", "legacy_stage1"): _silent_if_false("zero has one stage 1"),
    ("zero_optimization", "allgather_sequential"): _silent_if_false("zero all-gathers in buckets"),
    ("zero_optimization", "compute_grad_norm"): _no_effect("zero computes the gradient norm when clipping"),
    ("zero_optimization", "enable_sanity_checks"): _silent_if_false(
        "robustness.check_rank_agreement checks the ranks"
    ),
    ("zero_optimization", "memory_efficient_linear"): _no_effect(
        "zero gathers parameters for torch's own Linear"
    ),
    ("zero_optimization", "use_multi_rank_bucket_allreduce"): _no_effect(
        "zero reduces each bucket in one collective"
    ),
    ("zero_optimization", "use_all_reduce_for_fetch_params"): _silent_if_false(_ALL_GATHER),
    ("zero_optimization", "stage3_use_all_reduce_for_fetch_params"): _silent_if_false(_ALL_GATHER),
    ("zero_optimization", "pipeline_loading_checkpoint"): _silent_if_false(
        "zero has no pipeline parallelism"
    ),
    ("zero_optimization", "override_module_apply"): _no_effect("zero_full.Init does not wrap Module.apply"),
    ("zero_optimization", "log_trace_cache_warnings"): _silent_if_false("zero logs trace changes itself"),
    ("zero_optimization", "parameter_alignment"): _no_effect("zero aligns its flat buffers itself"),
    ("zero_optimization", "leaf_module"): Known(
        "use stage3_module_granularity_threshold to gather blocks as one leaf"
    ),
    ("zero_optimization", "zenflow"): _feature("ZenFlow offload"),
    ("zero_optimization", "save_muon_momentum_buffer_in_memory"): _silent_if_false("zero has no Muon"),
    ("zero_optimization", "offload_optimizer", "super_offload"): _refused_if_true("zero has no SuperOffload"),
    ("zero_optimization", "offload_optimizer", "cpuadam_cores_perc"): _no_effect(
        "zero's CPU optimizer uses torch's threads"
    ),
    ("zero_optimization", "offload_param", "pipeline_read"): _no_effect(_OWN_SWAP_PIPELINE),
    ("zero_optimization", "offload_param", "pipeline_write"): _no_effect(_OWN_SWAP_PIPELINE),
}


def known_key(path: tuple[str, ...]) -> Known | None:
    """The declaration of the DeepSpeed key at ``path`` (e.g. ``("bf16", "loss_scale")``), if any."""
    return DEEPSPEED_KEYS.get(path)
