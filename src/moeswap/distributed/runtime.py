"""Joining a torch.distributed job for expert parallelism: the process group from torchrun's environment
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; gloo on CPUs, NCCL on CUDA), a start-up check that every rank
runs the same checkpoint, config, math options, placement and moeswap, and a heartbeat through the
rendezvous store that names the rank that died when a collective fails.

Knows nothing of the MoE math (distributed/ep.py). Entry points: `launched()`, `init_expert_parallel(...)`.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import moeswap
from moeswap import jsonio
from moeswap.distributed.cli import DEFAULT_TIMEOUT_S
from moeswap.distributed.ep import ExpertParallel, apply_expert_parallel
from moeswap.distributed.placement import make_placement
from moeswap.options import LoadOptions

BEAT_S = 0.5  # heartbeat period: a rank whose counter stops for several periods is taken for dead
MATH_OPTIONS = ("dtype", "dense_weights", "expert_activations", "gemm_precision")  # change results' bits


def launched() -> bool:
    """Whether this process is one of several started by torchrun (or the same environment variables)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


def backend_for(device: str) -> str:
    """gloo for CPU tensors, NCCL for CUDA ones (other backends, e.g. HCCL, need their torch plug-in and
    MOESWAP_DIST_BACKEND)."""
    return os.environ.get("MOESWAP_DIST_BACKEND") or ("nccl" if torch.device(device).type == "cuda" else "gloo")


def source_digest() -> str:
    """SHA-256 over moeswap's own source files (Python and C): ranks running different code are refused
    even when they carry the same version number."""
    root = Path(moeswap.__file__).parent
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".c", ".h") and p.is_file()):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def fingerprint(model_dir: str | os.PathLike, options: LoadOptions, placement) -> dict:
    """What must be equal on every rank for their results to be the same bits."""
    from moeswap.lora.fingerprint import fingerprint as base_fingerprint

    base = base_fingerprint(model_dir)
    return {
        "moeswap version": moeswap.__version__, "moeswap source": source_digest(), "torch version": torch.__version__,
        "config.json": base["config_sha256"], "checkpoint": base["digest"],
        "options": {k: getattr(options, k) for k in MATH_OPTIONS},
        "placement": hashlib.sha256(jsonio.dumps(placement.describe(), sort_keys=True).encode()).hexdigest(),
    }


def check_same(fingerprints: list[dict], model_dirs: list[str]) -> None:
    """ValueError naming every rank whose fingerprint differs from rank 0's, and in what."""
    ref = fingerprints[0]
    problems = []
    for r, fp in enumerate(fingerprints[1:], start=1):
        differs = [k for k in ref if fp.get(k) != ref[k]]
        if differs:
            problems.append(f"rank {r} ({model_dirs[r]}) differs from rank 0 ({model_dirs[0]}) in "
                            + ", ".join(differs))
    if problems:
        raise ValueError("expert-parallel ranks must run the same model, options and moeswap: "
                         + "; ".join(problems))


