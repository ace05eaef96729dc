"""Streaming safetensors writer: the header is written from declared (name, dtype, shape) entries, then
each tensor's bytes as it is produced, so a shard is never held in memory as a whole.

Tensors are laid out largest element size first (then in the declared order), which keeps every tensor
aligned for its dtype, as the safetensors library does. Knows nothing of models or quantization.
Entry points: `write_shard(path, specs, tensors)` and `write_index(directory, weight_map)`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from moeswap import jsonio
from moeswap.formats.checkpoint import INDEX_NAME, SAFETENSORS_DTYPES

DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
Spec = tuple[str, torch.dtype, tuple[int, ...]]


def layout(specs: Iterable[Spec]) -> list[Spec]:
    """The order tensors are stored in: element size descending, stable otherwise."""
    specs = list(specs)
    names = [s[0] for s in specs]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ValueError(f"tensor {dup!r} is declared twice for one shard")
    return sorted(specs, key=lambda s: -s[1].itemsize)


def write_shard(path: str | os.PathLike, specs: Iterable[Spec], tensors: Iterable[tuple[str, torch.Tensor]],
                metadata: Mapping[str, str] | None = None) -> int:
    """Writes `tensors` (yielded in `layout(specs)` order, each matching its spec) to `path`.
    Returns the number of tensor bytes written."""
    ordered = layout(specs)
    header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name, dtype, shape in ordered:
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"tensor {name!r}: dtype {dtype} has no safetensors name")
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = jsonio.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        produced = iter(tensors)
        for name, dtype, shape in ordered:
            got = next(produced, None)
            if got is None:
                raise ValueError(f"{path}: the producer stopped before tensor {name!r}")
            got_name, tensor = got
            if got_name != name or tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
                raise ValueError(f"{path}: expected tensor {name!r} {dtype} {list(shape)} next, got {got_name!r} "
                                 f"{tensor.dtype} {list(tensor.shape)}")
            _write_bytes(f, tensor)
        if next(produced, None) is not None:
            raise ValueError(f"{path}: the producer yielded more tensors than declared")
    return offset


def _write_bytes(f, tensor: torch.Tensor) -> None:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel():
        f.write(memoryview(flat.view(torch.uint8).numpy()))


def write_index(directory: str | os.PathLike, weight_map: Mapping[str, str], total_size: int) -> Path:
    path = Path(directory) / INDEX_NAME
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    path.write_text(jsonio.dumps(index, indent=2) + "\n")
    return path
