"""Checkpoints under faults, at world 2: every crash point of a save resumes and saves again,
every hostile or inconsistent input is a CheckpointError naming its culprit on every rank, and
nothing on disk is lost or changed by a refused save or load.

The reference is an uninterrupted run: train 2 steps, save ``global_step2``, train 2, save
``global_step4``, train 2 more (steps 4 and 5). A restart after a crash loads ``latest``
(``global_step2``), trains steps 2 and 3, saves ``global_step4`` again and trains steps 4 and
5, whose losses must equal the reference's bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero_full
from zero_full.checkpoint import CheckpointError
from zero_full.checkpoint.safetensors import consolidate_checkpoint
from zero_full.hf.load import checkpoint_index
from zero_testing import raised_message

CONFIG = {
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}},
    "robustness": {"comm_timeout": 20},
}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 33), nn.Tanh(), nn.Linear(33, 2))


def _train(engine, start: int, stop: int) -> list[float]:
    losses = []
    for step in range(start, stop):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 * step + dist.get_rank()))
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _reference(root: str) -> list[float]:
    with zero_full.initialize(_net(), CONFIG) as engine:
        _train(engine, 0, 2)
        engine.save_checkpoint(root)
        _train(engine, 2, 4)
        engine.save_checkpoint(root)
        return _train(engine, 4, 6)


def _restart(root: str) -> tuple[int, list[float]]:
    with zero_full.initialize(_net(), CONFIG) as engine:
        engine.load_checkpoint(root)
        loaded = engine.global_steps
        _train(engine, loaded, 4)
        engine.save_checkpoint(root)
        return loaded, _train(engine, 4, 6)


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _lock(directory: Path, pid: int) -> None:
    (directory / ".writer").write_text(json.dumps({"pid": pid, "host": os.uname().nodename}))


def _hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in root.rglob("*")
        if p.is_file()
    }


@pytest.fixture(scope="module")
def reference(dist, tmp_path_factory):
    root = tmp_path_factory.mktemp("reference") / "ckpt"
    losses = dist.run(2, _reference, str(root), timeout=600)
    return root, losses


def _crash_at(root: Path, point: str) -> None:
    """Leave ``root`` as a save of ``global_step4`` that died at ``point`` left it."""
    final, tmp = root / "global_step4", root / "global_step4.tmp-0123456789ab"
    (root / "latest").write_text("global_step2")
    dead = _dead_pid()
    if point == "tmp_created":
        shutil.rmtree(final)
        tmp.mkdir()
        _lock(tmp, dead)
    elif point in ("shards_written", "manifest_written"):
        final.rename(tmp)
        _lock(tmp, dead)
        if point == "shards_written":
            (tmp / "manifest.json").unlink()
    elif point in ("renamed", "latest_tmp_written"):
        created = json.loads((final / "manifest.json").read_text())["created_unix"]
        os.utime(root / "latest", (created - 100, created - 100))  # written before this save
        if point == "latest_tmp_written":
            (root / f".latest.tmp-{dead}").write_text("global_step4")


@pytest.mark.parametrize(
    "point", ["tmp_created", "shards_written", "manifest_written", "renamed", "latest_tmp_written"]
)
def test_a_restart_after_a_crash_at_any_point_of_a_save_resumes_and_saves_again(
    dist, tmp_path, reference, point
):
    material, expected = reference
    root = tmp_path / "ckpt"
    shutil.copytree(material, root)
    _crash_at(root, point)
    before = _hashes(root / "global_step2")
    got = dist.run(2, _restart, str(root), timeout=600)
    for r in (0, 1):
        assert got[r][0] == 2, got  # resumed from the last published checkpoint
        assert got[r][1] == expected[r], (point, got[r][1], expected[r])  # bit-exact
    assert sorted(p.name for p in root.iterdir()) == ["global_step2", "global_step4", "latest"]
    assert (root / "latest").read_text() == "global_step4"
    assert _hashes(root / "global_step2") == before  # the previous checkpoint is untouched


# --------------------------------------------------------------------------- refused loads


def _load(root: str, tags: list[str | None]) -> str | None:
    with zero_full.initialize(_net(), CONFIG) as engine:
        return raised_message(CheckpointError, engine.load_checkpoint, root, tags[dist.get_rank()])


def _rewrite_manifest(path: Path, change) -> None:
    """Apply ``change`` to the manifest and re-sign it (as a deliberate forger would)."""
    data = json.loads((path / "manifest.json").read_text())
    data.pop("manifest_sha256")
    change(data)
    data["manifest_sha256"] = hashlib.sha256(json.dumps(data, indent=1).encode()).hexdigest()
    (path / "manifest.json").write_text(json.dumps(data, indent=1))


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _hostile(root: Path, kind: str) -> tuple[list[str | None], str]:
    """Damage ``root``; return the tags each rank asks for and a fragment every message must hold."""
    ckpt = root / "global_step2"
    if kind == "malicious_pickle":
        torch.save({"params": _Payload(root.parent / "PWNED")}, ckpt / "rank00001.pt")
        size, digest = (
            (ckpt / "rank00001.pt").stat().st_size,
            hashlib.sha256((ckpt / "rank00001.pt").read_bytes()),
        )

        def resign(data):
            for f in data["files"]:
                if f["name"] == "rank00001.pt":
                    f["size"], f["sha256"] = size, digest.hexdigest()

        _rewrite_manifest(ckpt, resign)
        return ["global_step2"] * 2, "rank00001.pt cannot be read"
    if kind == "manifest_bit_flip":
        text = (ckpt / "manifest.json").read_text()
        assert '"lr": 0.01' in text
        (ckpt / "manifest.json").write_text(text.replace('"lr": 0.01', '"lr": 0.03'))
        return ["global_step2"] * 2, "manifest_sha256"
    if kind == "file_outside_root":
        (root / "evil.pt").write_bytes((ckpt / "rank00000.pt").read_bytes())

        def escape(data):
            data["files"][0]["name"] = "../evil.pt"

        _rewrite_manifest(ckpt, escape)
        return ["global_step2"] * 2, "outside the checkpoint root"
    if kind == "latest_outside_root":
        (root / "latest").write_text("../other/global_step2")
        return [None, None], "is a path, not a directory name"
    if kind == "tag_with_spaces":
        return [" global_step2 "] * 2, "surrounded by spaces"
    if kind == "different_tags":
        return ["global_step2", "global_step4"], "rank 0: 'global_step2', rank 1: 'global_step4'"
    raise ValueError(kind)


@pytest.mark.parametrize(
    "kind",
    [
        "malicious_pickle",
        "manifest_bit_flip",
        "file_outside_root",
        "latest_outside_root",
        "tag_with_spaces",
        "different_tags",
    ],
)
def test_a_hostile_or_inconsistent_load_is_refused_on_every_rank(dist, tmp_path, reference, kind):
    material, _ = reference
    root = tmp_path / "ckpt"
    shutil.copytree(material, root)
    tags, fragment = _hostile(root, kind)
    before = _hashes(root)
    messages = dist.run(2, _load, str(root), tags, timeout=600)
    for r in (0, 1):
        assert messages[r] is not None and fragment in messages[r], (kind, messages)
    assert not (tmp_path / "PWNED").exists()
    assert _hashes(root) == before  # a refused load changes nothing on disk
    if kind in ("file_outside_root", "latest_outside_root", "manifest_bit_flip"):
        out = tmp_path / "w.safetensors"  # the damaged tag (None: the one latest names)
        message = raised_message(CheckpointError, consolidate_checkpoint, root, out, tags[0])
        assert message is not None and fragment in message, message


# --------------------------------------------------------------------------- refused saves


def _save(root: str, tags: list[str]) -> str | None:
    with zero_full.initialize(_net(), CONFIG) as engine:
        _train(engine, 0, 1)
        return raised_message(CheckpointError, engine.save_checkpoint, root, tags[dist.get_rank()])


@pytest.mark.parametrize(
    ("tags", "fragment"),
    [
        ([" step1", " step1"], "surrounded by spaces"),
        (["a/b", "a/b"], "is a path"),
        (["one", "two"], "rank 0: 'one', rank 1: 'two'"),
        (["one", "on e/"], "is a path"),
    ],
)
def test_an_invalid_or_disagreeing_save_tag_is_refused_on_every_rank(dist, tmp_path, tags, fragment):
    root = tmp_path / "ckpt"
    messages = dist.run(2, _save, str(root), tags, timeout=600)
    for r in (0, 1):
        assert messages[r] is not None and fragment in messages[r], messages
    assert not root.exists() or sorted(p.name for p in root.iterdir()) == []


def _save_mid_accumulation(root: str) -> list[str]:
    config = {**CONFIG, "gradient_accumulation_steps": 2}
    with zero_full.initialize(_net(), config) as engine:
        _train(engine, 0, 1)  # one micro-batch of two
        with pytest.warns(UserWarning) as caught:
            engine.save_checkpoint(root)
        return [str(w.message) for w in caught]


def test_a_save_in_the_middle_of_accumulation_warns(dist, tmp_path):
    warned = dist.run(2, _save_mid_accumulation, str(tmp_path / "ckpt"), timeout=600)
    for messages in warned:
        assert any("in the middle of gradient accumulation (1 of 2" in m for m in messages), messages


# --------------------------------------------------------------------------- safetensors headers


def _safetensors(path: Path, header: object, data: bytes = b"", length: int | None = None) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


@pytest.mark.parametrize(
    ("header", "length", "fragment"),
    [
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, 1 << 62, "its header claims"),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4000]}}, None, "outside its 8 data bytes"),
        ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, None, "needs 12 bytes"),
        ([1, 2, 3], None, "malformed safetensors header (a JSON list)"),
        ({"w": {"dtype": "F32"}}, None, "malformed safetensors header entry 'w'"),
    ],
)
def test_a_malformed_safetensors_header_names_the_file(tmp_path, header, length, fragment):
    path = _safetensors(tmp_path / "model.safetensors", header, b"\0" * 8, length)
    message = raised_message(CheckpointError, checkpoint_index, path)
    assert message is not None and str(path) in message and fragment in message, message
