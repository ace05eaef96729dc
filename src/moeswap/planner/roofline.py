"""Roofline time model: seconds per layer and per pipeline stage for one forward pass of a batch.

Each op costs max(FLOPs / achievable FLOP/s, bytes / achievable bandwidth); ops add up, plus a
fixed time per kernel, alpha-beta collectives (TP all-reduce, EP all-to-all, PP send) and expert
swap traffic. Achievable rates come from the engine profile. Knows nothing of serving or training
schedules (serving.py, lora.py). Entry point: `stage_cost`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moeswap.config import ModelConfig
from moeswap.ops.kernel_abi import constant
from moeswap.options import EXPERT_GPU_MIN_TOKENS

from .hardware import Hardware
from .layouts import Layout
from .memory import expert_bytes, linear_bytes
from .params import Linear, ModelParams
from .workload import BYTES, Precision

CATEGORIES = ("gemm", "experts", "attention", "elementwise", "comm", "overhead", "swap", "host", "drive")


@dataclass
class Cost:
    """Seconds by category; `total` is their sum."""

    parts: dict[str, float] = field(default_factory=dict)

    def add(self, cat: str, seconds: float) -> None:
        self.parts[cat] = self.parts.get(cat, 0.0) + seconds

    def merge(self, other: "Cost", scale: float = 1.0) -> None:
        for k, v in other.parts.items():
            self.add(k, v * scale)

    def scaled(self, factors: dict[str, float]) -> "Cost":
        return Cost({k: v * factors.get(k, 1.0) for k, v in self.parts.items()})

    @property
    def total(self) -> float:
        return sum(self.parts.values())


@dataclass(frozen=True)
class Pass:
    """One batch through one stage: `tokens` over the whole stage, `ctx` tokens attended per token (mean)."""

    tokens: float
    ctx: float
    decode: bool  # one new token per sequence (KDA recurrent step, absorbed MLA over the cache)
    logits: float = 0.0  # tokens that need lm_head on the last stage (per DP rank)
    rank_tokens: float | None = None  # tokens on the busiest DP rank; default tokens / dp

    def per_rank(self, dp: int) -> float:
        return self.tokens / dp if self.rank_tokens is None else self.rank_tokens


@dataclass(frozen=True)
class Placement:
    """Where a stage's experts are and how often a touched expert is already in HBM."""

    hit_rate: float = 1.0
    host_fraction: float = 1.0  # of misses, the share served from host RAM (rest from NVMe)
    compute: str = "swap"  # "swap": copy misses into HBM; "host": run misses on the host CPU; "auto": per pass
    swap_overlap: float = 0.0
    touched: tuple[tuple[float, ...], ...] | None = None  # per-layer expert popularity from a trace (sums to 1)

    def compute_for(self, tokens: float) -> str:
        """Where a pass of `tokens` tokens computes its misses. auto is the runtime's `--expert-compute auto`
        (experts/hybrid.py): the host below options.EXPERT_GPU_MIN_TOKENS tokens, swap from there."""
        if self.compute != "auto":
            return self.compute
        return "host" if tokens < EXPERT_GPU_MIN_TOKENS else "swap"


def touched_fraction(tokens: float, top_k: int, num_experts: int, popularity: tuple[float, ...] | None = None) -> float:
    """Expected fraction of a layer's experts that `tokens` tokens touch (independent top-k draws)."""
    if tokens <= 0:
        return 0.0
    if popularity:
        draws = tokens * top_k
        return sum(1 - (1 - p) ** draws for p in popularity) / len(popularity)
    return 1 - (1 - top_k / num_experts) ** tokens


def collective(hw: Hardware, group: int, bytes_per_device: float) -> float:
    link = hw.link_for(group)
    if link is None:
        return 0.0
    return link.latency_us * 1e-6 + bytes_per_device / (link.gbs * 1e9 * hw.engine.link_efficiency)


