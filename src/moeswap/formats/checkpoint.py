"""Safetensors checkpoints: tensor name -> (file, absolute byte range, dtype, shape), and the bytes behind it.

Parses headers itself (never a whole file) and validates them at open time (shard paths confined to the
checkpoint's directory, byte ranges inside their file and disjoint), then serves tensors either as
zero-copy views of one lazily opened read-only mmap per shard (`get`) or as owned copies read with
pread (`read`, the expert store's disk tier). Knows nothing of models, names' meaning or quantization.
Entry point: `Checkpoint.open(path)`.
"""

from __future__ import annotations

import bisect
import difflib
import json
import math
import mmap
import os
import threading
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from moeswap.formats.files import confined, read_json, show

INDEX_NAME = "model.safetensors.index.json"
HEADER_LENGTH_BYTES = 8  # little-endian u64 before the JSON header
MAX_HEADER_BYTES = 100_000_000  # the safetensors limit; a larger length means a corrupt file, not a big one
MAX_DIMS = 64  # more than any tensor has; also bounds what a hostile header makes torch allocate for a shape
MAX_DIM = (1 << 63) - 1  # torch sizes are int64 (a zero-size tensor may claim any other dimension)

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
    "BOOL": torch.bool, "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz, "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "F8_E8M0": torch.float8_e8m0fnu,
}


