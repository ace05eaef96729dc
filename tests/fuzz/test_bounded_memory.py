"""Hostile inputs that used to exhaust memory or hang, each run as a real `moeswap` process under an
address-space cap (RLIMIT_AS, what `ulimit -v` sets) and a time limit: each must end with one line
`moeswap: error: ...` and exit 2, well inside both. Before their fixes: /dev/zero as prompts grew to 8.5 GB, an
added token id of 10^8 built 5.6 GB of names, `'x' * 300000000` in a chat template aborted the process, a
plan over 10^11 devices ran for minutes, a LoRA rank or a micro-batch of 10^9 failed deep in torch's
allocator."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys

import pytest

from moeswap.tiny.tokenizer import build_tiny_tiktoken

CAP_BYTES = 4 << 30  # a tiny model's commands need ~1 GiB of address space
TIME_S = 120


def run_capped(argv: list[str]) -> subprocess.CompletedProcess:
    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (CAP_BYTES, CAP_BYTES))

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "moeswap", *argv], preexec_fn=cap, capture_output=True, text=True,
                          timeout=TIME_S, env=env)


@pytest.fixture(scope="module")
def hostile(tiny_k3_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hostile")
    far = root / "far_token"  # the tiny K3 with Kimi's tiktoken files, one special token id at 10^8
    shutil.copytree(tiny_k3_dir, far)
    (far / "tokenizer.json").unlink()
    vocab = json.loads((far / "config.json").read_text())["text_config"]["vocab_size"]
    build_tiny_tiktoken(far, vocab)
    cfg = json.loads((far / "tokenizer_config.json").read_text())
    cfg["added_tokens_decoder"]["100000000"] = {"content": "<|far|>", "special": True}
    (far / "tokenizer_config.json").write_text(json.dumps(cfg))
    bomb = root / "template_bomb"
    shutil.copytree(tiny_k3_dir, bomb)
    (bomb / "chat_template.jinja").write_text("{{ 'x' * 300000000 }}")
    data = root / "data.jsonl"
    data.write_text('{"text": "def f(x):\\n    return x\\n"}\n' * 4)
    return {"k3": str(tiny_k3_dir), "far": str(far), "bomb": str(bomb), "data": str(data), "out": str(root / "out")}


CASES = {
    "prompts from /dev/zero": ["trace", "{k3}", "--prompts", "/dev/zero", "-o", "{out}.bin"],
    "a special token id of 10^8": ["generate", "{far}", "--prompt", "hi", "--max-tokens", "1"],
    "a chat template that multiplies a string": ["generate", "{bomb}", "--prompt", "hi", "--chat", "--max-tokens", "1"],
    "a plan over 10^11 devices": ["plan", "--model", "kimi-k3", "--hardware", "h200", "--devices", "99999999999"],
    "a LoRA rank of 10^9": ["train", "--model", "{k3}", "--train-data", "{data}", "--output", "{out}", "--rank",
                            "1000000000", "--no-progress"],
    "a micro-batch of 10^9": ["train", "--model", "{k3}", "--train-data", "{data}", "--output", "{out}",
                              "--micro-batch", "1000000000", "--no-progress"],
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_input_is_refused_within_a_memory_cap(hostile, case):
    done = run_capped([a.format(**hostile) for a in CASES[case]])
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and lines and lines[-1].startswith("moeswap: error: "), done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
