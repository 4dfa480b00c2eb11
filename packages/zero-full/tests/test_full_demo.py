"""``zero train``: a real 2-rank training with its summary table, and a rank dying mid-run."""

from __future__ import annotations

import importlib.util
import json
import math
import pathlib
import re
import time

import pytest

from zero_full.cli.main import main
from zero_full.cli.train.options import TrainOptions, build_config
from zero_full.cli.train.run import TrainError, _Progress, run_training

TINY = "--layers 1 --hidden 32 --heads 2 --vocab 97 --seq 16 --micro-batch 2".split()


def summary_rows(text: str) -> dict[str, str]:
    """``{metric: value}`` of the summary table (cells split on the first run of 2+ spaces)."""
    rows = {}
    for line in text.splitlines():
        if line.startswith("  "):
            cells = re.split(r"\s{2,}", line.strip(), maxsplit=1)
            if len(cells) == 2:
                rows[cells[0]] = cells[1]
    return rows


def megabytes(cell: str) -> float:
    number, unit = cell.split()[:2]
    return float(number) * {"B": 1e-6, "kB": 1e-3, "MB": 1.0, "GB": 1e3}[unit]


def test_train_prints_the_summary_and_the_loss_goes_down(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["train", "--world", "2", "--steps", "4", "--no-progress", *TINY])
    out = capsys.readouterr().out
    assert code == 0, out
    rows = summary_rows(out)
    psi = int(re.search(r"P = ([\d,]+) parameters", out).group(1).replace(",", ""))
    # 1 block of 32 hidden, 97 x 32 tied embeddings, 16 x 32 positions, 2 final-norm vectors
    assert psi == 12 * 32 * 32 + 13 * 32 + 97 * 32 + 16 * 32 + 2 * 32
    assert "ZeRO stage 3, 2 ranks (1 node(s) x 2)" in out
    for rank in (0, 1):
        # stage 3, fp32 AdamW: 16 bytes per parameter over 2 ranks, plus padding and the
        # (small) persistent tensors every rank keeps whole
        measured = megabytes(rows[f"model states, rank {rank} (measured)"])
        assert 16 * psi / 2 / 1e6 * 0.99 <= measured < 16 * psi / 1e6
        # real memory: RSS at rest and the step's peak above the runtime (torch + gloo: > 150 MB)
        rss = re.fullmatch(
            r"(.+) / (.+) above the runtime's (.+)", rows[f"RSS at rest / step peak, rank {rank}"]
        )
        rest, peak, runtime = (megabytes(rss.group(i)) for i in (1, 2, 3))
        assert runtime > 150 and 0 < rest < 200 and peak >= rest - 1
    assert megabytes(rows["DDP would hold (16P, fp32 AdamW)"]) == pytest.approx(16 * psi / 1e6, abs=0.05)
    assert megabytes(rows["ZeRO-3 formula (16P/N)"]) == pytest.approx(8 * psi / 1e6, abs=0.05)
    sent = rows["communicated per step (rank 0)"]
    assert megabytes(sent) > 0 and "collectives" in sent
    assert "elements" in rows["peak live parameters"]
    assert re.match(r"\d+\.\d% \(\d+ hits, \d+ misses, steps 2-4\)", rows["prefetch hit rate"])
    first, final = (float(x) for x in rows["loss (first -> final step)"].split(" -> "))
    assert math.isfinite(final) and "final loss" not in rows  # the row above already says it
    assert re.fullmatch(r"\d+\.\d s", rows["start-up (processes, model, initialize)"])
    assert re.fullmatch(r"[\d,]+ tokens/s \(4 steps in \d+\.\d s\)", rows["throughput"])
    assert "wall time" not in out
    assert abs(first - math.log(97)) < 0.5  # a random init predicts about uniformly
    assert final < first and rows["loss went down"] == "yes"  # seeded: the same curve on every run


def test_a_rank_dying_stops_the_run_with_an_error_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    timeout = 60.0
    start = time.monotonic()
    code = main(
        ["train", "--steps", "4", "--no-progress", "--timeout", str(timeout), "--crash-rank", "1", *TINY]
    )
    elapsed = time.monotonic() - start
    err = capsys.readouterr().err
    assert code == 1
    assert "zero train failed: rank 1 exited (code 17) after step 1 without reporting an error" in err
    assert elapsed < timeout  # the launcher noticed the death; it did not wait for a timeout


