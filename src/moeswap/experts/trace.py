"""Routing traces: the (step, layer, experts) of a real run, written as trace.bin and replayed by
`moeswap bench cache` (policies without the model) and read by the planner (expert counts).

A step is one model forward (a prefill, or one decode step of the batch); an event is one MoE layer of
one step with the experts it used, in fetch order. TraceRecorder is attached to an ExpertStore
(`store.trace`); it needs no torch. File layout (little-endian): b"MSWTRACE", u32 version, u32 n,
n bytes of JSON metadata, u32 events, then u32 step[events], u16 layer[events], u16 count[events],
u16 expert[sum(count)]. Entry points: `TraceRecorder`, `write_trace`, `read_trace`, `is_trace_file`.
"""

from __future__ import annotations

import json
import struct
import sys
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

from moeswap import jsonio
from moeswap.experts.keys import Key

MAGIC = b"MSWTRACE"
VERSION = 1


@dataclass
class Trace:
    meta: dict  # num_layers, num_experts, top_k, moe_layers, model, ...
    steps: array = field(default_factory=lambda: array("I"))
    layers: array = field(default_factory=lambda: array("H"))
    counts: array = field(default_factory=lambda: array("H"))
    experts: array = field(default_factory=lambda: array("H"))

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def num_steps(self) -> int:
        return self.steps[-1] + 1 if self.steps else 0

    def events(self) -> Iterator[tuple[int, int, Sequence[int]]]:
        at = 0
        for step, layer, n in zip(self.steps, self.layers, self.counts):
            yield step, layer, self.experts[at : at + n]
            at += n

    def accesses(self) -> list[Key]:
        """Every (layer, expert) demand in order: what a cache sees."""
        return [Key(layer, e) for _, layer, ids in self.events() for e in ids]

    def profile(self) -> dict[Key, int]:
        """How often each expert was used (the StaticHot policy's input)."""
        counts: dict[Key, int] = {}
        for key in self.accesses():
            counts[key] = counts.get(key, 0) + 1
        return counts

    def expert_counts(self) -> list[list[int]]:
        """Per model layer, the use count of each expert ([] for layers without routed experts): the
        planner's `{"expert_counts": ...}` input."""
        n_layers, n_experts = self.meta["num_layers"], self.meta["num_experts"]
        moe = set(self.meta["moe_layers"])
        out = [[0] * n_experts if i in moe else [] for i in range(n_layers)]
        for _, layer, ids in self.events():
            row = out[layer]
            for e in ids:
                row[e] += 1
        return out


class TraceRecorder:
    """Collects fetch events; a new step starts when a fetch's layer is not after the previous one's."""

    def __init__(self, meta: dict):
        self.trace = Trace(dict(meta))
        self._step, self._last_layer = -1, None

    def record(self, layer: int, expert_ids: Sequence[int]) -> None:
        if self._last_layer is None or layer <= self._last_layer:
            self._step += 1
        self._last_layer = layer
        t = self.trace
        t.steps.append(self._step)
        t.layers.append(layer)
        t.counts.append(len(expert_ids))
        t.experts.extend(expert_ids)


def _little(a: array) -> bytes:
    if sys.byteorder != "little":
        a = array(a.typecode, a)
        a.byteswap()
    return a.tobytes()


def write_trace(trace: Trace, path: str | Path) -> Path:
    path = Path(path)
    meta = jsonio.dumps(trace.meta, sort_keys=True).encode()
    with open(path, "wb") as f:
        f.write(MAGIC + struct.pack("<II", VERSION, len(meta)) + meta + struct.pack("<I", len(trace)))
        for a in (trace.steps, trace.layers, trace.counts, trace.experts):
            f.write(_little(a))
    return path


def is_trace_file(path: str | Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def read_trace(path: str | Path) -> Trace:
    path = Path(path)
    data = path.read_bytes()
    if not data.startswith(MAGIC):
        raise ValueError(f"{path}: not a moeswap routing trace (expected it to start with {MAGIC.decode()}); "
                         f"record one with `moeswap trace MODEL --prompts FILE -o {path.name}`")
    try:
        version, meta_len = struct.unpack_from("<II", data, len(MAGIC))
        if version != VERSION:
            raise ValueError(f"format version {version}, this moeswap reads version {VERSION}")
        at = len(MAGIC) + 8
        meta = json.loads(data[at : at + meta_len])
        at += meta_len
        (n,) = struct.unpack_from("<I", data, at)
        at += 4
        arrays = []
        for code, count in (("I", n), ("H", n), ("H", n)):
            arrays.append(_take(data, at, code, count))
            at += count * arrays[-1].itemsize
        arrays.append(_take(data, at, "H", sum(arrays[2])))
        at += len(arrays[-1]) * 2
        if at != len(data):
            raise ValueError(f"{len(data) - at} bytes after the last event")
    except (struct.error, ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: corrupt routing trace: {err}; record it again with `moeswap trace`") from None
    for k in ("num_layers", "num_experts", "moe_layers"):
        if k not in meta:
            raise ValueError(f"{path}: corrupt routing trace: metadata has no {k!r}")
    return Trace(meta, *arrays)


def _take(data: bytes, at: int, code: str, count: int) -> array:
    a = array(code)
    end = at + count * a.itemsize
    if end > len(data):
        raise ValueError(f"truncated: needs {end} bytes, file has {len(data)}")
    a.frombytes(data[at:end])
    if sys.byteorder != "little":
        a.byteswap()
    return a
