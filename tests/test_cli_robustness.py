"""`moeswap generate` against hostile or unlucky input: a checkpoint with a NaN or infinite weight, sampling
flags out of range, a prompt that is not UTF-8, a device it cannot run on, and a reader that closes the
pipe early. Each ends with one line `moeswap: error: ...` and exit code 2, or (the closed pipe) quietly
with exit code 1; never a traceback or output from non-finite values."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moeswap.cli import main
from moeswap.commands import inspect as inspect_command
from moeswap.formats.checkpoint import INDEX_NAME

O_PROJ = "language_model.model.layers.2.self_attn.o_proj.weight"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, *fragments: str) -> str:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("moeswap: error: ") and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    return lines[0]


def set_weight(model: Path, name: str, index, value: float) -> None:
    """Rewrite one tensor of the model's shard in place, element `index` set to `value`."""
    shard = model / json.loads((model / INDEX_NAME).read_text())["weight_map"][name]
    with safe_open(str(shard), framework="pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    tensors[name][index] = value
    save_file(tensors, str(shard), metadata=metadata)


@pytest.fixture(scope="module")
def nan_model(tiny_k3_dir, tmp_path_factory) -> Path:
    model = Path(shutil.copytree(tiny_k3_dir, tmp_path_factory.mktemp("nan") / "model"))
    set_weight(model, O_PROJ, (0, 0), float("nan"))
    return model


# -- non-finite weights ----------------------------------------------------------------------------


@pytest.mark.parametrize("flags", [(), ("--temperature", "1.0", "--seed", "1"), ("--reference-step",),
                                   ("--temperature", "0.8", "--top-p", "0.9", "--reference-step", "--json")],
                         ids=["greedy", "sampled", "greedy-reference", "sampled-reference-json"])
def test_a_nan_weight_is_an_error_not_tokens(capsys, nan_model, flags):
    code, out, err = run(capsys, "generate", str(nan_model), "--prompt", "hello", "--max-tokens", "8", *flags)
    assert_one_line_error(code, err, "request 0: NaN or infinite logits at prefill",
                          "decoder layer 2 (model.layers.2.self_attn.o_proj)")
    assert out.strip() in ("", "hello")  # the echoed prompt at most: not one generated token


def test_an_infinite_weight_is_an_error_too(capsys, tiny_k3_dir, copy_model):
    model = copy_model(tiny_k3_dir)
    set_weight(model, "language_model.model.layers.0.mlp.down_proj.weight", (3, 5), float("inf"))
    code, _, err = run(capsys, "generate", str(model), "--prompt", "hello", "--max-tokens", "4",
                       "--temperature", "0.7", "--seed", "2")
    assert_one_line_error(code, err, "NaN or infinite logits at prefill", "decoder layer 0 (model.layers.0.mlp")


# -- flags -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("flags, fragment", [
    (("--temperature", "nan"), "temperature must be a finite number, got nan"),
    (("--temperature", "inf"), "temperature must be a finite number, got inf"),
    (("--temperature=-inf",), "temperature must be a finite number, got -inf"),
    (("--temperature", "-0.5"), "temperature must be >= 0, got -0.5"),
    (("--temperature", "1e-40"), "temperature must be 0 (greedy) or at least 1.18e-38"),
    (("--top-p", "0"), "top_p must be in (0, 1], got 0.0"),
    (("--top-p", "1.5"), "top_p must be in (0, 1], got 1.5"),
    (("--top-p", "nan"), "top_p must be in (0, 1], got nan"),
    (("--top-p", "-0.1"), "top_p must be in (0, 1], got -0.1"),
    (("--top-k", "-1"), "top_k must be >= 0, got -1"),
    (("--max-tokens", "0"), "--max-tokens must be at least 1, got 0"),
    (("--max-tokens", "-3"), "--max-tokens must be at least 1, got -3"),
    (("--max-tokens", str(10**30)), f"+ max_tokens {10**30} exceeds the limit of 1048576"),
    (("--seed", str(1 << 64)), f"seed must be an integer in [-2**63, 2**64), got {1 << 64}"),
])
def test_bad_sampling_flags(capsys, tiny_k3_dir, flags, fragment):
    code, out, err = run(capsys, "generate", str(tiny_k3_dir), "--prompt", "hi", *flags)
    assert_one_line_error(code, err, fragment)


