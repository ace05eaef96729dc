"""Fuzz (hypothesis): routing traces, hardware TOML files and command-line arguments.

For every input, `moeswap` either prints one line `moeswap: error: ...` and exits 2, or succeeds with
output free of non-finite numbers; never a traceback (an exception escaping `cli.main` fails the test).
Examples are derandomised so CI sees the same inputs every run.
"""

from __future__ import annotations

import json
import math
import re

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from moeswap import cli
from moeswap.experts.trace import TraceRecorder, read_trace, write_trace
from moeswap.planner.hardware import _SCHEMA

FUZZ = settings(max_examples=30, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
ONE_LINE_ERROR = re.compile(r"moeswap: error: \S")  # one prefix for every command, `plan` included
NON_FINITE = re.compile(r"\b(nan|inf|infinity)\b", re.IGNORECASE)


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """(exit code, stdout, stderr); argparse's own exits count as exit codes."""
    capsys.readouterr()
    try:
        code = cli.main(argv)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 2
    out, err = capsys.readouterr()
    return code, out, err


def assert_clean(code: int, out: str, err: str) -> None:
    assert code in (0, 2), (code, err)
    if code == 2:
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and ONE_LINE_ERROR.match(lines[0]), err
    else:
        assert not NON_FINITE.search(out), out[-2000:]


# -- traces ---------------------------------------------------------------------------------------------

META = {"num_layers": 6, "num_experts": 16, "moe_layers": [1, 2, 3, 4, 5], "top_k": 4, "expert_stored_bytes": 1000}


@pytest.fixture(scope="module")
def trace_bytes(tmp_path_factory) -> bytes:
    rec = TraceRecorder(META)
    for step in range(6):
        for layer in META["moe_layers"]:
            rec.record(layer, [(step * 3 + layer + k) % 16 for k in range(4)])
    return write_trace(rec.trace, tmp_path_factory.mktemp("trace") / "t.bin").read_bytes()


json_values = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                                       max_size=4), max_leaves=12)


@FUZZ
@given(flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=6),
       cut=st.none() | st.integers(0, 10_000),
       meta=st.none() | st.dictionaries(st.sampled_from([*META, "junk"]), json_values, max_size=6))
@example(flips=[], cut=None, meta={**META, "num_experts": 2})  # expert ids beyond the experts
@example(flips=[], cut=None, meta={**META, "moe_layers": [99]})  # a layer the model does not have
@example(flips=[], cut=None, meta={"num_layers": "six"})
@example(flips=[], cut=12, meta=None)
def test_any_trace_reads_or_fails_with_one_line(trace_bytes, tmp_path, capsys, flips, cut, meta):
    data = bytearray(trace_bytes)
    if meta is not None:  # replace the metadata, keep the events
        raw = json.dumps(meta).encode()
        old = int.from_bytes(data[12:16], "little")
        data[12:16 + old] = len(raw).to_bytes(4, "little") + raw
    for pos, byte in flips:
        if data:
            data[pos % len(data)] = byte
    if cut is not None:
        data = data[:cut]
    path = tmp_path / "fuzzed.bin"
    path.write_bytes(bytes(data))
    try:
        trace = read_trace(path)
    except ValueError as err:
        assert "\n" not in str(err)
        return
    # a trace that reads is consistent: every expert id within its experts, counts add up
    assert all(0 <= e < trace.meta["num_experts"] for e in trace.experts)
    assert sum(trace.counts) == len(trace.experts)


@settings(max_examples=6, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(flips=st.lists(st.tuples(st.integers(0, 4_000), st.integers(0, 255)), min_size=1, max_size=4))
def test_bench_cache_on_a_damaged_trace(trace_bytes, tmp_path, capsys, flips):
    data = bytearray(trace_bytes)
    for pos, byte in flips:
        data[pos % len(data)] = byte
    path = tmp_path / "fuzzed.bin"
    path.write_bytes(bytes(data))
    assert_clean(*run_cli(["bench", "cache", "--trace", str(path), "--budgets", "50", "--policies", "lru",
                           "--out-dir", str(tmp_path / "out")], capsys))


# -- hardware TOML --------------------------------------------------------------------------------------

def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, int):
        return str(v)
    return json.dumps(v)


field_values = (st.integers(-10, 10**6) | st.floats(allow_nan=True, allow_infinity=True, width=32)
                | st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=6) | st.booleans())


