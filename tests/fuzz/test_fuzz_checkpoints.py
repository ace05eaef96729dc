"""Fuzzing a checkpoint as hostile input (hypothesis): config.json, the index, safetensors headers and
expert bytes of a tiny model are mutated, then `moeswap inspect --json` and load_model (+ one forward) run
on the result. Every input must give exit code 2 with one line `moeswap: error: ...` (load_model: one
ValueError line), or success with finite numbers; never another exception, a hang (an alarm fails the
example), or a file outside the model directory opened (a valid shard and a secret lie beside it as bait).

Derandomized, no example database, a few dozen examples per target: ~1 min on one core in all."""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import shutil
import signal
import struct
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, currently_in_test_context, event, example, given, settings
from hypothesis import strategies as st

from moeswap.cli import USER_ERRORS, main
from moeswap.formats import mxfp4
from moeswap.formats.checkpoint import INDEX_NAME, SAFETENSORS_DTYPES, CheckpointError
from moeswap.models.loader import load_model
from moeswap.tiny import tiny_config
from open_spy import opened_paths

HANG_S = 60  # one example takes well under a second; only a blocked read or an endless loop takes this long
SECRET = b"secret-token-4242 (not a checkpoint)\n"


def fuzz_settings(n: int):
    return settings(max_examples=n, deadline=None, derandomize=True, database=None, print_blob=False,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large, HealthCheck.large_base_example])


# -- the harness ------------------------------------------------------------------------------------


class Hang(Exception):
    pass