class Heartbeat:
    """Each rank adds to its counter in the rendezvous store every BEAT_S, and publishes how many exchanges
    it has entered; after a failed collective, `diagnose` watches the counters for a few periods and names
    the ranks whose counter stood still (dead), else those alive but behind this one (stuck or slow), or,
    when the store itself is gone, the rank that hosts it."""

    def __init__(self, store, rank: int, world: int, store_host_rank: int | None, progress=lambda: 0):
        self.store, self.rank, self.world, self.host = store, rank, world, store_host_rank
        self.progress = progress
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="moeswap-ep-heartbeat", daemon=True)
        self._thread.start()

    def _key(self, r: int) -> str:
        return f"moeswap/ep/beat/{r}"

    def _beat(self) -> None:
        while not self._stop.is_set():
            try:
                self.store.add(self._key(self.rank), 1)
                self.store.set(f"moeswap/ep/progress/{self.rank}", str(self.progress()))
            except Exception:  # the store is gone: diagnose says so; nothing to do here
                return
            self._stop.wait(BEAT_S)

    def diagnose(self) -> str:
        try:
            before = [self.store.add(self._key(r), 0) for r in range(self.world)]
            time.sleep(6 * BEAT_S)
            after = [self.store.add(self._key(r), 0) for r in range(self.world)]
            mine = self.progress()
            reached = {r: int(self.store.get(f"moeswap/ep/progress/{r}")) for r in range(self.world)
                       if r != self.rank and after[r] != before[r]}
        except Exception:
            if self.host is not None and self.host != self.rank:
                return f"rank {self.host} is gone (it hosted the rendezvous store, which no longer answers)"
            return "the rendezvous store no longer answers (the torchrun agent or host that ran it is gone)"
        dead = [r for r in range(self.world) if r != self.rank and after[r] == before[r]]
        if dead:
            return ", ".join(f"rank {r}" for r in dead) + (" has" if len(dead) == 1 else " have") + " stopped"
        behind = [r for r, n in reached.items() if n < mine]
        if behind:
            verb = "is" if len(behind) == 1 else "are"
            return (", ".join(f"rank {r} (at exchange {reached[r]})" for r in behind)
                    + f" {verb} alive but never reached this rank's exchange {mine}: stuck or too slow")
        return "every rank's heartbeat is still running and each reached this exchange (the network failed?)"

    def close(self) -> None:
        self._stop.set()


def init_expert_parallel(model, model_dir: str | os.PathLike, options: LoadOptions, trace_path: str | None = None,
                         timeout_s: float = DEFAULT_TIMEOUT_S, data_parallel: bool = False) -> ExpertParallel:
    """Joins the job described by the environment (torchrun's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT),
    refuses ranks that differ (ValueError on every rank), applies expert parallelism to `model` (with token
    dispatch when `data_parallel`: each rank runs its own sequences) and starts the heartbeat. Collectives
    that wait more than `timeout_s` fail."""
    if not dist.is_initialized():
        dist.init_process_group(backend_for(options.device), init_method="env://",
                                timeout=timedelta(seconds=timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    placement = make_placement(model.config, world, trace_path)
    mine = fingerprint(model_dir, options, placement)
    everyone: list = [None] * world
    mine["mode"] = "data-parallel" if data_parallel else "replicated"
    dist.all_gather_object(everyone, {"fingerprint": mine, "model": str(model_dir)})
    check_same([e["fingerprint"] for e in everyone], [e["model"] for e in everyone])
    ep = apply_expert_parallel(model, None, placement, data_parallel)
    store = dist.distributed_c10d._get_default_store()  # the rendezvous store (no public accessor)
    # without torchrun's agent, rank 0's process hosts the TCP store (init_method env://)
    host = None if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else 0
    beat = Heartbeat(store, rank, world, host, lambda: ep.entered)
    ep.diagnose, ep.heartbeat = beat.diagnose, beat
    dist.barrier()  # every rank has its heartbeat before anyone computes
    return ep


def check_same_everywhere(ep: ExpertParallel, what: str, value) -> None:
    """ValueError on every rank unless `value` is the same on all of them (naming those that differ)."""
    values: list = [None] * ep.world
    dist.all_gather_object(values, value, group=ep.group)
    differ = [r for r in range(1, ep.world) if values[r] != values[0]]
    if differ:
        raise ValueError(f"expert-parallel ranks must use the same {what}: "
                         + ", ".join(f"rank {r}" for r in differ) + " differ from rank 0")


def shutdown(ep: ExpertParallel | None) -> None:
    """Stops the heartbeat and leaves the process group: after a barrier (so no rank's store goes first)
    unless an exchange already failed (a barrier would wait on the lost rank)."""
    if ep is None:
        return
    ep.heartbeat.close()
    if dist.is_initialized():
        try:
            if ep.failed is None:
                dist.barrier()
        finally:
            dist.destroy_process_group()