class CheckpointError(ValueError):
    """A checkpoint file, index or tensor that is missing, truncated or inconsistent."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in `file`
    nbytes: int


class Checkpoint:
    """Read-only view of one safetensors checkpoint (single file or sharded with an index)."""

    def __init__(self, tensors: dict[str, TensorInfo], root: Path):
        self.root = root
        self._tensors = tensors
        self._sorted_names = sorted(tensors)
        self._maps: dict[Path, mmap.mmap] = {}
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()

    @classmethod
    def open(cls, path: str | os.PathLike) -> Checkpoint:
        """A directory with model.safetensors.index.json + shards, a directory with exactly one
        *.safetensors, or one .safetensors file. Every header is parsed and checked here."""
        path = Path(path)
        if path.is_dir():
            index = path / INDEX_NAME
            tensors = _tensors_from_index(index) if index.exists() else _tensors_from_file(_only_shard(path))
        elif path.is_file():
            tensors = _tensors_from_file(path)
        else:
            raise CheckpointError(
                f"{path}: expected a .safetensors file or a checkpoint directory, found nothing there"
            )
        return cls(tensors, path)

    # -- lookup ------------------------------------------------------------------------------------

    def names(self) -> list[str]:
        return list(self._sorted_names)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __len__(self) -> int:
        return len(self._tensors)

    def info(self, name: str) -> TensorInfo:
        try:
            return self._tensors[name]
        except KeyError:
            raise CheckpointError(self._unknown_name_message(name)) from None

    def files(self) -> list[Path]:
        return sorted({info.file for info in self._tensors.values()})

    @property
    def total_bytes(self) -> int:
        """Bytes of tensor data (headers excluded) over all files."""
        return sum(info.nbytes for info in self._tensors.values())

    # -- data --------------------------------------------------------------------------------------

    def get(self, name: str) -> torch.Tensor:
        """Zero-copy tensor over the shard's read-only mmap. Pages load on first touch.

        Do not write to it (the mapping is read-only: an in-place op crashes the process); `.clone()`
        first. Falls back to an owned copy only if the data is misaligned for its dtype.
        """
        info = self.info(name)
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=info.dtype)
        if info.offset % info.dtype.itemsize:
            return self.read(name)
        with warnings.catch_warnings():
            # torch warns that it cannot mark tensors read-only; the mapping itself is PROT_READ.
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            flat = torch.frombuffer(
                self._mmap(info.file), dtype=info.dtype, count=info.nbytes // info.dtype.itemsize,
                offset=info.offset,
            )
        return flat.reshape(info.shape)

    def read(self, name: str) -> torch.Tensor:
        """A new owned tensor filled by pread of exactly this tensor's byte range (no mmap)."""
        info = self.info(name)
        out = torch.empty(info.nbytes, dtype=torch.uint8)
        if info.nbytes:
            _pread_exactly(self._fd(info.file), memoryview(out.numpy()), info.offset, info)
        return out.view(info.dtype).reshape(info.shape)

    def close(self) -> None:
        with self._lock:
            for mapping in self._maps.values():
                try:
                    mapping.close()
                except BufferError:  # tensors from get() still alive: leave it to the GC
                    pass
            for fd in self._fds.values():
                os.close(fd)
            self._maps.clear()
            self._fds.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.root)!r}, {len(self)} tensors, {len(self.files())} files)"

    def _fd(self, file: Path) -> int:
        with self._lock:
            if file not in self._fds:
                self._fds[file] = os.open(file, os.O_RDONLY)
            return self._fds[file]

    def _mmap(self, file: Path) -> mmap.mmap:
        with self._lock:
            if file not in self._maps:
                with open(file, "rb") as f:
                    self._maps[file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            return self._maps[file]

    def _unknown_name_message(self, name: str) -> str:
        message = f"{self.root}: no tensor named {name!r} in this checkpoint ({len(self)} tensors)"
        near = _nearest_name(name, self._sorted_names)
        return message + (f"; did you mean {near!r}?" if near else "")


# -- opening --------------------------------------------------------------------------------------


def _only_shard(directory: Path) -> Path:
    shards = sorted(directory.glob("*.safetensors"))
    if len(shards) == 1:
        shard = confined(directory, shards[0].name, CheckpointError, str(directory))
        if not shard.is_file():  # a FIFO or device would block or never end
            raise CheckpointError(f"{shard}: expected a safetensors file, found a directory or special file")
        return shard
    found = ", ".join(s.name for s in shards[:5]) + (" ..." if len(shards) > 5 else "") if shards else "none"
    raise CheckpointError(
        f"{directory}: expected {INDEX_NAME} or exactly one *.safetensors file, found {found}"
    )


def _tensors_from_index(index: Path) -> dict[str, TensorInfo]:
    weight_map = _read_weight_map(index)
    by_file: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        by_file.setdefault(shard, []).append(name)

    # Every shard path is checked before any file is touched: a checkpoint never reaches outside its directory.
    files = {shard: confined(index.parent, shard, CheckpointError, f"{index}: weight_map entry {show(names[0])}")
             for shard, names in sorted(by_file.items())}
    tensors: dict[str, TensorInfo] = {}
    for shard, names in sorted(by_file.items()):
        file = files[shard]
        if not file.is_file():
            found = "which is a directory or special file" if file.exists() else "which does not exist"
            raise CheckpointError(
                f"{index}: maps {len(names)} tensors (e.g. {names[0]!r}) to shard {shard!r}, "
                f"{found} in {index.parent}; is the download incomplete?"
            )
        in_file = _tensors_from_file(file)
        for name in names:
            if name not in in_file:
                raise CheckpointError(
                    f"{index}: maps tensor {name!r} to {shard!r}, but that file's header has no such "
                    f"tensor (it holds {len(in_file)} tensors)"
                )
            tensors[name] = in_file[name]
    return tensors


def _read_weight_map(index: Path) -> dict[str, str]:
    data = read_json(index, CheckpointError)
    expected = f"{index}: expected a JSON object whose 'weight_map' maps tensor names to shard file names"
    if not isinstance(data, dict) or not isinstance(data.get("weight_map"), dict):
        found = f"keys {show(sorted(data))}" if isinstance(data, dict) else f"a JSON {type(data).__name__}"
        raise CheckpointError(f"{expected}, found {found}")
    for name, shard in data["weight_map"].items():
        if not isinstance(shard, str) or not name.isprintable():
            raise CheckpointError(f"{expected}, found {show(name)} -> {show(shard)}")
    return data["weight_map"]


def _tensors_from_file(file: Path) -> dict[str, TensorInfo]:
    """Parse and check one safetensors header (reads only the header bytes). Errors say what the bytes
    should have been, never what they are: the file may not be a checkpoint at all."""
    file_size = file.stat().st_size
    with open(file, "rb") as f:
        prefix = f.read(HEADER_LENGTH_BYTES)
        if len(prefix) < HEADER_LENGTH_BYTES:
            raise CheckpointError(
                f"{file}: truncated: expected at least {HEADER_LENGTH_BYTES} bytes of header length, "
                f"file has {file_size} bytes"
            )
        header_len = int.from_bytes(prefix, "little")
        limit = min(file_size - HEADER_LENGTH_BYTES, MAX_HEADER_BYTES)
        if header_len > limit:
            raise CheckpointError(
                f"{file}: truncated or not safetensors: expected its first {HEADER_LENGTH_BYTES} bytes to give "
                f"a JSON header length of at most {limit} bytes (the rest of the file, capped at "
                f"{MAX_HEADER_BYTES}), found a larger one; re-download or re-copy it"
            )
        raw = f.read(header_len)
    corrupt = f"{file}: corrupt safetensors header"
    try:
        header = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{corrupt}: expected JSON, found bytes that are not UTF-8 (at header offset "
                              f"{e.start})") from None
    except RecursionError:
        raise CheckpointError(f"{corrupt}: expected JSON, found nesting too deep to parse") from None
    except ValueError as e:  # JSONDecodeError, or an integer of more digits than Python converts
        raise CheckpointError(f"{corrupt}: expected JSON, {e}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{corrupt}: expected a JSON object, found {type(header).__name__}")

    data_start = HEADER_LENGTH_BYTES + header_len
    tensors = {
        name: _tensor_info(name, entry, file, data_start)
        for name, entry in header.items()
        if name != "__metadata__"
    }
    _check_not_truncated(file, file_size, tensors.values())
    _check_no_overlap(file, tensors.values())
    return tensors


def _check_not_truncated(file: Path, file_size: int, tensors: Iterable[TensorInfo]) -> None:
    cut = [t for t in tensors if t.offset + t.nbytes > file_size]
    if cut:
        first = min(cut, key=lambda t: t.offset)
        needed = max(t.offset + t.nbytes for t in cut)
        raise CheckpointError(
            f"{file}: file truncated: tensor {first.name!r} (and {len(cut) - 1} more) run past the end; "
            f"expected file size >= {needed} bytes, actual {file_size}; re-download or re-copy it"
        )


def _check_no_overlap(file: Path, tensors: Iterable[TensorInfo]) -> None:
    """Each byte of data belongs to at most one tensor (safetensors' own rule; a writer never shares)."""
    previous = None
    for t in sorted((t for t in tensors if t.nbytes), key=lambda t: (t.offset, t.name)):
        if previous is not None and t.offset < previous.offset + previous.nbytes:
            raise CheckpointError(
                f"{file}: corrupt safetensors header: tensors {previous.name!r} and {t.name!r} claim "
                f"overlapping data_offsets; expected each byte to belong to one tensor"
            )
        previous = t


def _tensor_info(name: str, entry: object, file: Path, data_start: int) -> TensorInfo:
    where = f"{file}: tensor {show(name)}"
    if not name.isprintable():
        raise CheckpointError(f"{where}: expected a tensor name without control characters")
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise CheckpointError(
            f"{where}: expected an entry with dtype, shape and data_offsets, found {show(entry)}"
        )
    dtype_name, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype_name, str) or dtype_name not in SAFETENSORS_DTYPES:
        raise CheckpointError(
            f"{where}: unknown dtype {show(dtype_name)}; expected one of {', '.join(SAFETENSORS_DTYPES)}"
        )
    if not _is_int_list(shape, 0) or not _is_int_list(offsets, 2) or offsets[0] > offsets[1] \
            or len(shape) > MAX_DIMS or any(d > MAX_DIM for d in shape):
        raise CheckpointError(
            f"{where}: expected shape as a list of at most {MAX_DIMS} non-negative ints below 2^63 and "
            f"data_offsets as [begin, end], found shape={show(shape)} data_offsets={show(offsets)}"
        )
    dtype = SAFETENSORS_DTYPES[dtype_name]
    begin, end = offsets
    expected = math.prod(shape) * dtype.itemsize
    if end - begin != expected:
        raise CheckpointError(
            f"{where}: shape {show(shape)} of {dtype_name} needs {expected} bytes, data_offsets "
            f"{show(offsets)} span {end - begin}"
        )
    return TensorInfo(name, file, dtype, tuple(shape), data_start + begin, expected)


