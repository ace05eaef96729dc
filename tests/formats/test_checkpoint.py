"""Checkpoint reader on small safetensors files written here: values, layouts, and every open-time error."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from moeswap.formats.checkpoint import INDEX_NAME, Checkpoint, CheckpointError, TensorInfo


def sample_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, generator=generator)  # noqa: E731
    return {
        "model.embed.weight": randn(7, 5).to(torch.bfloat16),
        "model.layers.0.f32": randn(3, 4),
        "model.layers.0.f16": randn(6).to(torch.float16),
        "model.layers.0.u8": torch.randint(0, 256, (4, 8), generator=generator, dtype=torch.uint8),
        "model.layers.0.i8": torch.randint(-128, 128, (5,), generator=generator, dtype=torch.int8),
        "model.layers.0.i16": torch.arange(-3, 3, dtype=torch.int16),
        "model.layers.0.i32": torch.arange(9, dtype=torch.int32).reshape(3, 3),
        "model.layers.0.i64": torch.arange(4, dtype=torch.int64) * 2**40,
        "model.layers.0.mask": torch.tensor([True, False, True]),
        "model.layers.0.e4m3": randn(2, 16).to(torch.float8_e4m3fn),
        "model.layers.0.e5m2": randn(16).to(torch.float8_e5m2),
        "model.scalar": torch.tensor(2.5),
        "model.empty": torch.empty(0, 3),
    }


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def write_raw(path: Path, header: dict, data: bytes = b"", header_len: int | None = None) -> Path:
    """A hand-made safetensors file, for headers safetensors itself would refuse to write."""
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded) if header_len is None else header_len) + encoded + data)
    return path


def write_sharded(directory: Path, shards: dict[str, dict[str, torch.Tensor]]) -> Path:
    weight_map = {}
    for shard, tensors in shards.items():
        save_file(tensors, directory / shard)
        weight_map.update({name: shard for name in tensors})
    (directory / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return directory


@pytest.fixture
def single_file(tmp_path) -> Path:
    path = tmp_path / "model.safetensors"
    save_file(sample_tensors(), path, metadata={"format": "pt"})
    return path


@pytest.fixture
def sharded(tmp_path) -> Path:
    tensors = sample_tensors()
    names = sorted(tensors)
    return write_sharded(tmp_path, {
        "model-00001-of-00002.safetensors": {n: tensors[n] for n in names[:6]},
        "model-00002-of-00002.safetensors": {n: tensors[n] for n in names[6:]},
    })


# -- reading -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["file", "directory", "sharded"])
def test_values_match_for_every_dtype(layout, single_file, sharded):
    path = {"file": single_file, "directory": single_file.parent, "sharded": sharded}[layout]
    expected = sample_tensors()
    with Checkpoint.open(path) as ckpt:
        assert ckpt.names() == sorted(expected)
        for name, tensor in expected.items():
            for got in (ckpt.get(name), ckpt.read(name)):
                assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
                assert as_bytes(got) == as_bytes(tensor), name


def test_info_offsets_are_absolute_byte_ranges(sharded):
    with Checkpoint.open(sharded) as ckpt:
        for name in ckpt.names():
            info = ckpt.info(name)
            assert isinstance(info, TensorInfo) and info.file.parent == sharded
            with open(info.file, "rb") as f:
                f.seek(info.offset)
                assert f.read(info.nbytes) == as_bytes(ckpt.read(name)), name
        assert ckpt.total_bytes == sum(t.numel() * t.element_size() for t in sample_tensors().values())
        assert [p.name for p in ckpt.files()] == [
            "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
        ]


def test_bf16_get_is_zero_copy_and_read_is_owned(single_file):
    with Checkpoint.open(single_file) as ckpt:
        name = "model.embed.weight"
        first, second = ckpt.get(name), ckpt.get(name)
        assert first.dtype == torch.bfloat16
        assert first.data_ptr() == second.data_ptr()  # both views of the one cached mmap
        owned = ckpt.read(name)
        assert owned.data_ptr() != first.data_ptr()
        assert torch.equal(owned, first)
        owned.zero_()  # an owned tensor may be written; the mapping is untouched
        assert torch.equal(ckpt.get(name), sample_tensors()[name])


def test_one_mmap_per_shard_opened_lazily(sharded):
    with Checkpoint.open(sharded) as ckpt:
        assert ckpt._maps == {}
        ckpt.read("model.layers.0.f32")
        assert ckpt._maps == {}  # read() never maps
        for name in ckpt.names():
            ckpt.get(name)
        assert sorted(ckpt._maps) == ckpt.files()


def test_contains_and_len(single_file):
    with Checkpoint.open(single_file) as ckpt:
        assert "model.scalar" in ckpt and "model.nope" not in ckpt and len(ckpt) == len(sample_tensors())


def test_index_ignores_unlisted_tensors_in_a_shard(tmp_path):
    save_file({"a": torch.ones(2), "stray": torch.zeros(2)}, tmp_path / "s.safetensors")
    (tmp_path / INDEX_NAME).write_text(json.dumps({"weight_map": {"a": "s.safetensors"}}))
    assert Checkpoint.open(tmp_path).names() == ["a"]


# -- errors --------------------------------------------------------------------------------------------


def expect_error(path: Path, *fragments: str) -> None:
    with pytest.raises(CheckpointError) as caught:
        Checkpoint.open(path)
    for fragment in fragments:
        assert fragment in str(caught.value), (fragment, str(caught.value))


def test_missing_path(tmp_path):
    expect_error(tmp_path / "nowhere", "nowhere", "expected a .safetensors file or a checkpoint directory")


def test_directory_without_index_needs_exactly_one_file(tmp_path):
    expect_error(tmp_path, INDEX_NAME, "found none")
    save_file({"a": torch.ones(1)}, tmp_path / "one.safetensors")
    save_file({"b": torch.ones(1)}, tmp_path / "two.safetensors")
    expect_error(tmp_path, "one.safetensors", "two.safetensors", "exactly one")


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"weight_map": {"a": 3}}', '{"metadata": {}}'])
def test_malformed_index(tmp_path, content):
    (tmp_path / INDEX_NAME).write_text(content)
    expect_error(tmp_path, INDEX_NAME)


def test_index_points_to_missing_shard(sharded):
    (sharded / "model-00002-of-00002.safetensors").unlink()
    expect_error(sharded, INDEX_NAME, "model-00002-of-00002.safetensors", "does not exist")


def test_index_maps_tensor_to_a_file_without_it(sharded):
    index = json.loads((sharded / INDEX_NAME).read_text())
    index["weight_map"]["model.embed.weight"] = "model-00002-of-00002.safetensors"  # really in shard 1
    (sharded / INDEX_NAME).write_text(json.dumps(index))
    expect_error(sharded, "model.embed.weight", "model-00002-of-00002.safetensors", "no such tensor")


def test_file_shorter_than_header_length_field(tmp_path):
    (tmp_path / "tiny.safetensors").write_bytes(b"\x01\x02\x03")
    expect_error(tmp_path / "tiny.safetensors", "tiny.safetensors", "truncated", "3 bytes")


def test_header_length_past_end_of_file(tmp_path):
    # The length field is the file's first 8 bytes: the message says what they should be, not what they are
    # (for a file that is not safetensors at all, that number would be a piece of its content).
    path = write_raw(tmp_path / "big.safetensors", {}, header_len=987_654)
    size = path.stat().st_size
    expect_error(path, "big.safetensors", "truncated", f"header length of at most {size - 8} bytes")
    with pytest.raises(CheckpointError) as caught:
        Checkpoint.open(path)
    assert "987654" not in str(caught.value)


def test_header_length_beyond_the_safetensors_limit(tmp_path):
    # A sparse 300 MB file: the length fits the file but exceeds what safetensors allows, so we refuse
    # rather than read 200 MB of "header".
    path = write_raw(tmp_path / "huge.safetensors", {}, header_len=200_000_000)
    with open(path, "r+b") as f:
        f.truncate(300_000_000)
    expect_error(path, "huge.safetensors", "at most 100000000")
    with pytest.raises(CheckpointError) as caught:
        Checkpoint.open(path)
    assert "200000000" not in str(caught.value)


def test_header_not_json(tmp_path):
    path = tmp_path / "garbage.safetensors"
    path.write_bytes(struct.pack("<Q", 6) + b"\xff{oops")
    expect_error(path, "garbage.safetensors", "expected JSON")
    write_raw(path, [1, 2])  # valid JSON, wrong shape
    expect_error(path, "garbage.safetensors", "expected a JSON object")


def test_truncated_data(single_file):
    data = single_file.read_bytes()
    single_file.write_bytes(data[:-10])  # the last tensor in the file loses its tail
    with pytest.raises(CheckpointError) as caught:
        Checkpoint.open(single_file)
    message = str(caught.value)
    assert "model.safetensors" in message and "truncated" in message
    assert f"actual {len(data) - 10}" in message and f">= {len(data)}" in message
    assert any(f"'{name}'" in message for name in sample_tensors())


def test_unknown_dtype(tmp_path):
    header = {"w": {"dtype": "F4X", "shape": [2], "data_offsets": [0, 1]}}
    path = write_raw(tmp_path / "x.safetensors", header, b"\0")
    expect_error(path, "x.safetensors", "'w'", "unknown dtype 'F4X'", "BF16")


def test_shape_does_not_match_byte_length(tmp_path):
    header = {"w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 10]}}
    path = write_raw(tmp_path / "x.safetensors", header, b"\0" * 10)
    expect_error(path, "x.safetensors", "'w'", "needs 12 bytes", "span 10")


@pytest.mark.parametrize("entry", [
    {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]},
    {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]},
    {"dtype": "F32", "shape": [1]},
    "not an entry",
])
def test_malformed_entries(tmp_path, entry):
    path = write_raw(tmp_path / "x.safetensors", {"w": entry}, b"\0" * 8)
    expect_error(path, "x.safetensors", "'w'")


def test_unknown_name_suggests_a_near_one(single_file):
    with Checkpoint.open(single_file) as ckpt:
        near = r"'model\.layers\.0\.f23'.*did you mean 'model\.layers\.0\.f32'"
        with pytest.raises(CheckpointError, match=near):
            ckpt.info("model.layers.0.f23")
        with pytest.raises(CheckpointError, match=r"did you mean 'model\.embed\.weight'"):
            ckpt.get("embed.weight")  # missing prefix
        with pytest.raises(CheckpointError, match=r"model\.safetensors.*'zzz' in this checkpoint") as caught:
            ckpt.read("zzz")
        assert "did you mean" not in str(caught.value)


def test_unknown_name_in_a_large_checkpoint_stays_fast():
    from moeswap.formats.checkpoint import _nearest_name

    names = sorted(f"language_model.model.layers.{i}.experts.{e}.w{w}.weight_packed"
                   for i in range(1, 40) for e in range(256) for w in (1, 2, 3))
    assert _nearest_name("language_model.model.layers.7.experts.9.w2.weight_pakced", names) == (
        "language_model.model.layers.7.experts.9.w2.weight_packed"
    )
