"""`--hardware local` on a CPU: measures moeswap's own CPU engine, not generic torch ops: the rates of the bf16
dense-linear kernel and the grouped MXFP4 expert call, then, from a tiny model's decode step, the eager ops
per layer kind and the time per op and per routed expert; the planner's roofline adds these up for any model
(docs/planner.md). Entry point: `engine_fields(copy_gbs, bf16_tflops, tag)`; `fit_line` also serves local.py.
"""

from __future__ import annotations

import collections
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MB = 1 << 20
# A pool of weights bigger than the last-level cache, so every call streams from DRAM as decode does.
POOL_BYTES = 64 * MB
# The weight each tiny-model Linear streams besides its own (_Streamer): 2 MB, as in a mid-sized model
# (the bench model's Linears average 2.5 MB); once the caches are evicted, more changes little.
STREAM_SHAPE = (1024, 1024)
STREAM_EXPERT = (1024, 1024)  # and 8 experts of 1.7 MB per MoE block
# Expert shapes [in x width] (0.8 to 6.7 MB in MXFP4; the bench model's are [512 x 1024], K3's
# [3584 x 3072]) chosen so that output rows (2 width + in) and bytes (3 in width) vary apart.
EXPERT_SHAPES = ((128, 256), (2048, 256), (256, 2048), (512, 1024), (1024, 1024), (2048, 2048))
TOP_K = 8
BETAS = (4.0, 25.0)
REPEATS = 10  # best of many short timings: other work on a shared machine comes and goes


def _best_each(fns: list, repeats: int = REPEATS) -> list[float]:
    """Fastest time of each call over `repeats` rounds that take turns, so that other work on the
    machine slows every variant alike and a fit across them stays sound."""
    import time

    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t)
    return best


