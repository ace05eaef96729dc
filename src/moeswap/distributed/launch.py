"""Starting N ranks on this machine the way torchrun does (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR=127.0.0.1, MASTER_PORT free), for `bench ep` and the tests; each rank is a plain subprocess,
so one that dies does not take the others down (the point of the fault tests). Knows nothing of models.
Entry point: `run_ranks(argv, world, timeout_s, env)`."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from dataclasses import dataclass


def free_port() -> int:
    """A TCP port free on loopback now (the OS picks it; another process could still take it before use)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


@dataclass
class Ranks:
    codes: list[int | None]  # None: killed at the timeout
    outputs: list[str]  # each rank's stdout and stderr together
    elapsed_s: float  # until the last rank exited (or was killed)


def run_ranks(argv: list[str], world: int, timeout_s: float, env: dict[str, str] | None = None) -> Ranks:
    """Runs `argv` as ranks 0..world-1 and waits for all of them; any still running after `timeout_s` is killed."""
    port = free_port()
    base = {**os.environ, **(env or {})}
    t0 = time.monotonic()
    procs = [subprocess.Popen(argv, env={**base, **rank_env(r, world, port)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for r in range(world)]
    codes: list[int | None] = []
    outputs: list[str] = []
    try:
        for p in procs:
            try:
                out, _ = p.communicate(timeout=max(0.1, timeout_s - (time.monotonic() - t0)))
                codes.append(p.returncode)
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
                codes.append(None)
            outputs.append(out.decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return Ranks(codes, outputs, time.monotonic() - t0)
