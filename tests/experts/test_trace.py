"""Routing traces: written atomically and never over a file by accident; every damaged or inconsistent
trace is a one-line error naming the field, in the reader and in each command that reads one."""

from __future__ import annotations

import json
import struct
from array import array
from pathlib import Path

import pytest

from moeswap.cli import main
from moeswap.config import load_config
from moeswap.experts.trace import MAGIC, VERSION, Trace, TraceRecorder, read_trace, write_trace

META = {"num_layers": 4, "num_experts": 8, "moe_layers": [1, 2, 3], "top_k": 2, "model": "m",
        "expert_stored_bytes": 100}


def recorded(meta: dict = META) -> Trace:
    rec = TraceRecorder(meta)
    for _ in range(3):
        rec.record(1, [0, 7])
        rec.record(2, [3, 4])
        rec.record(3, [5, 1])
    return rec.trace


def raw_trace(meta, steps=(0,), layers=(1,), counts=(2,), experts=(0, 1), tail=b"") -> bytes:
    """A trace file's bytes as written, whatever they say (the writer does not check)."""
    m = json.dumps(meta).encode() if not isinstance(meta, bytes) else meta
    body = b"".join(array(code, values).tobytes() for code, values in
                    (("I", steps), ("H", layers), ("H", counts), ("H", experts)))
    return MAGIC + struct.pack("<II", VERSION, len(m)) + m + struct.pack("<I", len(steps)) + body + tail


def test_round_trip(tmp_path):
    trace = recorded()
    write_trace(trace, tmp_path / "t.bin")
    back = read_trace(tmp_path / "t.bin")
    assert back.meta == META and list(back.events()) == list(trace.events()) and back.num_steps == 3
    assert [p.name for p in tmp_path.iterdir()] == ["t.bin"]  # no temporary file left


@pytest.mark.parametrize("change, message", [
    (dict(meta=[1, 2]), "metadata is a JSON list, expected an object"),
    (dict(meta={k: v for k, v in META.items() if k != "num_experts"}), "metadata has no 'num_experts'"),
    (dict(meta={**META, "num_experts": "8"}), "metadata 'num_experts' is '8', expected a JSON integer"),
    (dict(meta={**META, "num_layers": True}), "metadata 'num_layers' is True, expected a JSON integer"),
    (dict(meta={**META, "moe_layers": 3}), "metadata 'moe_layers' is 3, expected a JSON list"),
    (dict(meta={**META, "model": 5}), "metadata 'model' is 5, expected a JSON string"),
    (dict(meta={**META, "num_experts": 0}), "metadata 'num_experts' is 0, expected an integer between 1 and 65536"),
    (dict(meta={**META, "num_layers": -4}), "metadata 'num_layers' is -4, expected an integer between 1 and 65536"),
    (dict(meta={**META, "expert_stored_bytes": -1}), "metadata 'expert_stored_bytes' is -1, expected an integer "
                                                     "at least 0"),
    (dict(meta={**META, "top_k": 9}), "metadata 'top_k' is 9, more than num_experts 8"),
    (dict(meta={**META, "moe_layers": [1, 4]}), "metadata 'moe_layers' holds 4; expected distinct layer ids below "
                                                "num_layers 4"),
    (dict(meta={**META, "moe_layers": [1, 1]}), "metadata 'moe_layers' repeats a layer"),
    (dict(meta={**META, "moe_layers": []}), "metadata 'moe_layers' is empty"),
    (dict(meta={**META, "moe_layers": [1.0]}), "metadata 'moe_layers' holds 1.0"),
    (dict(layers=(0,)), "events at layer 0, which metadata 'moe_layers' (1..3) does not list"),
    (dict(layers=(9,)), "events at layer 9, which metadata 'moe_layers' (1..3) does not list"),
    (dict(experts=(0, 8)), "expert id 8 (expert entry 1) is out of range: metadata 'num_experts' is 8"),
    (dict(steps=(1, 0), layers=(1, 1), counts=(1, 1)), "event 1 has step 0 after step 1; steps must not decrease"),
    (dict(counts=(3,)), "truncated: needs"),
    (dict(tail=b"\0\0"), "2 bytes after the last event"),
    (dict(meta=b"[" * 100_000 + b"]" * 100_000), "its metadata JSON is nested too deeply"),
    (dict(meta=b'{"num_layers": '), "corrupt routing trace: Expecting value"),
])
def test_damaged_traces_are_one_line_errors_naming_the_field(tmp_path, change, message):
    path = tmp_path / "t.bin"
    path.write_bytes(raw_trace(**{"meta": META, **change}))
    with pytest.raises(ValueError) as info:
        read_trace(path)
    assert str(info.value).startswith(f"{path}: corrupt routing trace: ") and message in str(info.value)
    assert "\n" not in str(info.value)


def test_truncated_metadata_and_directories(tmp_path):
    path = tmp_path / "t.bin"
    path.write_bytes(MAGIC + struct.pack("<II", VERSION, 1000) + b"{}")
    with pytest.raises(ValueError, match="truncated: 1000 bytes of metadata claimed, 2 present"):
        read_trace(path)
    with pytest.raises(ValueError, match="is a directory, expected a routing trace file"):
        read_trace(tmp_path)


