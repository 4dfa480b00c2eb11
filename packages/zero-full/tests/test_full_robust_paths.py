"""Ranks that take different paths, stop or die: every live rank raises a diagnosis, nothing aborts.

The failing runs raise on purpose so that the pool of ranks (whose process group is wedged after
a failed collective) is torn down: each rank raises ``RuntimeError("RESULT {json}")`` with what
it saw, and the test reads every rank's line from the pool's failure report.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Callable

import pytest
import torch

import zero_full
from zero_testing.models import PathNet
from zero_testing.pool import RankFailure

STEPS = 3
TIMEOUT = 20.0  # generous: the test machine is loaded; the diagnoses below come much sooner
ROBUST = {"comm_timeout": TIMEOUT, "heartbeat_interval": 0.5}


def _net() -> PathNet:
    return PathNet(7, 13, 3)


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(5, 7, generator=torch.Generator().manual_seed(1000 * step + rank))


def _config(stage: int) -> dict:
    return {
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}},
        "robustness": ROBUST,  # check_paths stays at its default (false)
    }


def _report(rank: int, exc: BaseException, start: float) -> RuntimeError:
    seconds = time.monotonic() - start
    found = {"rank": rank, "error": type(exc).__name__, "message": str(exc), "seconds": seconds}
    return RuntimeError("RESULT " + json.dumps(found))


def _run_steps(rank: int, one_step: Callable[[int], None], steps: int = STEPS) -> RuntimeError | None:
    """``one_step(step)`` for each of the ``STEPS`` steps; the error for rank ``rank`` to raise with
    what it raised (:func:`_report`), or ``None`` when every step ran."""
    start = time.monotonic()
    try:
        for step in range(steps):
            one_step(step)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return _report(rank, exc, start)
    return None


def _results(failure: RankFailure) -> dict[int, dict]:
    found = {}
    for m in re.finditer(r"RESULT (\{.*\})", str(failure)):
        d = json.loads(m.group(1))
        found[d["rank"]] = d
    return found


# --------------------------------------------------------------------------- an extra submodule call


def _extra_call(rank, stage, everywhere=False, prefetch=True):
    """The last rank (``everywhere``: every rank) calls ``mid`` once more in the forward of step 1.

    ``prefetch=False``: the other ranks' next collective is the gather of ``out`` (another size
    than ``mid``'s); before the path check every rank waited for ``comm_timeout`` (20 s here).
    """
    config = _config(stage)
    if not prefetch:
        config["zero_optimization"]["stage3_prefetch_bucket_size"] = 0
    engine = zero_full.initialize(_net(), config)
    last = rank.world_size - 1

    def one_step(step):
        loss = engine(_batch(step, rank.rank), extra=(everywhere or rank.rank == last) and step == 1)
        engine.backward(loss)
        engine.step()

    error = _run_steps(rank.rank, one_step)
    if error is not None:
        raise error
    weights = {k: v.clone() for k, v in engine.consolidated_state_dict().items()}
    engine.close()
    return weights


@pytest.mark.parametrize("world,prefetch", [(2, True), (2, False), (4, True)])
def test_an_extra_call_on_one_rank_raises_on_every_rank_naming_the_module_in_stage_3(dist, world, prefetch):
    with pytest.raises(RankFailure) as info:
        dist.run(world, _extra_call, 3, False, prefetch)
    results = _results(info.value)
    last = world - 1
    assert sorted(results) == list(range(world)), str(info.value)
    for r, res in results.items():
        assert res["error"] == "RanksDivergedError", res
        message = res["message"]
        assert f"rank {last} runs `mid` (forward) where its recorded order has 'out' (forward)" in message
        assert "ranks took different paths" in message, message
        if r != last:  # its own position first (ranks in order), then the rank that left the path
            assert message.startswith(f"rank {r} ") and "(call " in message, message
        else:  # the ranks it found further along the recorded order
            assert re.match(r"rank \d .*\(call \d+\) while rank \d ", message), message
        assert res["seconds"] < 15  # well before comm_timeout


def _reference(world: int, everywhere: bool = False) -> dict[str, torch.Tensor]:
    """Plain torch: the mean of every rank's loss (the last rank's with the extra call at step 1)."""
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.0)
    for step in range(STEPS):
        opt.zero_grad()
        extra = [(everywhere or r == world - 1) and step == 1 for r in range(world)]
        loss = sum(model(_batch(step, r), extra=extra[r]) for r in range(world)) / world
        loss.backward()
        opt.step()
    return model.state_dict()


@pytest.mark.parametrize("world", [2, 4])
def test_an_extra_call_on_one_rank_is_legal_data_parallelism_in_stage_2(dist, world):
    # Stage 2 reduces every gradient once per backward, whatever ran: the ranks' collectives stay
    # paired, and the result is the mean of the ranks' losses, as in DDP.
    expected = _reference(world)
    weights = dist.run(world, _extra_call, 2)[0]  # the consolidated state dict lives on rank 0
    for name, ref in expected.items():
        torch.testing.assert_close(weights[name], ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world", [2, 4])
def test_the_same_extra_call_on_every_rank_trains_on_in_stage_3(dist, world):
    # a data-dependent branch every rank takes alike leaves the recorded order on every rank: no error
    expected = _reference(world, everywhere=True)
    weights = dist.run(world, _extra_call, 3, True)[0]
    for name, ref in expected.items():
        torch.testing.assert_close(weights[name], ref, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- a stopped or killed rank


def _stopped_or_killed(rank, how):
    """The last rank stops (SIGSTOP) or dies (SIGKILL) before the forward of step 1."""
    engine = zero_full.initialize(_net(), _config(3))
    last = rank.world_size - 1
    pid_file = os.path.join(rank.workdir, f"stopped_rank_{how}.pid")
    if rank.rank == last:
        with open(pid_file, "w") as f:
            f.write(str(os.getpid()))

    def one_step(step):
        if step == 1 and rank.rank == last:
            os.kill(os.getpid(), signal.SIGSTOP if how == "stop" else signal.SIGKILL)
        engine.backward(engine(_batch(step, rank.rank)))
        engine.step()

    error = _run_steps(rank.rank, one_step)
    if error is None:
        engine.close()
        return None
    if rank.rank == 0 and how == "stop":  # the diagnosis is in: end the stopped rank now
        with open(pid_file) as f:
            os.kill(int(f.read()), signal.SIGKILL)
    raise error


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_a_stopped_or_killed_rank_among_four_is_named(dist, how):
    with pytest.raises(RankFailure) as info:
        dist.run(4, _stopped_or_killed, how)
    results = _results(info.value)
    assert sorted(results) == [0, 1, 2], str(info.value)
    for res in results.values():
        assert res["error"] == "CollectiveTimeoutError", res
        message = res["message"]
        assert "rank 3 sent no heartbeat for" in message and "it died or is stuck" in message, message
        assert not message.startswith("[") and "Connection reset" not in message.split(". This rank")[0]
        assert res["seconds"] < 15  # well before comm_timeout


# --------------------------------------------------------------------------- a backward skipped on one rank


def _skipped_backward(rank, stage, at=1):
    """The last rank skips the backward and step of step ``at`` (a non-finite loss, say) and goes on."""
    engine = zero_full.initialize(_net(), _config(stage))
    last = rank.world_size - 1

    def one_step(step):
        loss = engine(_batch(step, rank.rank))
        if step == at and rank.rank == last:
            return
        engine.backward(loss)
        engine.step()

    error = _run_steps(rank.rank, one_step, steps=at + 2)
    if error is not None:
        raise error
    engine.close()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_backward_skipped_on_one_rank_is_named_on_every_rank_at_the_next_check(dist, stage):
    # Below stage 3 the forward issues no collective and is not checked; the count of unchecked
    # calls in the next signature still tells the rank that skipped (1 forward against 2).
    with pytest.raises(RankFailure) as info:
        dist.run(2, _skipped_backward, stage, timeout=300)
    results = _results(info.value)
    assert sorted(results) == [0, 1], str(info.value)
    if stage == 3:
        names = ("rank 0 calls engine.backward at optimizer step 1, micro-step 1 (after call ", ") while ")
        other = "rank 1 calls engine.forward at optimizer step 1, micro-step 1 (after call "
    else:
        names = ("rank 0 calls engine.backward at optimizer step 1, micro-step 1 (after call ",)
        names += ("; 1 unchecked engine calls since its last checked call) while ",)
        other = "rank 1 calls engine.backward at optimizer step 1, micro-step 1 (after call "
        names += ("; 2 unchecked engine calls since its last checked call): ranks took different paths",)
    for res in results.values():
        assert res["error"] == "RanksDivergedError", res
        message = res["message"]
        assert all(n in message for n in names) and other in message, message
        assert res["seconds"] < 15  # well before comm_timeout


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_backward_skipped_once_the_calls_are_recorded_is_named_on_every_rank(dist, stage):
    # At step 3 every call is predicted from the ones recorded before, and nothing is exchanged:
    # the rank that skipped departs from the prediction (below stage 3 its forward issues no
    # collective and is not checked; the count of unchecked calls tells it, 2 against 1) and
    # agrees through the store; the other went on along it and is named by its engine call.
    with pytest.raises(RankFailure) as info:
        dist.run(2, _skipped_backward, stage, 3, timeout=300)
    results = _results(info.value)
    assert sorted(results) == [0, 1], str(info.value)
    went_on = re.compile(r"rank 0 calls engine\.(backward|step) at optimizer step 3, micro-step [34] and ")
    if stage == 3:
        departed = "rank 1 calls engine.forward at optimizer step 3, micro-step 3 where"
    else:
        departed = (
            "rank 1 calls engine.backward at optimizer step 3, micro-step 3 after 2 unchecked engine calls"
        )
    recorded = "where the ranks' recorded calls have engine."
    for res in results.values():
        assert res["error"] == "RanksDivergedError", res
        message = res["message"]
        assert went_on.search(message) and departed in message and recorded in message, message
        assert res["seconds"] < 15  # well before comm_timeout


def _checks_per_step(rank, stage, clip):
    """Collectives of the first and of the third optimizer step (2 micro-steps each) with the
    engine-call check on, minus off."""
    issued = {}
    for on in (True, False):
        config = _config(stage) | {"gradient_accumulation_steps": 2, "train_micro_batch_size_per_gpu": 5}
        config["gradient_clipping"] = clip
        config["robustness"] = ROBUST | {"check_calls": on}
        engine = zero_full.initialize(_net(), config)
        counts = []
        for step in range(3):
            before = engine.watchdog.position().call
            for micro in range(2):
                engine.backward(engine(_batch(2 * step + micro, rank.rank)))
                engine.step()
            counts.append(engine.watchdog.position().call - before)
        issued[on] = (counts[0], counts[2])
        engine.close()
    return [a - b for a, b in zip(issued[True], issued[False])]


@pytest.mark.parametrize(("stage", "clip", "expected"), [(0, 0.0, 2), (2, 0.0, 2), (3, 0.0, 4), (3, 1.0, 5)])
def test_only_calls_that_communicate_are_checked_and_only_until_their_sequence_is_recorded(
    dist, stage, clip, expected
):
    # The first optimizer step exchanges signatures. Stage 3: each forward and backward gathers
    # (2 x 2 micro-steps); the step is checked only before a collective of its own (clipping's
    # norm all-reduce; re-gathering persistent parameters, which this model, all partitioned,
    # has none of). Below: the boundary backward and the step (the rest only accumulates
    # gradients locally). From then on the calls hold the recorded sequence: none is exchanged.
    assert dist.run(2, _checks_per_step, stage, clip, timeout=300) == [[expected, 0], [expected, 0]]


def _two_engines_alive(rank, stage):
    """A second engine built while the first lives (and beats): its saves every other step depart
    from the recorded calls, agreed through the store; the first engine's record, further along
    and published last, must never be read as the second's."""
    import torch.distributed as torch_dist

    first = zero_full.initialize(_net(), _config(stage))
    for step in range(4):
        first.backward(first(_batch(step, rank.rank)))
        first.step()
    second = zero_full.initialize(_net(), _config(stage))
    second.watchdog.publish()
    torch_dist.barrier()
    first.watchdog.publish()  # the last word of every rank: the first engine's record
    torch_dist.barrier()
    peer = second.watchdog.peers()[1 - rank.rank]
    seen = (peer.call, second.watchdog.calls_issued)
    for step in range(6):
        second.backward(second(_batch(step, rank.rank)))
        second.step()
        if step % 2:
            first.watchdog.publish()
            second.save_checkpoint(f"{rank.workdir}/two_engines_{stage}", tag=f"s{step}", overwrite=True)
    second.close()
    first.close()
    return seen


@pytest.mark.parametrize("stage", [1, 3])
def test_an_engine_built_while_another_lives_reads_only_its_own_peers_records(dist, stage):
    for peer_call, own_call in dist.run(2, _two_engines_alive, stage, timeout=300):
        assert peer_call == own_call