def test_a_tiny_temperature_is_near_greedy_not_a_crash(capsys, tiny_k3_dir):
    argv = ("generate", str(tiny_k3_dir), "--prompt", "hi", "--max-tokens", "5", "--ignore-eos", "--json")
    code, greedy, _ = run(capsys, *argv)
    code2, tiny, err = run(capsys, *argv, "--temperature", "1e-37", "--seed", "1")
    assert code == code2 == 0, err
    assert json.loads(tiny)["tokens"] == json.loads(greedy)["tokens"]


@pytest.mark.parametrize("chat", [False, True], ids=["plain", "chat"])
def test_a_prompt_that_is_not_utf8(capsys, tiny_k3_dir, chat):
    prompt = b"caf\xe9 \xff".decode("utf-8", "surrogateescape")  # what Python makes of such argv bytes
    code, out, err = run(capsys, "generate", str(tiny_k3_dir), "--prompt", prompt, *(("--chat",) if chat else ()))
    assert_one_line_error(code, err, "--prompt is not valid UTF-8 (byte e9 at character 3)")
    assert out == ""


@pytest.mark.parametrize("device, fragment", [
    ("meta", "--device 'meta': moeswap runs on cpu or cuda devices, not meta"),
    ("xpu", "--device 'xpu': moeswap runs on cpu or cuda devices, not xpu"),
    ("cuda:99", "--device 'cuda:99': " + ("this machine has" if torch.cuda.is_available()
                                          else "no CUDA device is available here")),
])
def test_devices_it_cannot_run_on(capsys, tiny_k3_dir, device, fragment):
    code, out, err = run(capsys, "generate", str(tiny_k3_dir), "--prompt", "hi", "--device", device)
    assert_one_line_error(code, err, fragment)
    assert out == ""


def test_a_broken_pipe_in_any_command_exits_1_quietly(capsys, monkeypatch, tiny_k3_dir):
    def closed(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(inspect_command, "run", closed)
    code, out, err = run(capsys, "inspect", str(tiny_k3_dir))
    assert (code, out, err) == (1, "", "")


# -- as a process ----------------------------------------------------------------------------------


def moeswap_argv(*argv) -> list:
    return [sys.executable, "-m", "moeswap", *argv]


ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
def test_process_non_utf8_argv(tiny_k3_dir):
    res = subprocess.run(moeswap_argv("generate", str(tiny_k3_dir), "--prompt", b"\xff\xfeab"),
                         capture_output=True, timeout=120, env=ENV)
    assert res.returncode == 2 and res.stdout == b""
    assert res.stderr.decode().splitlines() == [
        "moeswap: error: --prompt is not valid UTF-8 (bytes ff fe at character 0): pass UTF-8 text"]


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(__import__("fcntl"), "F_SETPIPE_SZ"), reason="needs Linux pipe sizes")
def test_process_reader_closing_the_pipe_after_5_bytes(tiny_k3_dir):
    """`moeswap generate ... | head -c 5`: the pipe holds 4 KiB and the prompt alone is longer, so the
    writer is still writing when the reader leaves; it stops without a word, exit code 1."""
    import fcntl

    prompt = "the quick brown fox " * 300  # 6000 bytes
    r, w = os.pipe()
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 4096)
    proc = subprocess.Popen(moeswap_argv("generate", str(tiny_k3_dir), "--prompt", prompt, "--max-tokens", "200",
                                         "--ignore-eos"), stdout=w, stderr=subprocess.PIPE, env=ENV)
    os.close(w)
    head = b""
    while len(head) < 5:  # unbuffered: a buffered reader would drain more than 5 bytes
        chunk = os.read(r, 5 - len(head))
        assert chunk, "the pipe closed before 5 bytes"
        head += chunk
    os.close(r)
    assert head == prompt[:5].encode()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and err == b""