def bf16_linear_rates() -> tuple[float, float]:
    """`ops.linear.linear(x fp32 [rows, 4096], W bf16 [2048, 4096])` over a pool of weights, rows 1..16.

    Returns (GB/s, GFLOP/s): the best weight-streaming rate (few rows) and the best arithmetic rate
    (many rows). The planner's roofline takes max(bytes / GB/s, FLOPs / FLOP/s) per Linear.
    """
    import torch

    from moeswap.ops.linear import linear

    k, n = 4096, 2048
    pool = [torch.randn(n, k).to(torch.bfloat16) for _ in range(max(2, POOL_BYTES // (2 * n * k)))]
    nbytes = sum(w.numel() * 2 for w in pool)
    rows = (1, 4, 16)
    xs = [torch.randn(r, k) for r in rows]
    times = _best_each([lambda x=x: [linear(x, w) for w in pool] for x in xs])
    gbs = max(nbytes / t / 1e9 for t in times)
    gflops = max(r * nbytes / t / 1e9 for r, t in zip(rows, times))  # 2 FLOPs per 2-byte weight
    return gbs, gflops


def _random_expert(gen, in_dim: int, width: int):
    import torch

    from moeswap.ops.expert import MXFP4ExpertWeights

    def matrix(out_dim: int, cols: int):  # scales near 2^0 keep the values finite, as real experts are
        return (torch.randint(0, 256, (out_dim, cols // 2), dtype=torch.uint8, generator=gen),
                torch.randint(118, 130, (out_dim, cols // 32), dtype=torch.uint8, generator=gen))

    return MXFP4ExpertWeights(*matrix(width, in_dim), *matrix(width, in_dim), *matrix(in_dim, width))


class _MoePool:
    """Grouped calls (TOP_K experts of [in_dim x width], `per_expert` tokens each) over a pool of
    experts bigger than the caches, as a decode step's layers each touch their own."""

    def __init__(self, kernel, in_dim: int, width: int, per_expert: int):
        import torch

        from moeswap.ops import kernel_experts

        gen = torch.Generator().manual_seed(0)
        first = _random_expert(gen, in_dim, width)
        count = max(2 * TOP_K, POOL_BYTES // first.nbytes // TOP_K * TOP_K)
        pool = [first] + [_random_expert(gen, in_dim, width) for _ in range(count - 1)]
        self.groups = [pool[i:i + TOP_K] for i in range(0, count, TOP_K)]
        self.nbytes = TOP_K * first.nbytes  # per call
        self.kernel, self.x = kernel, torch.randn(per_expert, in_dim)
        self.moe = kernel_experts.moe
        self.y = torch.zeros_like(self.x)
        self.tokens = torch.arange(per_expert).repeat(TOP_K)
        self.offsets = [e * per_expert for e in range(TOP_K + 1)]
        self.weights = torch.ones(TOP_K * per_expert)
        self.calls = 0

    def call(self, *_):
        g = self.groups[self.calls % len(self.groups)]
        self.moe(self.kernel, self.x, g, self.tokens, self.offsets, self.weights, "situ", BETAS, self.y)
        self.calls += 1

    def all(self):
        for _ in self.groups:
            self.call()


def _empty_moe_call(kernel):
    """A grouped call with no tokens: the wrapper's and thread pool's fixed time, no expert work."""
    import torch

    from moeswap.ops import kernel_experts

    experts = [_random_expert(torch.Generator().manual_seed(0), 64, 64)] * TOP_K
    x = torch.zeros(1, 64)
    none = torch.zeros(0, dtype=torch.int64)
    return lambda: kernel_experts.moe(kernel, x, experts, none, [0] * (TOP_K + 1), none.float(), "situ", BETAS, x)


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least squares t = t0 + slope * x over (x, seconds) points; t0 is floored at 0."""
    nb = len(points)
    mx = sum(b for b, _ in points) / nb
    my = sum(t for _, t in points) / nb
    slope = sum((b - mx) * (t - my) for b, t in points) / sum((b - mx) ** 2 for b, _ in points)
    return max(0.0, my - slope * mx), slope


def fit_rows_bytes(points: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """Least squares t = rows * a + bytes * b over (rows, bytes, seconds), a >= 0, b > 0 (noise on a
    shared machine can push an unconstrained fit below zero): returns (a, b)."""
    srr = sum(r * r for r, _, _ in points)
    sbb = sum(b * b for _, b, _ in points)
    srb = sum(r * b for r, b, _ in points)
    srt = sum(r * t for r, _, t in points)
    sbt = sum(b * t for _, b, t in points)
    det = srr * sbb - srb * srb
    a, b = ((srt * sbb - sbt * srb) / det, (sbt * srr - srt * srb) / det) if det else (-1.0, 0.0)
    if a >= 0 and b > 0:
        return a, b
    return 0.0, sbt / sbb  # all on the bytes


def mxfp4_moe_rates() -> tuple[float, float, float] | None:
    """The grouped MXFP4 call of one MoE layer step (`kernel_experts.moe`, TOP_K experts).

    Returns (GB/s, ns per output row, GFLOP/s). With one token per expert, the time per expert
    (a call's time less an empty call's, over TOP_K) is fitted over EXPERT_SHAPES as
    rows * ns + bytes / GB/s: small experts pay for their many short rows. The empty call's fixed
    time is an eager op's worth, left to the op count. GFLOP/s is with 16 tokens per expert. None when
    the C kernel cannot be built here (the engine then runs experts one by one: not modelled).
    """
    from moeswap.ops import cpu_kernels

    kernel = cpu_kernels.kernel()
    if kernel is None:
        return None
    i16, w16 = EXPERT_SHAPES[-2]
    pools = [_MoePool(kernel, i, w, 1) for i, w in EXPERT_SHAPES] + [_MoePool(kernel, i16, w16, 16)]
    times = _best_each([_empty_moe_call(kernel)] + [p.all for p in pools])
    empty, per_call = times[0], [t / len(p.groups) for t, p in zip(times[1:], pools)]
    points = [(2 * w + i, p.nbytes / TOP_K, max(0.0, t - empty) / TOP_K)
              for (i, w), t, p in zip(EXPERT_SHAPES, per_call, pools)]
    per_row, per_byte = fit_rows_bytes(points)
    return 1 / per_byte / 1e9, per_row * 1e9, TOP_K * 16 * 2 * 3 * i16 * w16 / per_call[-1] / 1e9


class OpCounter:
    """Counts every aten op dispatched, into the bucket that module hooks say is running."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter.counts[counter.bucket] += 1
                return func(*args, **(kwargs or {}))

        self.mode = Mode()
        self.bucket = "step"
        self.counts: collections.Counter = collections.Counter()

    def hook(self, module, bucket: str, after: str) -> list:
        def enter(*_):
            self.bucket = bucket

        def leave(*_):
            self.bucket = after

        return [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]


def layer_buckets(model) -> list[tuple[Any, str]]:
    """(module, bucket) in forward order: each layer's input norm + attention, then its norm + MLP/MoE."""
    out = []
    for layer in model.model.layers:
        ffn, kind = (layer.mlp, "dense") if hasattr(layer, "mlp") else (layer.block_sparse_moe, "moe")
        out += [(layer.input_layernorm, layer.attn_kind), (layer.self_attn, layer.attn_kind),
                (layer.post_attention_layernorm, kind), (ffn, kind)]
    return out


def count_ops(model, run) -> dict[str, float]:
    """Eager ops per decode step, by bucket: 'kda', 'mla', 'dense', 'moe' (each with its norm), 'layer'
    (residual adds and AttnRes mixes, between sublayers) and 'step' (embedding, final norm, lm_head,
    sampling, scheduler). `run(n)` generates n tokens; the difference of 9 and 1 removes the prefill."""
    run(9)  # warm: a cold expert store's first reads are ops no later step repeats
    c = OpCounter()
    mods = layer_buckets(model)
    handles = []
    for i, (m, bucket) in enumerate(mods):
        handles += c.hook(m, bucket, "step" if i == len(mods) - 1 else "layer")
    try:
        totals = []
        for n in (1, 9):
            c.counts, c.bucket = collections.Counter(), "step"
            with c.mode:
                run(n)
            totals.append(c.counts)
    finally:
        for h in handles:
            h.remove()
    return {k: (totals[1][k] - totals[0][k]) / 8 for k in totals[1]}


def per_layer_counts(model, per_step: Mapping[str, float]) -> dict[str, float]:
    """Engine-profile fields: ops per layer of each kind (kernels_*) and per forward pass (kernels_step)."""
    layers = model.model.layers
    n = collections.Counter(layer.attn_kind for layer in layers)
    n.update("dense" if hasattr(layer, "mlp") else "moe" for layer in layers)
    out = {f"kernels_{k}": per_step.get(k, 0.0) / n[k] for k in ("kda", "mla", "dense", "moe") if n[k]}
    out["kernels_attn_res"] = per_step.get("layer", 0.0) / len(layers)
    out["kernels_step"] = per_step.get("step", 0.0)
    return {k: round(v, 1) for k, v in out.items()}


def expert_step_s(model) -> float:
    """Seconds the engine spends per routed expert of a MoE layer step beyond its ops: one token routed
    to 1..all experts of the first MoE block through `MoE.run_experts` (store lookup, grouping, the
    kernel's share), fitted as t = t0 + experts * slope."""
    import torch

    moe = model.moe_blocks()[0]
    cfg = model.config
    h = torch.randn(1, cfg.moe.latent_dim or cfg.hidden_size)
    counts = sorted({1, cfg.moe.num_experts // 4, cfg.moe.num_experts // 2, cfg.moe.num_experts})
    times = _best_each([lambda k=k: moe.run_experts(h, torch.arange(k)[None], torch.full((1, k), 1.0 / k))
                        for k in counts])
    return max(0.0, fit_line(list(zip(counts, times)))[1])


class _Streamer:
    """Makes a model's Linears and MoE blocks also stream realistic weights before they run: one bf16
    weight of STREAM_SHAPE per Linear and one grouped MXFP4 call of STREAM_EXPERT experts per MoE
    block, cycling through pools bigger than the caches. The model's own ops then run as in a model
    too big for the caches (evicted caches, kernel threads gone idle between calls). `time_alone`
    times the streams back to back, to take them out again."""

    def __init__(self, kernel):
        import torch

        from moeswap.ops.linear import linear

        n, k = STREAM_SHAPE
        self.pool = [torch.randn(n, k).to(torch.bfloat16) for _ in range(POOL_BYTES // (2 * n * k))]
        self.x, self.linear, self.calls = torch.randn(1, k), linear, 0
        self.moe = _MoePool(kernel, *STREAM_EXPERT, 1) if kernel is not None else None
        self.call_s = self.moe_call_s = float("inf")

    def time_alone(self) -> None:
        """One back-to-back pass over each pool; keeps the fastest time per call seen."""
        import time

        t = time.perf_counter()
        for w in self.pool:
            self.linear(self.x, w)
        self.call_s = min(self.call_s, (time.perf_counter() - t) / len(self.pool))
        if self.moe:
            t, calls = time.perf_counter(), self.moe.calls
            self.moe.all()
            self.moe_call_s = min(self.moe_call_s, (time.perf_counter() - t) / len(self.moe.groups))
            self.moe.calls = calls  # not streams of the model's step

    def counts(self) -> tuple[int, int]:
        return self.calls, self.moe.calls if self.moe else 0

    def seconds_since(self, counts: tuple[int, int]) -> float:
        """What the streams since `counts` cost at their back-to-back speed."""
        linear_calls, moe_calls = (now - then for now, then in zip(self.counts(), counts))
        return linear_calls * self.call_s + (moe_calls * self.moe_call_s if moe_calls else 0.0)

    def linear_stream(self, *_):
        self.linear(self.x, self.pool[self.calls % len(self.pool)])
        self.calls += 1

    def attach(self, model) -> list:
        from torch import nn

        hooks = [m.register_forward_pre_hook(self.linear_stream) for m in model.modules() if isinstance(m, nn.Linear)]
        if self.moe:
            hooks += [m.register_forward_pre_hook(self.moe.call) for m in model.moe_blocks()]
        return hooks


@dataclass
class TinyRun:
    """moeswap's engine on a generated tiny K3: what a decode step costs besides streaming weights."""

    op_us: float  # per eager op: the step less its streams and experts, over its ops
    op_us_cached: float  # the same without the streams: ops on caches that keep the weights
    expert_us: float  # per routed expert, less the kernel's time for its rows (modelled apart)
    counts: dict[str, float]  # engine-profile op counts (kernels_*)
    step_ms: float  # the tiny model's decode step, with the streams
    native_layer_us: float | None = None  # per layer of the native decode step (engine/native_step.py)


def engine_overheads(row_ns: float, rounds: int = 10) -> TinyRun:
    """Runs moeswap's engine on a generated tiny K3 (`moeswap init-tiny --size tiny`: its own weights
    stream in a negligible share of a decode step, so the step is ops and per-expert work) with _Streamer on."""
    from moeswap.engine.generate import GenerationConfig, generate_batch
    from moeswap.engine.scheduler import EngineConfig
    from moeswap.models.loader import load_model
    from moeswap.ops import cpu_kernels
    from moeswap.tiny import write_tiny_model

    prompt = list(range(1, 17))
    with tempfile.TemporaryDirectory(prefix="moeswap-local-") as d:  # the expert store reads from it
        model, _ = load_model(write_tiny_model(Path(d) / "tiny", "kimi_k3", "tiny"))

        def run(tokens: int, native: bool = False):  # the eager step is the one whose ops and hooks this counts
            engine = EngineConfig(max_batch=1, max_len=len(prompt) + tokens, native=native)
            return generate_batch(model, [prompt], GenerationConfig(max_tokens=tokens, stop_ids=()), engine=engine)[0]

        per_step = count_ops(model, run)
        per_expert = expert_step_s(model)
        warm_s = min(r.decode_s / r.decoded for r in (run(33) for _ in range(rounds // 2)))
        native_runs = [run(33, native=True) for _ in range(rounds // 2)]
        native_s = min(r.decode_s / r.decoded for r in native_runs)
        native_ran = all(r.native_steps == r.decoded for r in native_runs)  # every step took the native call
        streamer = _Streamer(cpu_kernels.kernel())
        handles = streamer.attach(model)
        run(1)  # warm-up with the streams on
        step_s, start = float("inf"), streamer.counts()
        for _ in range(rounds):  # in turns with the streams alone: other work on the machine hits both
            r = run(33)
            step_s = min(step_s, r.decode_s / r.decoded)
            streamer.time_alone()
        for h in handles:
            h.remove()
    streams_s = streamer.seconds_since(start) / rounds / 33  # per forward pass; the prefill's share is noise
    m = model.config.moe
    experts = len(model.moe_blocks()) * m.top_k
    rows = 2 * m.expert_dim + (m.latent_dim or model.config.hidden_size)
    ops = sum(per_step.values())
    op_us_cached = max(0.0, warm_s - experts * per_expert) / ops * 1e6
    # the native step on the same warm caches: less the step's own ops (as eager) and the experts' rows
    native_us = native_s * 1e6 - per_step.get("step", 0.0) * op_us_cached - experts * rows * row_ns * 1e-3
    return TinyRun(max(0.0, step_s - streams_s - experts * per_expert) / ops * 1e6, op_us_cached,
                   max(0.0, per_expert * 1e6 - rows * row_ns * 1e-3), per_layer_counts(model, per_step),
                   step_s * 1e3, max(0.0, native_us) / len(model.model.layers) if native_ran else None)


def last_level_cache_mb() -> float | None:
    """The CPU's last-level cache in MB (Linux sysfs), or None where it does not say."""
    best = None
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level, size = int((index / "level").read_text()), (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        unit = {"K": 1 << 10, "M": 1 << 20}.get(size[-1:], 1)
        if size.rstrip("KM").isdigit() and (best is None or level > best[0]):
            best = (level, int(size.rstrip("KM")) * unit / 1e6)
    return best[1] if best else None


def engine_fields(copy_gbs: float, bf16_tflops: float, tag: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The measured fields of the `local` engine profile on a CPU, and their sources.

    Rates become efficiencies against the accelerator entry's copy bandwidth and bf16 matmul rate,
    which the roofline multiplies back: a read-only stream can beat a copy, so they may exceed 1.
    """
    lin_gbs, lin_gflops = bf16_linear_rates()
    moe = mxfp4_moe_rates()
    tiny = engine_overheads(moe[1] if moe else 0.0)
    f, src = dict(tiny.counts), {}
    f["mem_efficiency"] = round(lin_gbs / copy_gbs, 3)
    src["mem_efficiency"] = (f"{tag}: ops.linear.linear (fp32 x, bf16 W, rows 1-16) streams {lin_gbs:.1f} GB/s, "
                             f"over the {copy_gbs:.1f} GB/s copy rate")
    f["gemm_efficiency"] = round(lin_gflops / (bf16_tflops * 1e3), 3)
    src["gemm_efficiency"] = (f"{tag}: the same kernel at its best, {lin_gflops:.0f} GFLOP/s, over the "
                              f"{bf16_tflops * 1e3:.0f} GFLOP/s bf16 matmul rate")
    f["gemm_half_m"] = f["gemm_half_n"] = 0.0
    for k in ("gemm_half_m", "gemm_half_n"):
        src[k] = f"{tag}: the rates above are the kernel's own at decode sizes; no tile fall-off on top"
    if moe is not None:
        moe_gbs, row_ns, moe_gflops = moe
        shapes = ", ".join(f"[{i} x {w}]" for i, w in EXPERT_SHAPES)
        fit = (f"{tag}: grouped MXFP4 call (CpuKernels.moe), {TOP_K} experts of {shapes}, 1 token each, "
               f"fitted as t = t0 + output rows x {row_ns:.1f} ns + bytes / {moe_gbs:.1f} GB/s")
        f["expert_mem_efficiency"] = round(moe_gbs / copy_gbs, 3)
        src["expert_mem_efficiency"] = f"{fit}; the rate over the copy rate"
        f["expert_row_ns"] = round(row_ns, 2)
        src["expert_row_ns"] = f"{fit}; the time per output row"
        f["lowbit_gemm_efficiency"] = round(moe_gflops / lin_gflops, 3)
        src["lowbit_gemm_efficiency"] = (f"{tag}: the grouped MXFP4 call with 16 tokens per expert, "
                                         f"{moe_gflops:.0f} GFLOP/s, over the bf16 kernel's {lin_gflops:.0f}")
    f["kernel_us"] = round(tiny.op_us, 3)
    src["kernel_us"] = (f"{tag}: moeswap's decode step on a generated tiny K3 whose Linears each also stream a "
                        f"[{STREAM_SHAPE[0]} x {STREAM_SHAPE[1]}] bf16 weight and MoE blocks {TOP_K} MXFP4 experts "
                        f"of [{STREAM_EXPERT[0]} x {STREAM_EXPERT[1]}] ({tiny.step_ms:.2f} ms), less those streams "
                        f"timed back to back and its routed experts' time, over the aten ops it dispatches")
    cache_mb = last_level_cache_mb()
    if cache_mb:
        f["kernel_us_cached"], f["cache_mb"] = round(tiny.op_us_cached, 3), round(cache_mb, 1)
        src["kernel_us_cached"] = (f"{tag}: as kernel_us, with no streams: ops on caches that keep a small "
                                   f"model's weights, used where a step's weights fit in cache_mb")
        src["cache_mb"] = f"{tag}: last-level cache size from /sys/devices/system/cpu/cpu0/cache"
    if tiny.native_layer_us is not None:
        f["native_layer_us"] = round(tiny.native_layer_us, 2)
        src["native_layer_us"] = (f"{tag}: moeswap's native decode step (engine/native_step.py) on the tiny K3, warm "
                                  f"caches, less its step ops (kernels_step x kernel_us_cached) and its experts' "
                                  f"rows, over its layers")
    f["expert_us"] = round(tiny.expert_us, 2)
    src["expert_us"] = (f"{tag}: the tiny K3's MoE.run_experts for one token routed to 1 to all of its experts, "
                        f"time per expert less the kernel's per-row time (expert_row_ns)")
    how = f"{tag}: aten ops per decode step of the tiny K3, counted with a TorchDispatchMode and module hooks"
    src.update({k: how for k in tiny.counts})
    return f, src