@contextlib.contextmanager
def alarm(seconds: int):
    def fire(signum, frame):
        raise Hang(f"no answer within {seconds} s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def workspace(base: Path):
    """root/model: a fresh copy of `base`; root/outside: bait (a valid shard of the same model, a secret,
    a config.json) that no input may make moeswap open."""
    root = Path(tempfile.mkdtemp(prefix="fuzz-"))
    try:
        model, outside = root / "model", root / "outside"
        shutil.copytree(base, model)
        outside.mkdir()
        shard = sorted(model.glob("*.safetensors"))[0]
        shutil.copy(shard, outside / "secret.safetensors")
        shutil.copy(shard, outside / shard.name)
        (outside / "passwd").write_bytes(SECRET)
        shutil.copy(model / "config.json", outside / "config.json")
        yield root, model, outside
    finally:
        shutil.rmtree(root, ignore_errors=True)


def outcome(what: str) -> None:
    """Counted by `--hypothesis-show-statistics`, which shows how often each path ran."""
    if currently_in_test_context():
        event(what)


def one_line(message: str) -> None:
    assert message and "\n" not in message and "Traceback" not in message, message
    assert SECRET.decode().strip() not in message


def all_finite(value) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(all_finite(v) for v in value.values())
    if isinstance(value, list):
        return all(all_finite(v) for v in value)
    return True


def run_inspect(model: Path, capsys) -> None:
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            rc = main(["inspect", "--json", str(model)])
        except SystemExit as e:
            rc = e.code
    out, err = capsys.readouterr()
    for w in caught:
        one_line(str(w.message))
    outcome(f"inspect exit code {rc}")
    if rc == 0:
        assert err == "" and all_finite(json.loads(out))
    else:
        assert rc == 2 and out == "", (rc, out, err)
        assert err.startswith("moeswap: error: ") and err.count("\n") == 1 and err.endswith("\n"), err
        one_line(err[:-1])


def run_load_and_forward(model: Path) -> None:
    """load_model, then one forward over 4 tokens: a one-line user error, or finite logits."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            m, store = load_model(model)
        except USER_ERRORS as e:
            outcome("load_model: error")
            one_line(str(e))
            return
    try:
        with torch.inference_mode():
            logits = m(torch.tensor([[7, 8, 9, 10]]))
    except USER_ERRORS as e:  # an expert read while routing
        outcome("forward: error")
        one_line(str(e))
        return
    finally:
        store.close()
        store.ckpt.close()
    outcome("forward: ran")
    if not bool(torch.isfinite(logits).all()):
        # Only arithmetic overflow may get here: from a non-finite dense weight or a config float so large
        # that fp32 overflows; issue #16 gives those to the engine's per-step logits check, not the reader.
        c = m.config
        floats = [c.rms_norm_eps, c.situ_beta, c.situ_linear_beta, c.moe.routed_scaling_factor,
                  abs(c.kda.gate_lower_bound or 0.0)]
        weights_finite = all(bool(torch.isfinite(p).all()) for p in m.parameters())
        assert not weights_finite or max(floats) > 1e4, "finite weights and ordinary config gave non-finite logits"


def check(root: Path, model: Path, capsys) -> None:
    with alarm(HANG_S), opened_paths() as seen:
        run_inspect(model, capsys)
        run_load_and_forward(model)
    outside = [p for p in seen if p.is_relative_to(root.resolve()) and not p.is_relative_to(model.resolve())]
    assert not outside, f"opened outside the model directory: {outside}"


# -- values ---------------------------------------------------------------------------------------

SPECIAL_NUMBERS = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1e39, 1e308, 5e-324, 1e-39, -1.0, -5.0, 0.5, 2.0,
                   0, 1, -1, 2, 2**24, 2**24 + 1, 2**31, 2**63, 10**400]
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 70), st.sampled_from(SPECIAL_NUMBERS),
    st.floats(1e-3, 10.0), st.floats(-10.0, -1e-3), st.text(max_size=12),
)
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                           max_size=3), max_leaves=6)
RAW_FILES = st.one_of(
    st.binary(max_size=64),
    st.integers(1, 200_000).map(lambda d: b"[" * d + b"]" * d),
    st.integers(1, 200_000).map(lambda d: b'{"a": ' + b"[" * d),
    st.integers(4000, 6000).map(lambda n: b'{"hidden_size": ' + b"7" * n + b"}"),
    st.sampled_from([b"", b"{}", b"[]", b"null", b'"text"', b"\xff\xfe{}", b'{"a": "\xc3"}', b"NaN"]),
)


def leaf_paths(d: dict, prefix: tuple = ()) -> list[tuple]:
    out = []
    for k, v in d.items():
        out.append(prefix + (k,))
        if isinstance(v, dict):
            out += leaf_paths(v, prefix + (k,))
    return out


CONFIG = tiny_config("kimi_k3", "tiny")
CONFIG_PATHS = leaf_paths(CONFIG)


def _containers(d: dict, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    for k, v in d.items():
        if isinstance(v, dict):
            out += _containers(v, prefix + (k,))
    return out


CONFIG_DICTS = _containers(CONFIG)


def config_edits():
    return st.lists(st.one_of(
        st.tuples(st.just("set"), st.sampled_from(CONFIG_PATHS), VALUES),
        st.tuples(st.just("delete"), st.sampled_from(CONFIG_PATHS)),
        st.tuples(st.just("add"), st.sampled_from(CONFIG_DICTS), st.text(max_size=10), VALUES),
        st.tuples(st.just("nest"), st.sampled_from(CONFIG_PATHS), st.integers(1, 3000)),
    ), min_size=1, max_size=3)


class Nested:
    """A value wrapped in `depth` JSON lists, written as text by `dumps` (json's encoder would recurse)."""

    def __init__(self, value, depth: int):
        self.value, self.depth = value, depth


def apply_config_edits(raw: dict, edits) -> dict:
    raw = copy.deepcopy(raw)
    for op, *args in edits:
        path = args[0]
        parent = raw
        for k in path[:-1] if op != "add" else path:
            parent = parent.get(k) if isinstance(parent, dict) else None
        if not isinstance(parent, dict):
            continue  # an earlier edit replaced the container
        if op == "set":
            parent[path[-1]] = args[1]
        elif op == "delete":
            parent.pop(path[-1], None)
        elif op == "add":
            parent[args[1]] = args[2]
        else:  # nesting the parser must survive
            parent[path[-1]] = Nested(parent.get(path[-1]), args[1])
    return raw


def dumps(value) -> str:
    """json.dumps, with each Nested value spliced in as text."""
    spliced: list[Nested] = []

    def placeholder(obj):
        if isinstance(obj, Nested):
            spliced.append(obj)
            return f"NESTED-{len(spliced) - 1}"
        raise TypeError(type(obj))

    text = json.dumps(value, default=placeholder)
    for i, n in enumerate(spliced):
        text = text.replace(f'"NESTED-{i}"', "[" * n.depth + dumps(n.value) + "]" * n.depth, 1)
    return text


# -- config.json ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def k3(tiny_k3_dir) -> Path:
    return tiny_k3_dir


@fuzz_settings(100)
@given(edits=config_edits())
@example(edits=[("set", ("text_config", "rms_norm_eps"), math.nan)])
@example(edits=[("set", ("text_config", "routed_scaling_factor"), -1.0)])
@example(edits=[("set", ("text_config", "routed_scaling_factor"), 0.0)])
@example(edits=[("set", ("text_config", "linear_attn_config", "gate_lower_bound"), math.inf)])
@example(edits=[("set", ("text_config", "activation_situ_beta"), 0)])
@example(edits=[("set", ("text_config", "num_experts_per_token"), 17)])
@example(edits=[("set", ("text_config", "hidden_size"), 2**40)])
@example(edits=[("set", ("text_config", "num_hidden_layers"), 10**9)])
@example(edits=[("set", ("text_config", "linear_attn_config"), [1, 2])])
@example(edits=[("nest", ("text_config", "quantization_config"), 3000)])
@example(edits=[("set", ("text_config", "mla_use_output_gate"), "false")])
@example(edits=[("set", ("text_config", "eos_token_id"), 512)])
@example(edits=[("set", ("text_config", "routed_scaling_factor"), 2.5)])  # valid: loads and runs
def test_config_json(k3, capsys, edits):
    with workspace(k3) as (root, model, _):
        raw = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(dumps(apply_config_edits(raw, edits)))
        check(root, model, capsys)


@fuzz_settings(20)
@given(content=RAW_FILES)
@example(content=b"[" * 100_000 + b"]" * 100_000)
@example(content="{\"model_type\": \"kimi\xe9\"}".encode("latin-1"))
def test_config_json_bytes(k3, capsys, content):
    with workspace(k3) as (root, model, _):
        (model / "config.json").write_bytes(content)
        check(root, model, capsys)


@pytest.mark.parametrize("kind", ["directory", "fifo", "link outside"])
def test_config_json_not_a_file(k3, capsys, kind):
    with workspace(k3) as (root, model, outside):
        (model / "config.json").unlink()
        if kind == "directory":
            (model / "config.json").mkdir()
        elif kind == "fifo":
            os.mkfifo(model / "config.json")
        else:
            (model / "config.json").symlink_to(outside / "config.json")
        check(root, model, capsys)


# -- the index ------------------------------------------------------------------------------------

# Spellings of a shard path; OUTSIDE is replaced by the bait directory's absolute path, and the named
# links, directory and FIFO are made inside the model directory first.
SHARD_SPELLINGS = [
    "../outside/secret.safetensors", "OUTSIDE/secret.safetensors", "OUTSIDE/passwd", "link-out.safetensors",
    "linkdir/secret.safetensors", "link-in.safetensors", "sub/../model-00001-of-00003.safetensors",
    "./model-00001-of-00003.safetensors", "", ".", "..", "/dev/zero", "/proc/self/environ",
    "model-00009-of-00003.safetensors", "dir.safetensors", "fifo.safetensors", "config.json",
    "tokenizer.json", "model-00001-of-00003.safetensors\x00", "model-00001-of-00003.safetensors\n",
]
SHARDS = st.one_of(st.sampled_from(SHARD_SPELLINGS), st.text(max_size=20), VALUES)


def plant(model: Path, outside: Path) -> None:
    (model / "link-out.safetensors").symlink_to(outside / "secret.safetensors")
    (model / "linkdir").symlink_to(outside, target_is_directory=True)
    (model / "link-in.safetensors").symlink_to("model-00002-of-00003.safetensors")
    (model / "dir.safetensors").mkdir()
    os.mkfifo(model / "fifo.safetensors")


def index_edits():
    return st.lists(st.one_of(
        st.tuples(st.just("shard"), st.integers(0, 10**6), SHARDS),
        st.tuples(st.just("rename"), st.integers(0, 10**6), st.text(max_size=30)),
        st.tuples(st.just("delete"), st.integers(0, 10**6)),
        st.tuples(st.just("add"), st.text(max_size=30), SHARDS),
        st.tuples(st.just("weight_map"), VALUES),
        st.tuples(st.just("top"), VALUES),
    ), min_size=1, max_size=3)


def apply_index_edits(index: dict, edits, outside: Path):
    def spell(shard):
        return shard.replace("OUTSIDE", str(outside)) if isinstance(shard, str) else shard

    for op, *args in edits:
        wm = index.get("weight_map") if isinstance(index, dict) else None
        names = sorted(wm) if isinstance(wm, dict) else []
        if op == "shard" and names:
            wm[names[args[0] % len(names)]] = spell(args[1])
        elif op == "rename" and names:
            old = names[args[0] % len(names)]
            wm[args[1]] = wm.pop(old)
        elif op == "delete" and names:
            del wm[names[args[0] % len(names)]]
        elif op == "add" and isinstance(wm, dict):
            wm[args[0]] = spell(args[1])
        elif op == "weight_map" and isinstance(index, dict):
            index["weight_map"] = args[0]
        elif op == "top":
            index = args[0]
    return index


def every_shard(spelling: str):
    return [("shard", i, spelling) for i in range(0, 400, 37)]


@fuzz_settings(60)
@given(edits=index_edits())
@example(edits=every_shard("../outside/model-00001-of-00003.safetensors"))  # a complete, valid shard outside
@example(edits=every_shard("OUTSIDE/model-00001-of-00003.safetensors"))
@example(edits=[("shard", 0, "OUTSIDE/passwd")])  # used to print its first 8 bytes as a number
@example(edits=[("shard", 0, "link-out.safetensors")])
@example(edits=[("shard", 0, "linkdir/secret.safetensors")])
@example(edits=[("shard", 0, "fifo.safetensors")])
@example(edits=[("shard", 0, "/dev/zero")])
@example(edits=[("shard", 3, "link-in.safetensors")])  # a link inside the model: allowed
@example(edits=[("rename", 5, "evil\nname")])
def test_index(k3, capsys, edits):
    with workspace(k3) as (root, model, outside):
        plant(model, outside)
        index = json.loads((model / INDEX_NAME).read_text())
        (model / INDEX_NAME).write_text(dumps(apply_index_edits(index, edits, outside)))
        check(root, model, capsys)


@fuzz_settings(15)
@given(content=RAW_FILES)
def test_index_bytes(k3, capsys, content):
    with workspace(k3) as (root, model, _):
        (model / INDEX_NAME).write_bytes(content)
        check(root, model, capsys)


# -- safetensors headers --------------------------------------------------------------------------


def read_shard(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def write_shard(path: Path, header, body: bytes, header_bytes: bytes | None = None, length: int | None = None) -> None:
    raw = header_bytes if header_bytes is not None else dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + body)


DTYPES = st.one_of(st.sampled_from(sorted(SAFETENSORS_DTYPES) + ["F4", "", "f32", "BF16 "]), VALUES)
DIMS = st.one_of(st.integers(-2, 70), st.integers(0, 2**64 + 1), st.sampled_from([2**31, 2**62, 2**63, 2**63 - 1]))
SHAPES = st.one_of(st.lists(DIMS, max_size=4), st.lists(st.just(1), min_size=60, max_size=70), VALUES)
OFFSET_SHIFTS = st.one_of(st.integers(-70, 70), st.sampled_from([2**32, 2**63, 2**64, 10**30]))


def header_edits():
    return st.lists(st.one_of(
        st.tuples(st.just("dtype"), st.integers(0, 10**6), DTYPES),
        st.tuples(st.just("shape"), st.integers(0, 10**6), SHAPES),
        st.tuples(st.just("offsets"), st.integers(0, 10**6), OFFSET_SHIFTS, OFFSET_SHIFTS),
        st.tuples(st.just("offsets_value"), st.integers(0, 10**6), VALUES),
        st.tuples(st.just("overlap"), st.integers(0, 10**6)),
        st.tuples(st.just("entry"), st.integers(0, 10**6), VALUES),
        st.tuples(st.just("rename"), st.integers(0, 10**6), st.text(max_size=30)),
        st.tuples(st.just("metadata"), VALUES),
    ), min_size=1, max_size=3)


def apply_header_edits(header: dict, edits) -> dict:
    for op, *args in edits:
        names = sorted(k for k in header if k != "__metadata__")
        if op == "metadata":
            header["__metadata__"] = args[0]
            continue
        name = names[args[0] % len(names)]
        entry = header[name]
        if not isinstance(entry, dict):
            entry = header[name] = {}
        if op == "dtype":
            entry["dtype"] = args[1]
        elif op == "shape":
            entry["shape"] = args[1]
        elif op == "offsets":
            begin, end = entry.get("data_offsets", [0, 0]) if isinstance(entry.get("data_offsets"), list) and \
                len(entry.get("data_offsets")) == 2 else (0, 0)
            if isinstance(begin, int) and isinstance(end, int):
                entry["data_offsets"] = [begin + args[1], end + args[2]]
        elif op == "offsets_value":
            entry["data_offsets"] = args[1]
        elif op == "overlap":  # take the bytes of the tensor stored before this one
            other = header[names[(args[0] + 1) % len(names)]]
            if isinstance(other, dict) and "data_offsets" in other:
                entry["data_offsets"] = other["data_offsets"]
                entry["dtype"], entry["shape"] = other.get("dtype"), other.get("shape")
        elif op == "entry":
            header[name] = args[1]
        else:
            header[args[1]] = header.pop(name)
    return header


@fuzz_settings(80)
@given(shard=st.integers(0, 2), edits=header_edits())
@example(shard=0, edits=[("overlap", 0)])
@example(shard=1, edits=[("shape", 0, [2**62, 2**62])])
@example(shard=1, edits=[("shape", 0, [2**63, 0])])
@example(shard=2, edits=[("dtype", 0, ["BF16"])])
@example(shard=2, edits=[("dtype", 0, "F4")])
@example(shard=0, edits=[("offsets", 0, -70, -70)])
@example(shard=0, edits=[("offsets", 0, 10**30, 10**30)])
@example(shard=1, edits=[("rename", 1, "evil\nname")])
@example(shard=2, edits=[("dtype", 3, "F16")])  # same size: loads; values reinterpreted
def test_safetensors_header(k3, capsys, shard, edits):
    with workspace(k3) as (root, model, _):
        path = sorted(model.glob("*.safetensors"))[shard]
        header, body = read_shard(path)
        write_shard(path, apply_header_edits(header, edits), body)
        check(root, model, capsys)


@fuzz_settings(30)
@given(shard=st.integers(0, 2), how=st.sampled_from(["length", "garbage", "truncate"]),
       length=st.integers(0, 2**64 - 1), garbage=RAW_FILES, cut=st.floats(0, 1))
@example(shard=0, how="length", length=2**64 - 1, garbage=b"", cut=0.0)
@example(shard=0, how="length", length=200_000_000, garbage=b"", cut=0.0)
@example(shard=1, how="garbage", length=0, garbage=b"[" * 100_000, cut=0.0)
@example(shard=1, how="garbage", length=0, garbage=b'{"w": "\xff"}', cut=0.0)
@example(shard=2, how="truncate", length=0, garbage=b"", cut=0.999)
def test_safetensors_bytes(k3, capsys, shard, how, length, garbage, cut):
    with workspace(k3) as (root, model, _):
        path = sorted(model.glob("*.safetensors"))[shard]
        header, body = read_shard(path)
        if how == "length":
            write_shard(path, header, body, length=length)
        elif how == "garbage":
            write_shard(path, None, body, header_bytes=garbage)
        else:
            size = path.stat().st_size
            os.truncate(path, int(size * cut))
        check(root, model, capsys)


# -- expert bytes ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tiny_k3_dir, tiny_linear_dir) -> dict[str, Path]:
    return {"kimi_k3": tiny_k3_dir, "kimi_linear": tiny_linear_dir}


# bytes at the edges: E8M0 252 (largest finite) to 255 (NaN); bf16 +Inf, NaN, the largest finite
EDGE_BYTES = [b"\xfc", b"\xfd", b"\xfe", b"\xff", b"\x80\x7f", b"\xc0\x7f", b"\x7f\x7f", b"\xff\xff\xff\xff"]


@fuzz_settings(60)
@given(arch=st.sampled_from(["kimi_k3", "kimi_linear"]), layer=st.integers(0, 10**6), expert=st.integers(0, 10**6),
       proj=st.sampled_from(["w1", "w2", "w3"]), kind=st.sampled_from(["weight_scale", "weight_packed", "weight"]),
       at=st.integers(0, 10**6), value=st.one_of(st.binary(min_size=1, max_size=4), st.sampled_from(EDGE_BYTES)))
@example(arch="kimi_k3", layer=1, expert=2, proj="w1", kind="weight_scale", at=5, value=b"\xff")
@example(arch="kimi_k3", layer=1, expert=2, proj="w2", kind="weight_scale", at=0, value=b"\xfd")
@example(arch="kimi_k3", layer=1, expert=2, proj="w2", kind="weight_scale", at=0, value=b"\xfc")
@example(arch="kimi_k3", layer=1, expert=2, proj="w3", kind="weight_packed", at=0, value=b"\xff\xff\xff\xff")
@example(arch="kimi_linear", layer=1, expert=3, proj="w3", kind="weight", at=2, value=b"\xc0\x7f")  # bf16 NaN
def test_expert_bytes(models, capsys, arch, layer, expert, proj, kind, at, value):
    """The reader hands out an expert only if it decodes to finite weights, else names the tensor."""
    with workspace(models[arch]) as (root, model, _):
        _, store = load_model(model)
        try:
            moe_layers = sorted({key[0] for key in store.index.entries})
            layer = moe_layers[layer % len(moe_layers)]
            expert %= len({key[1] for key in store.index.entries})
            kinds = store.index.names(layer, expert)[proj]
            name = kinds.get(kind) or kinds[sorted(kinds)[0]]
            info = store.ckpt.info(name)
            at %= info.nbytes
            with open(info.file, "r+b") as f:
                f.seek(info.offset + at)
                f.write(value[: info.nbytes - at])
            with alarm(HANG_S), opened_paths() as seen:
                try:
                    w = store.fetch(layer, [expert])[0]
                except CheckpointError as e:
                    outcome("expert: refused")
                    one_line(str(e))
                    assert str(e).startswith(f"{name} in {info.file} (layer {layer} expert {expert} {proj}): ")
                else:
                    outcome("expert: read")
                    mats = ([mxfp4.decode(getattr(w, f"{p}_packed"), getattr(w, f"{p}_scale"), torch.float32)
                             for p in ("w1", "w2", "w3")] if hasattr(w, "w1_packed") else [w.w1_FI, w.w3_FI, w.w2_IF])
                    assert all(bool(torch.isfinite(t).all()) for t in mats)
                run_inspect(model, capsys)  # headers untouched: inspect still succeeds
            assert all(p.is_relative_to(model.resolve()) for p in seen if p.is_relative_to(root.resolve()))
        finally:
            store.close()
            store.ckpt.close()
