"""Streaming safetensors writer: files the safetensors library and our reader both read back exactly,
tensors aligned for their dtype, and a producer that does not match its declaration is an error."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from moeswap.formats.checkpoint import Checkpoint
from moeswap.formats.writer import layout, write_index, write_shard


def tensors():
    gen = torch.Generator().manual_seed(0)
    return {
        "a.weight_packed": torch.randint(0, 256, (3, 5), dtype=torch.uint8, generator=gen),  # odd byte count
        "a.weight": torch.randn(7, 3, generator=gen).to(torch.bfloat16),
        "b.f32": torch.randn(5, generator=gen),
        "c.fp8": torch.randn(33, generator=gen).to(torch.float8_e4m3fn),
        "d.i64": torch.arange(3),
        "e.empty": torch.zeros(0, 4),
    }


def test_round_trip_and_alignment(tmp_path):
    data = tensors()
    specs = [(n, t.dtype, tuple(t.shape)) for n, t in data.items()]
    order = [n for n, _, _ in layout(specs)]
    assert order[:2] == ["d.i64", "b.f32"]  # largest element size first, declared order otherwise
    nbytes = write_shard(tmp_path / "s.safetensors", specs, ((n, data[n]) for n in order))
    assert nbytes == sum(t.numel() * t.element_size() for t in data.values())
    theirs = load_file(tmp_path / "s.safetensors")
    write_index(tmp_path, {n: "s.safetensors" for n in data}, nbytes)
    with Checkpoint.open(tmp_path) as ckpt:
        for name, t in data.items():
            assert ckpt.info(name).offset % t.element_size() == 0
            for got in (ckpt.get(name), theirs[name]):
                assert got.dtype == t.dtype and torch.equal(got.view(torch.uint8), t.view(torch.uint8))
    assert json.loads((tmp_path / "model.safetensors.index.json").read_text())["metadata"]["total_size"] == nbytes


def test_producer_mismatch_is_an_error(tmp_path):
    data = tensors()
    specs = [(n, t.dtype, tuple(t.shape)) for n, t in data.items()]
    order = [n for n, _, _ in layout(specs)]
    wrong = [(n, data[n]) for n in order]
    wrong[1] = (wrong[1][0], wrong[1][1].double())
    with pytest.raises(
            ValueError, match=r"expected tensor 'b.f32' torch.float32 \[5\] next, got 'b.f32' torch.float64"):
        write_shard(tmp_path / "s.safetensors", specs, iter(wrong))
    with pytest.raises(ValueError, match="stopped before tensor"):
        write_shard(tmp_path / "s.safetensors", specs, iter([]))
    with pytest.raises(ValueError, match="declared twice"):
        write_shard(tmp_path / "s.safetensors", specs + specs[:1], iter([]))