def expert_exchange_bytes(cfg: ModelConfig, lay: Layout, tokens: float, itemsize: int = 2,
                          attention: str = "data-parallel") -> float:
    """Bytes one device receives in one direction of one MoE layer's expert exchange, for `tokens` tokens
    of a stage. "data-parallel": each device routes its 1/stage_devices of the tokens and sends each
    (token, expert) pair's activations to the expert's owner (dispatch; the combine returns as many), the
    layout this planner ranks. "replicated": every device runs every token (moeswap's expert parallelism
    today, distributed/ep.py): no dispatch, and the combine brings each device the other owners' pairs."""
    width = cfg.moe.latent_dim or cfg.hidden_size
    pairs = tokens * cfg.moe.top_k * (lay.ep - 1) / lay.ep  # pairs whose expert another device owns
    if attention == "replicated":
        return pairs * width * itemsize
    if attention != "data-parallel":
        raise ValueError(f"attention must be 'data-parallel' or 'replicated', got {attention!r}")
    return pairs / lay.stage_devices * width * itemsize


def all_reduce(hw: Hardware, group: int, size: float) -> float:
    return 0.0 if group <= 1 else collective(hw, group, 2 * (group - 1) / group * size)


def _saturation(x: float, half: float) -> float:
    return 1.0 if half <= 0 else x / (x + half)  # half 0: a measured rate with no tile fall-off


def gemm_efficiency(hw: Hardware, m: float, n: float) -> float:
    eng = hw.engine
    return eng.gemm_efficiency * _saturation(m, eng.gemm_half_m) * _saturation(n, eng.gemm_half_n)


def _roof(cost: Cost, cat: str, flops: float, flop_rate: float, nbytes: float, byte_rate: float) -> float:
    t = max(flops / flop_rate if flops else 0.0, nbytes / byte_rate if nbytes else 0.0)
    cost.add(cat, t)
    return t


class _Ctx:
    """Per-stage constants shared by every layer (rates, precisions, layout)."""

    def __init__(self, mp: ModelParams, lay: Layout, hw: Hardware, prec: Precision, pl: Placement):
        prec = prec.for_model(mp.cfg)
        self.mp, self.cfg, self.lay, self.hw, self.prec, self.pl = mp, mp.cfg, lay, hw, prec, pl
        eng = hw.engine
        self.bw = hw.mem_bw() * eng.mem_efficiency
        self.expert_bw = hw.mem_bw() * eng.get("expert_mem_efficiency", eng.mem_efficiency)
        self.op_us = eng.kernel_us  # fixed time per kernel; stage_cost may choose the cached one
        self.native = False  # whether the pass runs in the engine's native decode step (stage_cost sets it)
        self.f16 = hw.flops("bf16")
        # int8/int4 dense weights are widened in the kernel and multiplied in bf16/fp32
        self.f_dense = hw.flops("fp8") if prec.dense in ("fp8", "mxfp8") else self.f16
        self.exp_b = expert_bytes(mp, prec)


def _linear(cx: _Ctx, cost: Cost, l: Linear, tokens: float) -> float:
    tp = cx.lay.tp
    share = 1.0 if l.split == "rep" else 1.0 / tp
    n = l.out_dim / tp if l.split == "col" else l.out_dim
    params = l.params * share
    eff = gemm_efficiency(cx.hw, tokens, n)
    act = tokens * (l.in_dim * (share if l.split == "row" else 1) + n) * 2
    weights = linear_bytes(l, cx.prec.dense) * share
    return _roof(cost, "gemm", 2 * tokens * params, cx.f_dense * eff, weights + act, cx.bw)


