"""`moeswap bench stream`: refused in one line where the experts would fit in the page cache; the read counter
it compares engines by counts what a process read from the drive; a run under a memory cgroup reports the
tokens the engine decodes alone, within the limit, and writes strict JSON, markdown and a plot.

The cgroup run needs a memory controller this process may make a child cgroup in and a page cache it may drop
(root): elsewhere it is skipped with the reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from moeswap.bench import sidebyside as sbs
from moeswap.bench import stream
from moeswap.bench.memlimit import MemoryLimitError, drop_caches, memory_cgroup


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moeswap", *args], capture_output=True, text=True, timeout=300)


def test_experts_under_the_ratio_are_refused_in_one_line(tiny_k3_dir):
    by = stream.model_bytes(str(tiny_k3_dir))
    limit = int(by["all_expert_bytes"] / 2)  # the experts are 2x the limit: they would sit in the page cache
    got = run_cli("bench", "stream", str(tiny_k3_dir), "--memory-limit", str(limit), "--peers", "")
    assert got.returncode == 2, got.stderr
    assert got.stderr.count("\n") == 1 and "needs >= 4x" in got.stderr and "2.00x" in got.stderr


@pytest.mark.parametrize("flags, says", [
    (("--memory-limit", "lots"), "'lots' is not a size"),
    (("--prompt-tokens", "0"), "--prompt-tokens and --tokens must be >= 1"),
    (("--tokens", "0"), "--prompt-tokens and --tokens must be >= 1"),
])
def test_bad_flags_are_one_line_errors(tiny_k3_dir, flags, says):
    got = run_cli("bench", "stream", str(tiny_k3_dir), "--peers", "", *flags)
    assert got.returncode == 2 and got.stderr.count("\n") == 1 and says in got.stderr, got.stderr


def test_read_bytes_counts_what_a_process_read_from_the_drive(tmp_path):
    path = tmp_path / "data"
    size = 8 << 20
    with open(path, "wb") as f:
        f.write(os.urandom(size))
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    child = ("import os, sys\nfrom moeswap.bench.stream import read_bytes\nb0 = read_bytes(os.getpid())\n"
             f"data = open({str(path)!r}, 'rb').read()\nprint(read_bytes(os.getpid()) - b0, len(data))")
    got = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True)
    read, length = map(int, got.stdout.split())
    if read == 0:
        pytest.skip(f"{tmp_path} is not on a block device (tmpfs): nothing is read from a drive")
    assert length == size
    assert size <= read < size + (1 << 20)  # the file, and at most readahead's rounding past it


@pytest.fixture(scope="module")
def limits():
    try:
        with memory_cgroup(1 << 30):
            pass
        drop_caches()
    except MemoryLimitError as err:
        pytest.skip(str(err))


def test_a_confined_run_decodes_what_the_engine_decodes_alone(limits, tiny_k3_dir, tmp_path):
    """The tiny model under a 1 GiB limit (--min-ratio 0: its experts are small): moeswap's decoded tokens
    are those of the engine run on the same prompt outside any cgroup, the cgroup's high-water mark is within
    the limit, and the report is strict JSON whose numbers follow from each other."""
    limit = 1 << 30
    got = run_cli("bench", "stream", str(tiny_k3_dir), "--memory-limit", str(limit), "--min-ratio", "0",
                  "--peers", "", "--prompt-tokens", "16", "--tokens", "4", "--out-dir", str(tmp_path))
    assert got.returncode == 0, got.stderr[-2000:]
    [report_path] = tmp_path.glob("stream-*.json")
    report = json.loads(report_path.read_text(), parse_constant=lambda c: pytest.fail(f"non-strict JSON: {c}"))
    assert list(tmp_path.glob("stream-*.md")) and list(tmp_path.glob("stream-*.png"))
    m = report["engines"]["moeswap"]
    assert m["peak_bytes"] is None or m["peak_bytes"] <= limit
    assert m["oom_kills"] in (0, -1)
    assert m["decode_s_per_token"] == pytest.approx(m["decode_s"] / m["decode_tokens"])
    assert m["decode_read_bytes_per_token"] == pytest.approx(m["decode_read_bytes"] / m["decode_tokens"])

    # the oracle: the same request in this process's engine, greedy
    from moeswap.config import load_config
    from moeswap.engine.scheduler import EngineConfig, Request, Scheduler
    from moeswap.models.loader import load_model

    short = sbs.random_prompts(1, 4, load_config(str(tiny_k3_dir)).vocab_size, seed=2)[0][::-1]
    model, _ = load_model(str(tiny_k3_dir))
    [alone] = Scheduler(model, EngineConfig(max_batch=1, max_len=64)).run([Request(short, 5, id=0)])
    assert m["tokens"] == alone.tokens
