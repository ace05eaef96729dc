"""Serving schedule model: TTFT, TPOT and tokens/s per device from per-stage step times.

Assumes what current engines do by default: prefill has priority over decode, prompts go through
in chunks, decode runs every admitted sequence each step. Two arrival patterns: "burst" (a
benchmark's wave of `concurrency` requests arriving together, waves staying in lock-step because
all have the same lengths) and "steady" (staggered arrivals, M/D/1 queueing for prefill).
Knows nothing of hardware: it takes step-time functions. Entry point: `serve_point`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from .workload import Serve


@dataclass
class ServePoint:
    concurrency: int
    ttft: float  # mean seconds to first token
    tpot: float  # mean seconds per output token after the first, as benchmarks report it
    step: float  # one decode iteration of the full batch, no prefill interruptions
    tok_s_device: float  # (input + output) tokens/s per device, the usual "per GPU" figure
    out_tok_s_device: float
    out_tok_s: float  # output tokens/s over the whole deployment
    prefill_tok_s_device: float  # prefill tokens/s per device with the pipeline full
    saturated: bool = False  # steady arrivals: prefill alone would take all the time
    fits: bool = True
    note: str = ""


def pipeline_time(stage_times: list[float], micro_batches: int, p2p: float = 0.0) -> float:
    """One pass of `micro_batches` micro-batches through the stages (latency or bottleneck bound)."""
    latency = sum(stage_times) + p2p * (len(stage_times) - 1)
    return max(latency, micro_batches * max(stage_times))


def serve_point(serve: Serve, concurrency: int, replicas: int, devices: int,
                decode_step: Callable[[float], float],
                prefill_chunk: Callable[[float, float, int], tuple[float, float]],
                chunk: int, lanes: int = 1) -> ServePoint:
    """decode_step(seqs per replica) -> seconds per decode iteration;
    prefill_chunk(tokens per lane, requests ending in a lane's chunk, busy lanes) -> (latency through all
    stages, bottleneck stage). `lanes`: attention-DP ranks, each prefilling its own requests."""
    active = min(replicas, concurrency)
    c = max(1, round(concurrency / active))
    isl, osl = serve.isl, serve.osl
    busy = min(lanes, c)
    per_lane = math.ceil(c / busy)
    c_tok = min(chunk, per_lane * isl)
    latency, bottleneck = prefill_chunk(c_tok, max(1.0, c_tok / isl), busy)
    per_dev_prefill = c_tok * busy / bottleneck / (devices / replicas)
    step = decode_step(c)
    if serve.arrival == "burst":
        # requests go round-robin to lanes; the j-th request of a lane waits for the chunks before it
        ttfts = [latency + (math.ceil(math.ceil(k / busy) * isl / c_tok) - 1) * bottleneck for k in range(1, c + 1)]
        e2e = ttfts[-1] + (osl - 1) * step
        ttft = sum(ttfts) / c
        tpot = sum((e2e - t) for t in ttfts) / c / (osl - 1) if osl > 1 else 0.0
        saturated = False
    else:
        per_req = bottleneck * isl / c_tok / busy
        ttft, tpot, e2e, saturated = _steady(c, per_req, latency, step, osl)
    tokens = active * c
    return ServePoint(
        concurrency=concurrency, ttft=ttft, tpot=tpot, step=step,
        tok_s_device=tokens * (isl + osl) / e2e / devices,
        out_tok_s_device=tokens * osl / e2e / devices,
        out_tok_s=tokens * osl / e2e,
        prefill_tok_s_device=per_dev_prefill,
        saturated=saturated,
    )


def _steady(c: int, per_req: float, first: float, step: float, osl: int) -> tuple[float, float, float, bool]:
    """Fixed point of: prefill load rho = c * per_req / e2e; decode slows by 1/(1-rho); M/D/1 wait."""
    e2e = first + osl * step
    for _ in range(100):
        rho = c * per_req / e2e
        if rho >= 0.999:
            return float("inf"), float("inf"), float("inf"), True
        tpot = step / (1 - rho)
        ttft = max(first, per_req) + rho * per_req / (2 * (1 - rho)) + step / 2
        new = ttft + (osl - 1) * tpot
        if abs(new - e2e) < 1e-9 * e2e:
            break
        e2e = new
    return ttft, tpot, e2e, False