def _attention_core(cx: _Ctx, cost: Cost, kind: str, tokens: float, p: Pass) -> None:
    cfg, lay = cx.cfg, cx.lay
    rate = cx.f16 * cx.hw.engine.attn_efficiency
    if kind == "kda":
        h, dh = cfg.kda.num_heads / lay.tp, cfg.kda.head_dim
        if p.decode:  # decay, S^T k, rank-1 update, S^T q on an fp32 D x D state per head
            _roof(cost, "attention", tokens * h * 8 * dh * dh, rate, tokens * h * dh * dh * 4 * 2, cx.bw)
        else:  # chunked (WY) form, chunks of 64: intra-chunk attention + state passes
            flops = tokens * h * 2 * (3 * 64 * dh + 3 * dh * dh)
            _roof(cost, "attention", flops, rate, tokens * h * dh * 2 * 6, cx.bw)
        return
    m = cfg.mla
    if p.decode:  # absorbed: scores and values against the latent cache
        ctx = p.ctx / lay.tp if lay.dcp else p.ctx
        heads = m.num_heads if lay.dcp else m.num_heads / lay.tp
        width = m.kv_lora_rank + m.qk_rope_head_dim
        flops = tokens * 2 * heads * (width + m.kv_lora_rank) * ctx
        _roof(cost, "attention", flops, rate, tokens * ctx * width * BYTES[cx.prec.kv_cache], cx.bw)
    else:  # per-head K/V expanded from the latent, causal softmax attention
        heads = m.num_heads / lay.tp
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        flops = tokens * heads * 2 * (qk + m.v_head_dim) * p.ctx
        _roof(cost, "attention", flops, rate, tokens * heads * (2 * qk + 2 * m.v_head_dim) * 2, cx.bw)


def _experts(cx: _Ctx, cost: Cost, layer: int, p: Pass) -> None:
    cfg, lay, hw, prec, pl = cx.cfg, cx.lay, cx.hw, cx.prec, cx.pl
    moe, eng = cfg.moe, hw.engine
    pop = pl.touched[layer] if pl.touched and layer < len(pl.touched) else None
    frac = touched_fraction(p.tokens, moe.top_k, moe.num_experts, pop)
    touched = moe.num_experts / lay.ep * frac  # touched experts held by this device
    eb = cx.exp_b / lay.expert_tp
    assignments = p.tokens * moe.top_k
    flops = 2 * assignments * cx.mp.expert_params / lay.stage_devices
    m = assignments / max(moe.num_experts * frac, 1e-9)
    n = moe.expert_dim / lay.expert_tp
    eff = gemm_efficiency(hw, m, n)
    f_rate = hw.flops(prec.expert_matmul)
    width = moe.latent_dim or cfg.hidden_size
    # Each device handles 1/ep of the token-expert assignments, at full input width (TP splits the
    # expert's hidden width only): gather inputs, gate/up out and back in, down out, combine.
    act = assignments / lay.ep * (2 * width + 5 * n) * 2
    weight_bytes = touched * eb
    if prec.expert_kernel == "materialize":  # decode to bf16 in memory, then a plain bf16 GEMM
        weight_bytes += touched * cx.mp.expert_params * 2 / lay.expert_tp * 2
    elif prec.experts != "bf16" and not (prec.experts == "mxfp4" and prec.expert_matmul == "fp4"):
        eff *= eng.lowbit_gemm_efficiency  # dequantised inside the GEMM main loop
    hit = pl.hit_rate
    compute = pl.compute_for(p.tokens)
    on_device = 1.0 if compute == "swap" else hit
    t_dev = _roof(cost, "experts", flops * on_device, f_rate * eff, (weight_bytes + act) * on_device, cx.expert_bw)
    # Fixed time per expert (an eager engine's lookup and grouping) and per output row (a kernel that
    # finishes each row on its own: reduction, scale, activation).
    # the native step runs resident experts from a table; swapping ones go through the store as before
    engine_us = 0.0 if cx.native and pl.hit_rate >= 1.0 else eng.get("expert_us", 0.0)
    per_expert = engine_us * 1e-6 + (2 * n + width) * eng.get("expert_row_ns", 0.0) * 1e-9
    t_fixed = touched * on_device * per_expert
    cost.add("experts", t_fixed)
    t_dev += t_fixed
    misses = touched * (1 - hit) * cx.exp_b / lay.expert_tp
    if misses <= 0:
        return
    # Misses held on the drive are read from it at its rate, whichever processor then runs them. A layer's
    # misses are known only once its router has run, so the read waits for the layer before it and the
    # layer waits for the read: no overlap unless --swap-overlap says how much prefetch hides.
    from_drive = misses * (1 - pl.host_fraction)
    t_drive = from_drive / hw.storage_bw_per_device(lay.devices) if from_drive > 0 else 0.0
    if compute == "swap":
        t = misses * pl.host_fraction / max(hw.host_bw_per_device(lay.devices), 1e-9)
        cost.add("swap", t - pl.swap_overlap * min(t, t_dev))
        cost.add("drive", t_drive - pl.swap_overlap * min(t_drive, t_dev))
        return
    # Computing misses on the host: its DRAM and cores are shared by the server's devices.
    host = hw.host
    assert host is not None  # misses computed on the host need one
    share = hw.on_node(lay.devices)
    h_bw = host.mem_bw_gbs * 1e9 * host.mem_efficiency / share
    h_flops = (host.get("bf16_tflops") or 0) * 1e12 * eng.gemm_efficiency / share
    t_host = max(misses / h_bw, flops * (1 - hit) / h_flops if h_flops else float("inf"))
    link = hw.host_link.gbs * 1e9 * eng.host_link_efficiency if hw.host_link else float("inf")
    t_host += assignments * (1 - hit) / lay.stage_devices * width * 2 * 2 / link
    cost.add("host", max(0.0, t_host - t_dev))  # runs beside the device's share of the layer
    cost.add("drive", t_drive - pl.swap_overlap * min(t_drive, max(t_host, t_dev)))