def test_a_rank_raising_names_it_and_shows_the_engine_error(tmp_path: pathlib.Path) -> None:
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 3, "load_from_fp32_weights": False}}))
    # one rank is enough to check that an exception inside a rank comes back named (and it is cheap)
    opts = TrainOptions(
        world=1, steps=2, layers=1, hidden=32, heads=2, vocab=97, seq=16, config=str(cfg), progress=False
    )
    with pytest.raises(
        TrainError, match=r"(?s)rank 0 failed during setup: NotImplementedError: .*load_from_fp32_weights"
    ) as info:
        run_training(opts)
    assert "Traceback" in info.value.traceback and "load_from_fp32_weights" in info.value.traceback
    assert info.value.rank == 0


def test_flags_override_the_config_file_and_bad_flags_are_named(tmp_path: pathlib.Path) -> None:
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_batch_size": 8, "zero_optimization": {"stage": 3}}))
    data = build_config(TrainOptions(config=str(cfg), stage=1))
    assert data["zero_optimization"]["stage"] == 1 and data["train_batch_size"] == 8
    assert data["optimizer"]["type"] == "AdamW"
    with pytest.raises(ValueError, match="inconsistent batch sizes"):
        build_config(TrainOptions(config=str(cfg), micro_batch=3))
    with pytest.raises(ValueError, match="--hidden 30 must be a multiple of --heads 4"):
        TrainOptions(hidden=30).validate()
    with pytest.raises(ValueError, match="--ranks-per-node 3 must be >= 1 and divide --world 2"):
        TrainOptions(ranks_per_node=3).validate()


def test_synthetic_tokens_follow_the_chain_and_are_the_same_everywhere() -> None:
    workload = TrainOptions(vocab=97, seq=50).workload()
    a, b = workload.markov_batch(3, 8), workload.markov_batch(3, 8)
    assert a.shape == (8, 50) and a.dtype.is_floating_point is False and bool((a == b).all())
    assert not bool((workload.markov_batch(4, 8) == a).all())
    # the most frequent successor of each token is its chain successor about 80% + noise of the time
    pairs = workload.markov_batch(0, 400)
    prev, nxt = pairs[:, :-1].reshape(-1), pairs[:, 1:].reshape(-1)
    counts = {}
    for p, n in zip(prev.tolist(), nxt.tolist()):
        counts[(p, n)] = counts.get((p, n), 0) + 1
    best = {}
    for (p, n), c in counts.items():
        if c > best.get(p, (None, 0))[1]:
            best[p] = (n, c)
    share = sum(c for _, c in best.values()) / len(prev)
    assert 0.75 < share < 0.9


def test_without_transformers_the_command_says_what_to_install(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a)
    )
    assert main(["train", "--steps", "2"]) == 2
    assert "pip install zero-full[demo]" in capsys.readouterr().err


@pytest.mark.parametrize("with_tqdm", [True, False])
def test_progress_reports_start_up_apart_and_one_average_throughput(
    with_tqdm: bool, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    if not with_tqdm:  # the plain line the launcher draws without tqdm
        real = importlib.util.find_spec
        monkeypatch.setattr(
            importlib.util, "find_spec", lambda name, *a: None if name == "tqdm" else real(name, *a)
        )
    progress = _Progress(total=3, enabled=True, tokens_per_step=100)
    progress.start(2, 12.34)
    progress.update(1, 2.5, 1.0)
    progress.update(2, 2.0, 3.0)  # 200 tokens in 4 s: 50 tokens/s on average (the last step alone: 33)
    progress.close()
    err = capsys.readouterr().err
    assert "zero train: 2 ranks started in 12.3 s (processes, model, initialize)" in err
    assert "50 tokens/s" in err.splitlines()[-1] or "50 tokens/s" in err.split("\r")[-1]
    assert "33 tokens/s" not in err and "step/s" not in err and "s/step" not in err