def _is_int_list(value: object, length: int) -> bool:
    """A list of non-negative ints (of `length` items when length > 0)."""
    return (
        isinstance(value, list)
        and (length == 0 or len(value) == length)
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
    )


# -- reading --------------------------------------------------------------------------------------


def pread_into(fd: int, buffer: memoryview, offset: int) -> int:
    """Fill `buffer` from `offset` of `fd` (pread may return short counts: Linux caps one call near
    2 GiB); returns the bytes read, fewer than len(buffer) only where the file ended first."""
    done = 0
    while done < len(buffer):
        n = os.preadv(fd, [buffer[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


def _pread_exactly(fd: int, buffer: memoryview, offset: int, info: TensorInfo) -> None:
    done = pread_into(fd, buffer, offset)
    if done < len(buffer):
        raise CheckpointError(
            f"{info.file}: tensor {info.name!r}: file shrank since open: expected {info.nbytes} bytes "
            f"at offset {info.offset}, got {done}"
        )


def _nearest_name(name: str, sorted_names: list[str], window: int = 200) -> str | None:
    """Closest known name: one that only adds a prefix, else the best difflib match. Large checkpoints
    (~500k names) only score sorted neighbours at a few prefix lengths, keeping the error path fast."""
    with_prefix = [n for n in sorted_names if n.endswith("." + name)]  # the usual slip: a missing prefix
    if with_prefix:
        return with_prefix[0]
    if len(sorted_names) <= 5 * window:
        candidates = sorted_names
    else:
        picked: set[str] = set()
        for cut in {len(name), len(name) * 3 // 4, len(name) // 2, len(name) // 4}:
            at = bisect.bisect_left(sorted_names, name[:cut])
            picked.update(sorted_names[max(0, at - window // 2) : at + window // 2])
        candidates = sorted(picked)
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return close[0] if close else None