def layer_cost(cx: _Ctx, layer: int, p: Pass) -> Cost:
    cfg, lay, hw, eng = cx.cfg, cx.lay, cx.hw, cx.hw.engine
    lp = cx.mp.layers[layer]
    d = cfg.hidden_size
    tokens = p.per_rank(lay.dp)  # attention and dense work is per DP rank
    cost = Cost()
    for l in lp.attn:
        _linear(cx, cost, l, tokens)
    _attention_core(cx, cost, lp.attn_kind, tokens, p)
    for l in lp.mlp:
        _linear(cx, cost, l, tokens)
    if lp.num_experts:
        _experts(cx, cost, layer, p)

    # Replicated elementwise traffic: two norms (read + write), residual adds or AttnRes mixes over
    # the block bank (each mix reads every banked source and the partial sum).
    if cfg.attn_res_block_size:
        sources = layer // cfg.attn_res_block_size + 2
        passes = 4 + 2 * (sources + 1)
    else:
        passes = 4 + 2 * 3
    cost.add("elementwise", tokens * d * 2 * passes / cx.bw)

    ar = tokens * d * 2
    comm = all_reduce(hw, lay.tp, ar)  # attention output
    if lp.num_experts and lay.ep > 1:
        a2a = expert_exchange_bytes(cfg, lay, p.tokens)
        comm += 2 * collective(hw, lay.stage_devices, a2a) + all_reduce(hw, lay.tp, ar)
    elif lay.stage_devices > 1:
        comm += all_reduce(hw, lay.stage_devices, p.tokens * d * 2)
    if lp.num_experts and cfg.moe.latent_norm and cfg.moe.latent_dim and lay.expert_tp > 1:
        # K3 normalises the combined latent: TP-split experts give partial sums that must be
        # reduced before the norm.
        comm += all_reduce(hw, lay.expert_tp, p.tokens / lay.ep * cfg.moe.latent_dim * 2)
    cost.add("comm", comm)

    if cx.native:  # the layers of a decode step in one C call: its fixed time per layer, and the eager
        # ops of a MoE block whose experts swap (the model runs that FFN between two native calls)
        swapping = lp.num_experts and cx.pl.hit_rate < 1.0
        cost.add("overhead", (eng.native_layer_us + (eng.kernels_moe * cx.op_us if swapping else 0.0)) * 1e-6)
        return cost
    kernels = (eng.kernels_kda if lp.attn_kind == "kda" else eng.kernels_mla)
    kernels += eng.kernels_moe if lp.num_experts else eng.kernels_dense
    kernels += eng.kernels_attn_res if cfg.attn_res_block_size else 0
    cost.add("overhead", kernels * cx.op_us * 1e-6)
    return cost


