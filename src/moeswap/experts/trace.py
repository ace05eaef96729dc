"""Routing traces: the (step, layer, experts) of a real run, written as trace.bin, replayed by `moeswap bench
cache` (policies without the model) and read by the planner (expert counts). Needs no torch.
Entry points: `TraceRecorder` (attached to an ExpertStore as `store.trace`), `write_trace`, `read_trace`,
`is_trace_file`.
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
from moeswap.atomic_dir import atomic_file
from moeswap.experts.keys import Key

MAGIC = b"MSWTRACE"
VERSION = 1
# Metadata keys readers use, with their JSON types; the first three are required.
META_TYPES = {"num_layers": int, "num_experts": int, "moe_layers": list, "top_k": int, "expert_stored_bytes": int,
              "model": str}
REQUIRED_META = ("num_layers", "num_experts", "moe_layers")
ID_LIMIT = 1 << 16  # layers and experts are stored as u16 ids


def model_meta(model, store, model_dir: str) -> dict:
    """The metadata (META_TYPES) a trace of `model`, served by `store`, carries (bench cache sizes budgets with
    it)."""
    c = model.config
    first = min(store.index.entries)
    return {
        "model": str(model_dir), "num_layers": c.num_layers, "num_experts": c.moe.num_experts, "top_k": c.moe.top_k,
        "moe_layers": [i for i, k in enumerate(c.mlp_kinds) if k == "moe"],
        "expert_stored_bytes": store.index.stored_bytes(store.ckpt, *first),
    }


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

    def check(self) -> Trace:
        """Raises ValueError naming the first field that is missing, mistyped or out of range: metadata
        types, moe_layers within num_layers, every event's layer in moe_layers, every expert id below
        num_experts, counts adding up to the expert ids, steps in order. Returns self."""
        meta = self.meta
        if not isinstance(meta, dict):
            raise ValueError(f"metadata is a JSON {type(meta).__name__}, expected an object")
        for key in REQUIRED_META:
            if key not in meta:
                raise ValueError(f"metadata has no {key!r}")
        for key, kind in META_TYPES.items():
            value = meta.get(key)
            if key in meta and (not isinstance(value, kind) or isinstance(value, bool)):
                raise ValueError(f"metadata {key!r} is {value!r}, expected a JSON {_JSON_NAMES[kind]}")
        for key, low, high in (("num_layers", 1, ID_LIMIT), ("num_experts", 1, ID_LIMIT), ("top_k", 1, ID_LIMIT),
                               ("expert_stored_bytes", 0, None)):
            if key in meta and not (low <= meta[key] and (high is None or meta[key] <= high)):
                bounds = f"between {low} and {high}" if high else f"at least {low}"
                raise ValueError(f"metadata {key!r} is {meta[key]}, expected an integer {bounds}")
        n_layers, n_experts, moe = meta["num_layers"], meta["num_experts"], meta["moe_layers"]
        bad = next((x for x in moe if not isinstance(x, int) or isinstance(x, bool) or not 0 <= x < n_layers), None)
        if bad is not None or not moe or len(set(moe)) != len(moe):
            what = f"holds {bad!r}" if bad is not None else "repeats a layer" if moe else "is empty"
            raise ValueError(f"metadata 'moe_layers' {what}; expected distinct layer ids below num_layers {n_layers}")
        if meta.get("top_k", 1) > n_experts:
            raise ValueError(f"metadata 'top_k' is {meta['top_k']}, more than num_experts {n_experts}")
        if not len(self.steps) == len(self.layers) == len(self.counts):
            raise ValueError(f"{len(self.steps)} steps, {len(self.layers)} layers and {len(self.counts)} counts; "
                             f"expected one of each per event")
        if sum(self.counts) != len(self.experts):
            raise ValueError(f"event counts add up to {sum(self.counts)}, but the trace holds {len(self.experts)} "
                             f"expert ids")
        stray = set(self.layers) - set(moe)
        if stray:
            raise ValueError(f"events at layer {min(stray)}, which metadata 'moe_layers' ({_span(moe)}) does not list")
        if self.experts and max(self.experts) >= n_experts:
            at = next(i for i, e in enumerate(self.experts) if e >= n_experts)
            raise ValueError(f"expert id {self.experts[at]} (expert entry {at}) is out of range: metadata "
                             f"'num_experts' is {n_experts}")
        back = next((i for i in range(1, len(self.steps)) if self.steps[i] < self.steps[i - 1]), None)
        if back is not None:
            raise ValueError(f"event {back} has step {self.steps[back]} after step {self.steps[back - 1]}; "
                             f"steps must not decrease")
        return self

    def check_model(self, config, what: str = "routing trace") -> Trace:
        """Raises ValueError unless the trace was recorded on a model with `config`'s layers and routed
        experts (a ModelConfig: num_layers, moe.num_experts, mlp_kinds). Returns self."""
        moe = [i for i, kind in enumerate(config.mlp_kinds) if kind == "moe"]
        hint = "; record one of this model with `moeswap trace MODEL --prompts FILE -o TRACE`"
        if self.meta["num_experts"] != config.moe.num_experts:
            raise ValueError(f"{what}: recorded on a model with {self.meta['num_experts']} routed experts per layer; "
                             f"this model has {config.moe.num_experts}{hint}")
        if self.meta["num_layers"] != config.num_layers or sorted(self.meta["moe_layers"]) != moe:
            raise ValueError(f"{what}: recorded on a model with {self.meta['num_layers']} layers, MoE layers "
                             f"{_span(self.meta['moe_layers'])}; this model has {config.num_layers}, MoE layers "
                             f"{_span(moe)}{hint}")
        return self


_JSON_NAMES = {int: "integer", list: "list", str: "string"}


def _span(layers: Sequence[int]) -> str:
    """Layer ids for a message: "1..60" when contiguous, else the list (shortened)."""
    ids = sorted(layers)
    if ids and ids == list(range(ids[0], ids[-1] + 1)) and len(ids) > 2:
        return f"{ids[0]}..{ids[-1]}"
    return str(ids) if len(ids) <= 8 else f"[{', '.join(map(str, ids[:8]))}, ... ({len(ids)} layers)]"


class TraceRecorder:
    """Collects fetch events; a new step starts when a fetch's layer is not after the previous one's."""

    def __init__(self, meta: dict):
        self.trace = Trace(dict(meta))
        self._step = -1
        self._last_layer: int | None = None

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


def write_trace(trace: Trace, path: str | Path, overwrite: bool = True) -> Path:
    """Writes atomically (a temporary sibling renamed into place); overwrite=False never replaces a file.

    A step is one model forward (a prefill, or one decode step of the batch); an event is one MoE layer of
    one step with the experts it used, in fetch order. File layout (little-endian): b"MSWTRACE", u32 version,
    u32 n, n bytes of JSON metadata, u32 events, then u32 step[events], u16 layer[events], u16 count[events],
    u16 expert[sum(count)]. A trace is checked when read (`Trace.check`: metadata types, ids in range) and
    against the model it is used with (`Trace.check_model`).
    """
    path = Path(path)
    meta = jsonio.dumps(trace.meta, sort_keys=True).encode()
    with atomic_file(path, overwrite) as f:
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
    """Reads and checks a trace (`Trace.check`); every problem is a one-line ValueError naming the field."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path}: is a directory, expected a routing trace file (from `moeswap trace`)")
    data = path.read_bytes()
    if not data.startswith(MAGIC):
        raise ValueError(f"{path}: not a moeswap routing trace (expected it to start with {MAGIC.decode()}); "
                         f"record one with `moeswap trace MODEL --prompts FILE -o {path.name}`")
    try:
        version, meta_len = struct.unpack_from("<II", data, len(MAGIC))
        if version != VERSION:
            raise ValueError(f"format version {version}, this moeswap reads version {VERSION}")
        at = len(MAGIC) + 8
        if at + meta_len > len(data):
            raise ValueError(f"truncated: {meta_len} bytes of metadata claimed, {len(data) - at} present")
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
        return Trace(meta, *arrays).check()
    except RecursionError:
        raise ValueError(f"{path}: corrupt routing trace: its metadata JSON is nested too deeply") from None
    except (struct.error, ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: corrupt routing trace: {err}; record it again with `moeswap trace`") from None


def _take(data: bytes, at: int, code: str, count: int) -> array:
    a = array(code)
    end = at + count * a.itemsize
    if end > len(data):
        raise ValueError(f"truncated: needs {end} bytes, file has {len(data)}")
    a.frombytes(data[at:end])
    if sys.byteorder != "little":
        a.byteswap()
    return a