def test_check_model(tiny_k3_dir):
    config = load_config(tiny_k3_dir)  # 6 layers, MoE layers 1..5, 16 experts
    ok = Trace({"num_layers": 6, "num_experts": 16, "moe_layers": [1, 2, 3, 4, 5]})
    assert ok.check_model(config) is ok
    with pytest.raises(ValueError, match="--expert-profile t.bin: recorded on a model with 8 routed experts per "
                                         "layer; this model has 16; record one of this model"):
        Trace({**ok.meta, "num_experts": 8}).check_model(config, "--expert-profile t.bin")
    with pytest.raises(ValueError, match=r"recorded on a model with 6 layers, MoE layers \[2, 4\]; this model has 6, "
                                         r"MoE layers 1..5"):
        Trace({**ok.meta, "moe_layers": [2, 4]}).check_model(config)


def test_commands_refuse_a_bad_trace_in_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.bin"
    bad.write_bytes(raw_trace(META, experts=(0, 40)))
    assert main(["bench", "cache", "--trace", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err == (f"moeswap: error: {bad}: corrupt routing trace: expert id 40 (expert entry 1) is out of range: "
                   f"metadata 'num_experts' is 8; record it again with `moeswap trace`\n")
    assert main(["plan", "--model", "kimi-k3", "--hardware", "h200", "--devices", "16", "--trace", str(bad)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "expert id 40 (expert entry 1) is out of range" in err


# -- moeswap trace -o ----------------------------------------------------------------------------------


@pytest.fixture
def prompts(tmp_path) -> Path:
    path = tmp_path / "prompts.txt"
    path.write_text("hello there\n")
    return path


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("moeswap: error: ") and "Traceback" not in err, err
    return err.strip().removeprefix("moeswap: error: ")


def test_output_is_checked_before_the_model_loads(tmp_path, prompts, capsys):
    """Refusals come before any work: the model directory here does not even exist."""
    nothing = str(tmp_path / "no-model")
    shard = tmp_path / "model-00001-of-00003.safetensors"
    shard.write_bytes(b"precious")
    assert main(["trace", nothing, "--prompts", str(prompts), "-o", str(shard)]) == 2
    assert one_line(capsys) == f"-o {shard} exists; pass --force to overwrite it, or choose another file"
    assert shard.read_bytes() == b"precious"
    for force in ([], ["--force"]):
        assert main(["trace", nothing, "--prompts", str(prompts), "-o", str(prompts), *force]) == 2
        assert one_line(capsys) == f"-o {prompts} is the --prompts file; write the trace to another file"
        link = tmp_path / "link.txt"
        link.unlink(missing_ok=True)
        link.symlink_to(prompts)
        assert main(["trace", nothing, "--prompts", str(prompts), "-o", str(link), *force]) == 2
        assert one_line(capsys) == f"-o {link} is the --prompts file; write the trace to another file"
        assert main(["trace", nothing, "--prompts", str(prompts), "-o", str(tmp_path), *force]) == 2
        assert one_line(capsys) == (f"-o {tmp_path}: is a directory; give the trace a file name, e.g. -o "
                                    f"{tmp_path / 'trace.bin'}")
    assert prompts.read_text() == "hello there\n"
    assert main(["trace", nothing, "--prompts", str(prompts), "-o", str(tmp_path / "no" / "t.bin")]) == 2
    assert one_line(capsys) == f"-o {tmp_path / 'no' / 't.bin'}: directory {tmp_path / 'no'} does not exist"
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"caf\xe9\n")
    assert main(["trace", nothing, "--prompts", str(bad), "-o", str(tmp_path / "t.bin")]) == 2
    assert one_line(capsys) == f"--prompts {bad}: not UTF-8 text (byte 0xe9 at offset 3)"
    import os

    os.mkfifo(tmp_path / "fifo")
    for endless in ("/dev/zero", str(tmp_path / "fifo")):  # /dev/zero grew the process to 8.5 GB; a FIFO blocks
        assert main(["trace", nothing, "--prompts", endless, "-o", str(tmp_path / "t.bin")]) == 2
        assert one_line(capsys) == f"--prompts {endless}: expected a regular text file, found a device, FIFO or socket"


def test_force_overwrites_atomically(tiny_k3_dir, tmp_path, prompts, capsys):
    out = tmp_path / "trace.bin"
    out.write_bytes(b"old")
    assert main(["trace", str(tiny_k3_dir), "--prompts", str(prompts), "-o", str(out), "--force",
                 "--max-tokens", "2", "--ignore-eos"]) == 0
    trace = read_trace(out)
    assert trace.num_steps == 2 and trace.check_model(load_config(tiny_k3_dir)) is trace
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.txt", "trace.bin"]


def test_write_trace_never_replaces_without_overwrite(tmp_path):
    path = tmp_path / "t.bin"
    path.write_bytes(b"keep")
    with pytest.raises(FileExistsError, match="already exists"):
        write_trace(recorded(), path, overwrite=False)
    assert path.read_bytes() == b"keep" and [p.name for p in tmp_path.iterdir()] == ["t.bin"]


def test_a_prompts_file_past_the_cap_is_refused_unread(tmp_path, monkeypatch, capsys):
    from moeswap.commands import trace as trace_command

    monkeypatch.setattr(trace_command, "MAX_PROMPTS_BYTES", 1 << 20)
    big = tmp_path / "big.txt"
    big.write_bytes(b"a prompt\n" * ((1 << 20) // 9 + 1))
    assert main(["trace", str(tmp_path / "no-model"), "--prompts", str(big), "-o", str(tmp_path / "t.bin")]) == 2
    assert one_line(capsys) == f"--prompts {big}: more than 1 MiB of prompts; trace a smaller file"