NATIVE_MAX_TOKENS = constant("DENSE_KERNEL_MAX_ROWS")  # engine/native_step.py: decode steps of at most this many


def _native_step(cx: _Ctx, p: Pass) -> bool:
    """Whether the engine runs this pass's layers in its native decode step: an engine profile that
    measured one and a decode pass of few enough tokens."""
    return (cx.hw.engine.get("native_layer_us") is not None and p.decode
            and p.per_rank(cx.lay.dp) <= NATIVE_MAX_TOKENS)


def _step_weight_bytes(cx: _Ctx, layers: range, p: Pass) -> float:
    """Weight bytes one device reads in a pass through `layers`: its dense share and touched experts."""
    total = 0.0
    for i in layers:
        lp = cx.mp.layers[i]
        total += sum(linear_bytes(l, cx.prec.dense) for l in (*lp.attn, *lp.mlp)) / cx.lay.tp
        if lp.num_experts:
            moe = cx.cfg.moe
            touched = moe.num_experts / cx.lay.ep * touched_fraction(p.tokens, moe.top_k, moe.num_experts)
            total += touched * cx.exp_b / cx.lay.expert_tp
    return total


def _op_us(cx: _Ctx, layers: range, p: Pass) -> float:
    """Per-kernel time: the cached one where a pass's weights fit in the cache (they stay there between
    passes, and so does the engine's own state), else the one measured on caches weights evict."""
    eng = cx.hw.engine
    cached, cache_mb = eng.get("kernel_us_cached"), eng.get("cache_mb")
    if cached is None or not cache_mb or _step_weight_bytes(cx, layers, p) > cache_mb * 1e6:
        return eng.kernel_us
    return cached


def stage_cost(mp: ModelParams, layers: range, stage: int, lay: Layout, hw: Hardware, prec: Precision,
               pl: Placement, p: Pass) -> Cost:
    """Seconds for one device of `stage` to run pass `p` through its layers (plus lm_head and the send)."""
    cx = _Ctx(mp, lay, hw, prec, pl)
    cx.op_us = _op_us(cx, layers, p)
    cx.native = _native_step(cx, p)
    cfg = mp.cfg
    total = Cost()
    memo: dict[tuple, Cost] = {}
    for i in layers:
        lp = mp.layers[i]
        bank = i // cfg.attn_res_block_size if cfg.attn_res_block_size else 0
        key = (lp.attn_kind, lp.mlp_kind, bank, i if pl.touched else 0)
        if key not in memo:  # layers of one kind and bank size cost the same
            memo[key] = layer_cost(cx, i, p)
        total.merge(memo[key])
    if stage == lay.pp - 1 and p.logits and mp.lm_head:
        head = Linear("lm_head", cfg.vocab_size, cfg.hidden_size, "col")
        _linear(cx, total, head, p.logits)
    if stage == lay.pp - 1 and hw.engine.get("kernels_step"):
        total.add("overhead", hw.engine.kernels_step * cx.op_us * 1e-6)
    if stage < lay.pp - 1:
        banked = (layers.stop // cfg.attn_res_block_size + 1) if cfg.attn_res_block_size else 0
        send = p.per_rank(lay.dp) * cfg.hidden_size * 2 * (1 + banked)
        total.add("comm", collective(hw, lay.replica_devices, send))
    return total
