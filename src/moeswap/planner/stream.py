"""Predict a decode run that streams routed experts from a drive on one CPU (`bench stream`).

Given a model (a config: a real-shape K3 slice, say), the RAM the run may use, the drive's measured read
rate and the CPU's facts, `predict_stream` plans the run as a `--box` machine (box.py) with `--spill nvme`
at batch 1 and returns the planner's decode time split the way a streaming run spends it:

    s/token = dense part  (dense trunk bytes / memory bandwidth, attention, norms, per-op time)
            + expert compute  (the touched experts' bytes / memory bandwidth and their fixed times)
            + missed expert bytes per token / drive rate

The three add up: a layer's misses are known only once its router has run (docs/planner.md, "Experts on
the drive"). Under flat routing (K3's router is trained for it) the hit rate is the fraction of each
layer's experts the RAM left over caches. Knows nothing of the bench; the bench calls it and compares.
Entry point: `predict_stream`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from moeswap.config import ModelConfig

from .box import Box, add_box
from .errors import PlanError
from .hardware import Catalog, builtin_catalog
from .memory import expert_bytes
from .plan import PlanRequest, plan
from .workload import Offload, Precision, Serve

EXPERT_PARTS = ("experts", "swap", "host")  # decode-cost categories that are expert compute
DRIVE_PARTS = ("drive",)


@dataclass(frozen=True)
class CpuFacts:
    """What the prediction needs of the CPU: its cores, and (measured, ideally) its DRAM bandwidth and bf16
    matmul rate; missing rates are box.py's per-core assumptions. `engine`: the catalog's engine profile
    (moeswap-cpu, or `local` where `--hardware local` measured this machine into the catalog passed)."""

    cores: int
    mem_bw_gbs: float | None = None
    bf16_tflops: float | None = None
    engine: str = "moeswap-cpu"

    @classmethod
    def measured(cls, catalog: Catalog, cores: int | None = None) -> "CpuFacts":
        """This machine's facts from a catalog holding `--hardware local`'s measurement (local.load_or_measure)."""
        if "local" not in catalog.entries["system"]:
            raise PlanError("no 'local' measurement in this catalog: run local.load_or_measure(catalog) first")
        accel = catalog.get("accelerator", catalog.get("system", "local").accelerator)
        return cls(cores or os.cpu_count() or 1, accel.mem_bw_gbs, accel.bf16_tflops, "local")


@dataclass(frozen=True)
class StreamPrediction:
    s_per_token: float  # one decode step at batch 1
    dense_s: float  # dense trunk and everything else that is not routed experts
    expert_compute_s: float  # touched experts run from RAM, their per-expert and per-row times
    drive_s: float  # missed experts read from the drive
    missed_bytes_per_token: float
    hit_rate: float  # fraction of touched experts already in RAM
    expert_cache_bytes: float  # routed-expert bytes RAM holds (moeswap's --expert-memory for the run)
    expert_bytes_total: float
    drive_gbps: float
    parts: dict[str, float]  # the planner's decode-step seconds by category

    @property
    def tok_s(self) -> float:
        return 1.0 / self.s_per_token


def predict_stream(model: str | ModelConfig, memory_limit: float, drive_gbps: float, cpu: CpuFacts, *,
                   catalog: Catalog | None = None, expert_memory: float | None = None, dense: str = "bf16",
                   prompt_tokens: int = 64, tokens: int = 32) -> StreamPrediction:
    """Decode seconds per token of `model` at batch 1 on a CPU with `memory_limit` bytes of RAM (the dense
    trunk, caches and the engine's reserve come off it; the rest caches experts) and a drive read at
    `drive_gbps` GB/s (measured: used as is). `expert_memory`: the run's expert cache in bytes, where the
    run sets it (moeswap's --expert-memory) rather than leaving it what RAM has left; it must fit."""
    if not drive_gbps > 0:
        raise PlanError(f"drive_gbps {drive_gbps}: expected a positive measured read rate")
    cat = catalog or builtin_catalog()
    ram = memory_limit
    if expert_memory is not None:
        # the run sets its expert cache and lives within the limit as measured (bench stream's cgroup): the plan
        # is not charged the engine profile's reserve (sized for a server) on top of it
        eng = cat.get("engine", cpu.engine)
        ram = (memory_limit + eng.reserve_gb * 1e9) / (1 - eng.reserve_fraction)
    box = Box(cores=cpu.cores, ram_gb=ram / 1e9, drive_gbs=drive_gbps, mem_bw_gbs=cpu.mem_bw_gbs,
              bf16_tflops=cpu.bf16_tflops, drive_measured=True, origin="predict_stream")
    hw = add_box(cat, box, cpu.engine)
    req = PlanRequest(model=model, hardware=hw, devices=1, layout="tp1",
                      serve=Serve(isl=prompt_tokens, osl=tokens, concurrency=(1,)),
                      precision=Precision(dense=dense), offload=Offload(spill="nvme"))
    result = plan(req, cat)
    cand = result.best
    mem = cand.memory[0]
    hit = cand.hit_rate
    if expert_memory is not None:
        if expert_memory > mem.expert_resident + 1.0:
            raise PlanError(f"expert_memory {expert_memory / 1e9:.2f} GB does not fit: {memory_limit / 1e9:.2f} GB "
                            f"of RAM leaves {mem.expert_resident / 1e9:.2f} GB for experts")
        hit = min(1.0, expert_memory / mem.expert_need) if mem.expert_need else 1.0
        result = plan(PlanRequest(**{**req.__dict__, "offload": Offload(spill="nvme", hit_rate=hit)}), cat)
        cand = result.best
    cached = mem.expert_need * hit
    point, parts = cand.points[0], dict(cand.decode_cost.parts if cand.decode_cost else {})
    cfg, mp = result.cfg, result.params
    moe_layers = sum(1 for lp in mp.layers if lp.num_experts)
    missed = moe_layers * cfg.moe.top_k * (1 - hit) * expert_bytes(mp, result.request.precision)
    experts = sum(parts.get(k, 0.0) for k in EXPERT_PARTS)
    drive = sum(parts.get(k, 0.0) for k in DRIVE_PARTS)
    return StreamPrediction(
        s_per_token=point.step, dense_s=point.step - experts - drive, expert_compute_s=experts, drive_s=drive,
        missed_bytes_per_token=missed, hit_rate=hit, expert_cache_bytes=cached, expert_bytes_total=mem.expert_need,
        drive_gbps=drive_gbps, parts=parts)
