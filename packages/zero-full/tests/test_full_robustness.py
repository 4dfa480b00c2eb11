"""Misuse, non-finite gradients and rank agreement: errors on every rank instead of silent damage."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch

import zero_full
from zero_full import checkpoint
from zero_testing import captured_logs, raised_message
from zero_testing.models import TanhMLP

BATCH = 6


def _net(hidden: int = 13) -> TanhMLP:
    return TanhMLP(11, hidden, 3)


def _data(step, rank=0):
    g = torch.Generator().manual_seed(step * 100 + rank)
    return torch.randn(BATCH, 11, generator=g), torch.randn(BATCH, 3, generator=g)


def _config(stage=3, **extra):
    return {
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}},
        **extra,
    }


def _weights(engine):
    return {n: t.clone() for n, t in engine.consolidated_state_dict().items()}


# --------------------------------------------------------------------------- step() without backward


def _step_without_backward(rank, accumulation):
    engine = zero_full.initialize(_net(), _config(gradient_accumulation_steps=accumulation))
    x, y = _data(0, rank.rank)
    for _ in range(accumulation):
        engine.backward(engine(x, y))
        engine.step()
    before = _weights(engine)
    counters = (engine.micro_steps, engine.global_steps)
    if accumulation > 1:  # one proper micro-step, then a step() with no backward before it
        engine.backward(engine(x, y))
        engine.step()
        counters = (engine.micro_steps, engine.global_steps)
    try:
        engine.step()
    except RuntimeError as exc:
        message = str(exc)
    else:
        message = None
    after = _weights(engine)
    engine.close()
    same = all(torch.equal(before[k], after[k]) for k in before) if before else True
    return message, counters == (engine.micro_steps, engine.global_steps), same


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("accumulation", [1, 3])
def test_step_without_backward_raises_and_changes_nothing(dist, world, accumulation):
    for message, counters_kept, weights_kept in dist.run(world, _step_without_backward, accumulation):
        assert message is not None and "no engine.backward(loss) since the last step()" in message
        assert counters_kept and weights_kept  # no counter moved, no weight decay applied


# --------------------------------------------------------------------------- non-finite gradients


def _nan_on_last_rank(rank, precision, policy, clip, stage, nan_step=2, robustness=None):
    """A NaN in the last rank's input at step ``nan_step`` (of ``nan_step + 2``), under the
    ``nonfinite_gradients`` policy ``policy`` and the other ``robustness`` settings given."""
    robustness = (robustness or {}) | {"nonfinite_gradients": policy}
    config = _config(stage, robustness=robustness, gradient_clipping=clip)
    if precision != "fp32":
        config[precision] = {"enabled": True}
    engine = zero_full.initialize(_net(), config)
    error = None
    with captured_logs("zero.engine") as records:
        for step in range(nan_step + 2):
            x, y = (
                t.to(torch.bfloat16 if precision == "bf16" else torch.float32) for t in _data(step, rank.rank)
            )
            if step == nan_step and rank.rank == rank.world_size - 1:
                x[0, 0] = float("nan")
            engine.backward(engine(x, y))
            if step == nan_step:
                before = _weights(engine)
                state_steps = [s["step"].item() for s in engine.optimizer.torch_optimizer.state.values()]
            try:
                engine.step()
            except zero_full.NonFiniteGradientError as exc:
                error = str(exc)
                break
            if step == nan_step:
                after = _weights(engine)
                unchanged = all(torch.equal(before[k], after[k]) for k in before)
                steps_after = [s["step"].item() for s in engine.optimizer.torch_optimizer.state.values()]
        finite = all(torch.isfinite(t).all() for t in _weights(engine).values())
    result = {
        "error": error,
        "warnings": [m for m in records if "non-finite" in m],
        "finite": bool(finite),
        "skipped": engine.stats.skipped_steps,
    }
    if error is None:
        result.update(unchanged=unchanged, adam_steps=(state_steps, steps_after))
    engine.close()
    return result


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_nan_on_one_rank_skips_the_step_on_every_rank_with_one_warning(dist, precision, clip):
    results = dist.run(2, _nan_on_last_rank, precision, "skip", clip, 3)
    for r, res in enumerate(results):
        assert res["error"] is None and res["finite"] and res["unchanged"], res
        assert res["skipped"] == 1
        before, after = res["adam_steps"]
        assert before == after  # the skipped step is not an optimizer step
        expected = 1 if r == 0 else 0  # one warning, on rank 0, naming the parameter and the rank
        assert len(res["warnings"]) == expected, res
    assert "`a.weight` on rank 1" in results[0]["warnings"][0] and "step 3" in results[0]["warnings"][0]


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_nan_on_one_rank_raises_on_every_rank_with_the_raise_policy(dist, precision, stage):
    # stage 1 in fp32 keeps its gradients in the parameters' flat buffer (views, no flat partition)
    for res in dist.run(2, _nan_on_last_rank, precision, "raise", 0.0, stage):
        assert res["error"] is not None and "`a.weight` on rank 1" in res["error"], res
        assert "nonfinite_gradients" in res["error"]


def _fp16_overflow(rank):
    config = _config(fp16={"enabled": True, "initial_scale_power": 40, "hysteresis": 1})
    engine = zero_full.initialize(_net(), config)
    for step in range(3):
        engine.backward(engine(*(t.half() for t in _data(step, rank.rank))))
        engine.step()
    adam = [s["step"].item() for s in engine.optimizer.torch_optimizer.state.values()]
    out = (engine.global_steps, engine.stats.skipped_steps, adam)
    engine.close()
    return out


def test_fp16_skipped_steps_are_not_optimizer_steps(dist):
    for global_steps, skipped, adam in dist.run(2, _fp16_overflow):
        assert global_steps == 3 and skipped >= 1
        assert all(s == global_steps - skipped for s in adam)  # Adam's own counter skips them too


# --------------------------------------------------------------------------- agreement at initialize


def _mismatch(rank, what):
    hidden = 64 + (rank.rank if what == "hidden" else 0)
    config = _config()
    if what == "config":
        config["optimizer"]["params"]["lr"] = 0.01 * (1 + rank.rank)
    if what == "frozen":
        model = _net(hidden)
        model.b.bias.requires_grad_(rank.rank == 0)
    else:
        model = _net(hidden)
    try:
        engine = zero_full.initialize(model, config)
    except zero_full.RankMismatchError as exc:
        return str(exc)
    engine.close()
    return None


@pytest.mark.parametrize(
    "what,fragment",
    [
        ("hidden", "parameter 'a.weight' differs on rank(s) 1"),
        ("frozen", "parameter 'b.bias' differs on rank(s) 1"),
        ("config", "config key 'optimizer.params.lr' differs on rank(s) 1"),
    ],
)
def test_ranks_that_disagree_raise_at_initialize_naming_the_first_difference(dist, what, fragment):
    for message in dist.run(2, _mismatch, what):
        assert message is not None and fragment in message, message
    if what == "hidden":
        assert "rank 0: shape (64, 11)" in message and "rank 1: shape (65, 11)" in message


def _agree(rank):
    engine = zero_full.initialize(_net(), _config())
    engine.close()
    return True


def test_ranks_that_agree_start(dist):
    assert dist.run(2, _agree) == [True, True]


# --------------------------------------------------------------------------- checkpoint hygiene


def _stale_cleanup(rank, root, leftover):
    engine = zero_full.initialize(_net(), _config())
    engine.backward(engine(*_data(0, rank.rank)))
    engine.step()
    engine.save_checkpoint(root)
    engine.load_checkpoint(root)
    engine.close()
    return True


@pytest.mark.parametrize("when", ["save", "load"])
def test_leftovers_of_dead_writers_are_removed_live_and_foreign_ones_kept(dist, tmp_path, when):
    import json
    import socket

    gone = subprocess.Popen(["true"])
    gone.wait()
    live = subprocess.Popen(["sleep", "60"])  # another job's writer, still saving
    host = socket.gethostname()
    try:
        for name, pid, where in [
            ("global_step7.tmp-0123456789ab", gone.pid, host),  # a writer that died: removed
            ("global_step8.tmp-aaaaaaaaaaaa", live.pid, host),  # alive: kept
            ("global_step9.tmp-bbbbbbbbbbbb", gone.pid, "another-host"),  # cannot tell: kept
            ("global_step5.tmp-dddddddddddd", 0, host),  # names no process (a group): kept
            ("global_step4.tmp-eeeeeeeeeeee", -1, host),  # names no process (all of them): kept
        ]:
            stale = tmp_path / name
            stale.mkdir()
            (stale / "rank00000.pt").write_bytes(b"x" * 1000)
            (stale / ".writer").write_text(json.dumps({"pid": pid, "host": where}))
        (tmp_path / "global_step6.tmp-cccccccccccc").mkdir()  # no lock: kept
        (tmp_path / f".latest.tmp-{gone.pid}").write_text("global_step7")  # dead writer: removed
        (tmp_path / ".latest.tmp-0").write_text("global_step5")  # names no process: kept
        dist.run(2, _stale_cleanup, str(tmp_path), when)
    finally:
        live.kill()
        live.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".latest.tmp-0",
        "global_step1",
        "global_step4.tmp-eeeeeeeeeeee",
        "global_step5.tmp-dddddddddddd",
        "global_step6.tmp-cccccccccccc",
        "global_step8.tmp-aaaaaaaaaaaa",
        "global_step9.tmp-bbbbbbbbbbbb",
        "latest",
    ]


def _disk_full(rank, root, fake_free):
    from zero_full.checkpoint import hygiene as ckpt_hygiene

    engine = zero_full.initialize(_net(300), _config())
    engine.backward(engine(*_data(0, rank.rank)))
    engine.step()
    engine.save_checkpoint(root)  # fits
    engine.backward(engine(*_data(1, rank.rank)))
    engine.step()
    filler = os.path.join(root, "filler")
    if rank.rank == 0 and not fake_free:  # leave 20 kB: less than the next checkpoint needs
        free = shutil.disk_usage(root).free
        with open(filler, "wb") as f:
            f.write(b"\0" * max(free - 20_000, 0))
    real = ckpt_hygiene.shutil.disk_usage
    if fake_free:  # no tmpfs could be mounted: the file system says 20 kB are free
        ckpt_hygiene.shutil = _FakeShutil(real)  # type: ignore[assignment]
    try:
        message = raised_message(checkpoint.CheckpointError, engine.save_checkpoint, root)
    finally:
        ckpt_hygiene.shutil = shutil
    loaded = engine.load_checkpoint(root).name  # the previous checkpoint still loads
    engine.close()
    return message, loaded


class _FakeShutil:
    def __init__(self, real):
        self._real = real

    def disk_usage(self, path):
        usage = self._real(path)
        return type(usage)(usage.total, usage.total - 20_000, 20_000)

    def __getattr__(self, name):
        return getattr(shutil, name)


def test_a_full_disk_is_an_error_before_writing_and_the_previous_checkpoint_loads(dist, tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)]).returncode == 0
    try:
        results = dist.run(2, _disk_full, str(disk), not mounted)
        names = sorted(p.name for p in disk.iterdir() if p.name != "filler")
    finally:
        if mounted:
            subprocess.run(["umount", str(disk)], check=True)
    for message, loaded in results:
        assert message is not None and "not enough free space for checkpoint" in message, message
        assert f"to {disk}/global_step2.tmp-" in message and "Nothing was written" in message
        assert loaded == "global_step1"
    assert names == ["global_step1", "latest"]  # no leftover of the failed save
