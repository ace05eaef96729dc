"""Every command that writes, pointed at a read-only file system or at one that fills up, ends with one line
`moeswap: error: ...` naming the file and exit 2, and leaves no file behind. The file systems are real: a
tmpfs mounted read-only, or with a few KiB, in a private mount namespace (`unshare -rm`; skipped where the
kernel gives none), so the libraries' own writes (safetensors, torch.save) meet the real errors."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moeswap import cli
from moeswap.lora import LoRAConfig, attach_lora, save_adapter
from moeswap.models.loader import load_model

pytestmark = pytest.mark.slow


def _namespaces() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0


if not _namespaces():
    pytest.skip("no private mount namespace here (unshare -rm)", allow_module_level=True)


def run_on(tmp_path: Path, options: str, argv: list[str], full: bool = False) -> tuple[int, str, list[str]]:
    """(exit code, stderr, files left) of `moeswap ARGV` with tmp_path/mnt a fresh tmpfs mounted `options`
    (full: filled to the last byte by a file that is removed after the command); MNT in ARGV stands for its
    path."""
    mnt = tmp_path / "mnt"
    mnt.mkdir(exist_ok=True)
    left = tmp_path / "left.txt"
    argv = [a.replace("MNT", str(mnt)) for a in argv]
    fill, unfill = (f'cat /dev/zero > "{mnt}/.fill" 2>/dev/null; ', f'rm "{mnt}/.fill"; ') if full else ("", "")
    script = (f'mount -t tmpfs -o {options} tmpfs "{mnt}" || exit 99; {fill}"$@"; code=$?; {unfill}'
              f'find "{mnt}" -type f > "{left}"; exit $code')
    done = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", sys.executable, "-m", "moeswap", *argv],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 99, done.stderr
    return done.returncode, done.stderr, left.read_text().split()


@pytest.fixture(scope="module")
def inputs(tiny_k3_dir, tiny_linear_dir, tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("inputs")
    (d / "prompts.txt").write_text("def add(a, b):\n")
    assert cli.main(["trace", str(tiny_k3_dir), "--prompts", str(d / "prompts.txt"), "-o", str(d / "t.bin"),
                     "--max-tokens", "2"]) == 0
    model, _ = load_model(tiny_k3_dir)
    attach_lora(model, LoRAConfig(r=2, alpha=4, target_modules=("q_proj",)), generator=torch.Generator().manual_seed(0))
    save_adapter(model, d / "adapter")
    (d / "data.jsonl").write_text("".join(f'{{"text": "def f{i}(x):\\n    return x + {i}\\n"}}\n' for i in range(8)))
    return {"k3": str(tiny_k3_dir), "linear": str(tiny_linear_dir), "prompts": str(d / "prompts.txt"),
            "trace": str(d / "t.bin"), "adapter": str(d / "adapter"), "data": str(d / "data.jsonl")}


COMMANDS = {
    "init-tiny": ["init-tiny", "MNT/out"],
    "quantize": ["quantize", "{linear}", "MNT/out", "--experts", "mxfp4"],
    "trace": ["trace", "{k3}", "--prompts", "{prompts}", "-o", "MNT/t.bin", "--max-tokens", "2"],
    "merge": ["merge", "{k3}", "{adapter}", "MNT/out"],
    "train": ["train", "--model", "{k3}", "--train-data", "{data}", "--output", "MNT/out", "--max-steps", "2",
              "--save-interval", "1", "--seq-len", "32", "--no-progress"],
    "bench cache": ["bench", "cache", "--trace", "{trace}", "--out-dir", "MNT/results"],
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_read_only_place_is_one_line_and_exit_2(tmp_path, inputs, command):
    code, err, left = run_on(tmp_path, "ro", [a.format(**inputs) for a in COMMANDS[command]])
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("moeswap: error: "), err[-3000:]
    assert "read-only" in lines[0].lower() and str(tmp_path / "mnt") in lines[0], lines[0]


@pytest.mark.parametrize("command", ["init-tiny", "quantize", "merge", "train"])
def test_a_disk_that_fills_up_is_one_line_and_leaves_no_file(tmp_path, inputs, command):
    code, err, left = run_on(tmp_path, "size=96k", [a.format(**inputs) for a in COMMANDS[command]])
    lines = err.strip().splitlines()
    assert code == 2 and lines and lines[-1].startswith("moeswap: error: "), err[-3000:]
    assert "no space left on device" in lines[-1].lower(), lines[-1]
    assert left == [], left


@pytest.mark.parametrize("command", ["trace", "bench cache"])
def test_a_disk_already_full_is_one_line_and_leaves_no_file(tmp_path, inputs, command):
    """The commands whose output is too small to fill even a few KiB: the disk is full before they start."""
    code, err, left = run_on(tmp_path, "size=96k", [a.format(**inputs) for a in COMMANDS[command]], full=True)
    lines = err.strip().splitlines()
    assert code == 2 and lines and lines[-1].startswith("moeswap: error: "), err[-3000:]
    assert "no space left on device" in lines[-1].lower(), lines[-1]
    assert left == [], left
