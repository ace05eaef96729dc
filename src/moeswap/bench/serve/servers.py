"""The servers `bench serve` measures: a launched process (its log, /health, SIGINT), its RSS sampled from
/proc, and the `Target` the client talks to. Knows no request or statistic. Entry points: `spawn`, `ready`.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from moeswap.options import LoadOptions
from moeswap.procfs import rss_bytes

MIB = 1 << 20


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RssSampler:
    """A server process's resident memory, read from /proc every `interval` seconds in a thread of its own
    (so the event loop's load never delays a reading), with named marks (loaded, after warm-up, end)."""

    def __init__(self, pid: int, interval: float = 0.25):
        self.pid, self.interval = pid, interval
        self.t0 = time.perf_counter()
        self.samples: list[tuple[float, int]] = []
        self.marks: dict[str, tuple[float, int | None]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"rss-{pid}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.read()
            self._stop.wait(self.interval)

    def read(self) -> int | None:
        rss = rss_bytes(self.pid)
        if rss is not None:
            self.samples.append((time.perf_counter() - self.t0, rss))
        return rss

    def mark(self, label: str) -> None:
        self.marks[label] = (time.perf_counter() - self.t0, self.read())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def report(self) -> dict:
        """Bytes at each mark, the peak after warm-up (from its mark on), the growth from warm-up to the end,
        and the samples (seconds since sampling began, MiB; at most ~300 of them)."""
        at = {k: v[1] for k, v in self.marks.items()}
        warm_t = self.marks["after_warmup"][0] if "after_warmup" in self.marks else 0.0
        after = [r for t, r in self.samples if t >= warm_t]
        warm, end = at.get("after_warmup"), at.get("end")
        step = max(1, -(-len(self.samples) // 300))
        return {"pid": self.pid, **{f"{k}_bytes": v for k, v in at.items()},
                "peak_after_warmup_bytes": max(after, default=None),
                "peak_bytes": max((r for _, r in self.samples), default=None),
                "growth_after_warmup_bytes": end - warm if end is not None and warm is not None else None,
                "samples_mib": [[round(t, 2), round(r / MIB, 1)] for t, r in self.samples[::step]]}


class ServerProcess:
    """A server the benchmark started: its output goes to a temporary file (a chatty server never blocks on
    a pipe), whose tail is the error when it fails to start."""

    def __init__(self, name: str, argv: list[str], env: dict, url: str):
        self.name, self.argv, self.url = name, argv, url
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env)

    def log_tail(self, chars: int = 2000) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-chars:].strip()

    def wait_ready(self, timeout_s: float) -> None:
        """Until GET /health answers 200 (llama-server answers 503 while it loads)."""
        import httpx

        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode} while starting: "
                                   f"{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not answer /health within {timeout_s:.0f} s: {self.log_tail()}")
            time.sleep(0.2)

    def stop(self) -> None:
        """Ctrl-C (both servers shut down cleanly on SIGINT), then SIGKILL after 30 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self.log.closed:
            self.log.close()


@dataclass
class Target:
    name: str
    kind: str  # "moeswap" | "llama-server" | "server" (a --url of another kind)
    url: str
    process: ServerProcess | None = None
    rss: RssSampler | None = None
    model: str | None = None  # the `model` requests name (from /v1/models)
    token_prompts: bool = True
    about: dict = field(default_factory=dict)  # how it runs: command, version, prompts

    @property
    def moeswap(self) -> bool:
        return self.kind == "moeswap"


def moeswap_argv(model: str, port: int, max_batch: int, max_queue: int, load: LoadOptions) -> list[str]:
    return [sys.executable, "-m", "moeswap", "serve", model, "--host", "127.0.0.1", "--port", str(port),
            "--max-batch", str(max_batch), "--max-queue", str(max_queue), "--log-level", "warning", *load.to_argv()]


def spawn(name: str, kind: str, argv: Callable[[int], list[str]], env: dict) -> Target:
    """Start a server on a free loopback port (`argv(port)`); `ready` waits for it."""
    port = free_port()
    argv = argv(port)
    url = f"http://127.0.0.1:{port}"
    shown = [Path(a).name if i == 0 else a for i, a in enumerate(argv)]
    return Target(name, kind, url, ServerProcess(name, argv, env, url), about={"command": " ".join(shown)})


def ready(target: Target, timeout_s: float) -> None:
    """Wait until it serves, then sample its RSS from then on."""
    target.process.wait_ready(timeout_s)
    target.rss = RssSampler(target.process.proc.pid)
    target.rss.mark("loaded")