@st.composite
def hardware_toml(draw) -> str:
    kind = draw(st.sampled_from([*_SCHEMA, "junk"]))
    fields = list(_SCHEMA.get(kind, {"x": (float, True)}))
    chosen = draw(st.lists(st.sampled_from([*fields, "bogus"]), unique=True, max_size=len(fields) + 1))
    values = {k: draw(field_values) for k in chosen}
    lines = [f"[{kind}.fuzz]"] + [f"{k} = {toml_value(v)}" for k, v in values.items()]
    if draw(st.booleans()):
        lines += [f"[{kind}.fuzz.source]"] + [f'{k} = "fuzz"' for k in values]
    return "\n".join(lines) + "\n"


@FUZZ
@given(text=hardware_toml() | st.text(max_size=60))
@example(text='[accelerator.x]\nname = "x"\nmemory_gb = nan\n[accelerator.x.source]\nmemory_gb = "me"\n')
@example(text="[accelerator\n")
def test_any_hardware_file_plans_or_fails_with_one_line(tmp_path, capsys, text):
    path = tmp_path / "hw.toml"
    path.write_text(text)
    code, out, err = run_cli(["plan", "--model", "kimi-linear-48b", "--hardware", "h200", "--devices", "8",
                              "--catalog", str(path), "--concurrency", "1"], capsys)
    assert_clean(code, out, err)


# -- command-line arguments -----------------------------------------------------------------------------


@pytest.mark.parametrize("extra", [
    ["--devices", "99999999999"],  # used to enumerate layouts for minutes
    ["--devices", "0"],
    ["--devices", "8", "--isl", "1000000000000000", "--concurrency", "100000000000"],
    ["--devices", "8", "--workload", "lora", "--rank", "1000000000000", "--micro-batch", "100000000000"],
], ids=["devices-10^11", "devices-0", "isl-10^15", "lora-rank-10^12"])
def test_plan_with_huge_or_empty_inputs_answers_at_once(capsys, extra):
    """Inputs far past any real cluster are refused (or found not to fit) in one line, not enumerated."""
    import signal

    def hang(signum, frame):
        raise TimeoutError("moeswap plan did not answer within 60 s")

    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(60)
    try:
        code, out, err = run_cli(["plan", "--model", "kimi-k3", "--hardware", "h200", *extra], capsys)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert code == 2, out
    assert_clean(code, out, err)

numbers = st.sampled_from(["nan", "inf", "-inf", "-1", "0", "1e400", "", "abc", "0.5", "1", "2"])


@FUZZ
@given(temperature=numbers, top_p=numbers, top_k=st.sampled_from(["-3", "0", "5", "x", "1e3"]),
       max_tokens=st.sampled_from(["-5", "0", "1", "3", "x", "100000000"]),
       expert_memory=st.sampled_from(["0", "1", "1GiB", "12 parsecs", "-1GiB", "1e999", "nan"]),
       extra=st.lists(st.sampled_from([["--dtype", "int8"], ["--dtype", "nonesuch"], ["--device", "meta"],
                                       ["--device", "tpu"], ["--expert-policy", "fifo"], ["--prefetch", "x"],
                                       ["--host-memory", "-5"], ["--seed", "-1"], ["--chat"], ["--json"],
                                       ["--gemm-precision", "fp8"], ["--prompt", "\udcff"]]), max_size=3))
@example(temperature="nan", top_p="1", top_k="0", max_tokens="2", expert_memory="1GiB", extra=[])
def test_any_generate_flags_run_or_fail_with_one_line(tiny_k3_dir, capsys, temperature, top_p, top_k, max_tokens,
                                                       expert_memory, extra):
    argv = ["generate", str(tiny_k3_dir), "--prompt", "hi", "--temperature", temperature, "--top-p", top_p,
            "--top-k", top_k, "--max-tokens", max_tokens, "--expert-memory", expert_memory, "--seed", "1",
            *[flag for pair in extra for flag in pair]]
    code, out, err = run_cli(argv, capsys)
    assert_clean(code, out, err)
    valid = (_number(temperature) is not None and 0 <= _number(temperature) < math.inf
             and _number(top_p) is not None and 0 < _number(top_p) <= 1 and max_tokens in ("1", "3"))
    if not valid:  # a value no sampler can use is refused, never run as something else
        assert code == 2, (argv, out)


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None
