"""Pure helpers of the Hugging Face loader / writer: range reads, shard planning, size parsing.

Reference: plain tensor indexing of the whole tensor (``t.reshape(-1)[start:stop]``) and the
byte arithmetic of the shard plan.
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from safetensors.torch import save_file

from zero_full import CheckpointError
from zero_full.hf.load import checkpoint_index, read_flat_range
from zero_full.hf.save import parse_size, plan_shards, shard_file_names

SHAPES = [(7,), (1,), (3, 5), (1, 11), (4, 1, 3), (2, 3, 2, 5), ()]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_every_flat_range_reads_exactly_those_elements(tmp_path, shape, dtype):
    numel = 1
    for d in shape:
        numel *= d
    t = (torch.arange(numel, dtype=torch.float64) * 1.5 - 3).to(dtype).reshape(shape)
    save_file({"t": t}, str(tmp_path / "model.safetensors"))
    info = checkpoint_index(tmp_path)["t"]
    assert info.shape == tuple(shape) and info.dtype == dtype
    flat = t.reshape(-1)
    for start, stop in itertools.combinations_with_replacement(range(numel + 1), 2):
        got = read_flat_range(info, "t", start, stop)
        assert got.dtype == dtype and torch.equal(got, flat[start:stop]), (shape, start, stop)


def test_sharded_index_maps_each_key_to_its_file(tmp_path):
    save_file({"a": torch.ones(3)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(
        {"b": torch.zeros(2, 2, dtype=torch.float16)}, str(tmp_path / "model-00002-of-00002.safetensors")
    )
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    index = checkpoint_index(tmp_path)
    assert {k: (v.file.name, v.dtype, v.shape) for k, v in index.items()} == {
        "a": ("model-00001-of-00002.safetensors", torch.float32, (3,)),
        "b": ("model-00002-of-00002.safetensors", torch.float16, (2, 2)),
    }
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        checkpoint_index(tmp_path)


def test_a_directory_without_safetensors_is_an_error_naming_the_files_looked_for(tmp_path):
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*index\.json"):
        checkpoint_index(tmp_path)


@pytest.mark.parametrize(
    ("size", "expected"),
    [(5, 5), ("5GB", 5 * 10**9), ("200MiB", 200 * 2**20), ("20KB", 20_000), ("1.5kb", 1500), ("7", 7)],
)
def test_parse_size_accepts_transformers_spellings(size, expected):
    assert parse_size(size) == expected


@pytest.mark.parametrize("size", ["", "5 GiBs", "-3", 0, "0KB"])
def test_parse_size_refuses_nonsense(size):
    with pytest.raises(ValueError, match="max_shard_size"):
        parse_size(size)


def test_shards_close_before_the_tensor_that_would_overflow_them():
    assert plan_shards([4, 4, 4, 10, 1, 1], 8) == [[0, 1], [2], [3], [4, 5]]
    assert plan_shards([3, 3, 3], 100) == [[0, 1, 2]]
    assert plan_shards([], 10) == [[]]
    for sizes in ([1, 2, 3, 4, 5, 6, 7], [9, 1, 9, 1], [5] * 7):
        shards = plan_shards(sizes, 8)
        assert [i for s in shards for i in s] == list(range(len(sizes)))
        assert all(sum(sizes[i] for i in s) <= 8 or len(s) == 1 for s in shards)


def test_shard_file_names_follow_transformers():
    assert shard_file_names(1) == ["model.safetensors"]
    assert shard_file_names(3) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
