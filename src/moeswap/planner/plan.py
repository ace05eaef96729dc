"""The planner's Python API: `plan(PlanRequest) -> PlanResult`.

Resolves model and hardware, enumerates (or checks one) layout, sizes memory per device per stage,
predicts serving (TTFT/TPOT/tokens/s vs concurrency) or LoRA (tokens/s) and ranks feasible layouts
by the chosen objective. Every impossible layout keeps the one-sentence reason it was rejected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from moeswap.config import ModelConfig

from .errors import PlanError
from .hardware import Catalog, Hardware, builtin_catalog, resolve_hardware
from .layouts import Layout, check_layout, enumerate_layouts, parse_layout, stage_layers
from .lora import LoraPoint, lora_point
from .memory import GB, DeviceMemory, device_memory, expert_bytes, model_bytes
from .models import resolve_model
from .params import ModelParams, kda_state_bytes_per_seq, mla_cache_values_per_token, model_params
from .roofline import Cost, Pass, Placement, stage_cost
from .serving import ServePoint, pipeline_time, serve_point
from .workload import BYTES, Lora, Offload, Precision, Serve

OBJECTIVES = ("throughput", "latency", "cost")
MAX_DEVICES = 1 << 16  # the largest clusters built are ~10^5 accelerators; enumeration cost grows with divisors


@dataclass(frozen=True)
class PlanRequest:
    model: str | ModelConfig = "kimi-k3"
    hardware: str = "h200"
    devices: int = 8
    workload: str = "serve"  # "serve" | "lora"
    serve: Serve = Serve()
    lora: Lora = Lora()
    precision: Precision = Precision()
    offload: Offload = Offload()
    layout: str | None = None  # one layout to check (e.g. "tp8", "pp4xtp8"); None: enumerate all
    objective: str = "throughput"
    pp_split: str = "block"  # "block": stages own whole AttnRes blocks; "layer": any layer boundary
    dcp: bool = False  # enumerated layouts split the MLA cache over TP ranks
    engine: str | None = None  # engine profile name; default: the system's
    catalogs: tuple[str, ...] = ()  # extra hardware TOML files
    price_per_hour: float | None = None  # per device, for the cost objective
    tpot_slo_ms: float | None = None  # throughput objective: only concurrency points meeting it count
    local_path: str | None = None
    remeasure: bool = False


@dataclass
class Candidate:
    layout: Layout
    stages: list[range]
    memory: list[DeviceMemory]  # per stage, at the largest requested concurrency that fits
    max_concurrency: int  # sequences of `context` tokens the deployment holds at once
    hit_rate: float
    points: list[ServePoint] = field(default_factory=list)
    lora: LoraPoint | None = None
    decode_cost: Cost | None = None  # bottleneck-stage decode step at the ranking concurrency
    score: float = 0.0
    score_label: str = ""

    @property
    def worst_memory(self) -> DeviceMemory:
        return max(self.memory, key=lambda m: m.used / m.capacity)


@dataclass
class PlanResult:
    request: PlanRequest
    model_label: str
    cfg: ModelConfig
    params: ModelParams
    hardware: Hardware
    sizes: dict[str, float]
    candidates: list[Candidate]
    rejected: list[tuple[str, str]]
    assumptions: list[str]

    @property
    def best(self) -> Candidate:
        return self.candidates[0]


def model_sizes(mp: ModelParams, prec: Precision, hw: Hardware | None = None) -> dict[str, float]:
    cfg = mp.cfg
    prec = prec.for_model(cfg)
    state, conv = kda_state_bytes_per_seq(cfg)
    wb = model_bytes(mp, prec)
    out = {
        "total_params": mp.total, "active_params": mp.active, "routed_params": mp.routed,
        "non_expert_params": mp.non_expert, "experts": mp.num_experts_total,
        "expert_bytes": expert_bytes(mp, prec),
        "mla_cache_bytes_per_token": mla_cache_values_per_token(cfg) * BYTES[prec.kv_cache],
        "kda_state_bytes_per_seq": state, "kda_conv_bytes_per_seq": conv,
        "weight_bytes": sum(wb.values()),
        **{f"bytes:{k}": v for k, v in wb.items()},
    }
    if hw is not None:
        out["devices_for_weights"] = out["weight_bytes"] / hw.hbm_bytes
    return out


def plan(req: PlanRequest, catalog: Catalog | None = None) -> PlanResult:
    _check_request(req)
    if isinstance(req.model, ModelConfig):
        cfg, label = req.model, "config"
    else:
        cfg, label = resolve_model(req.model)
    mp = model_params(cfg)
    req = replace(req, precision=req.precision.for_model(cfg))
    req.precision.check_model(cfg)
    _check_trace(req.offload.trace_counts, cfg)
    cat = catalog or builtin_catalog()
    for f in req.catalogs:
        cat.add_file(f)
    if req.hardware == "local" and (req.remeasure or "local" not in cat.entries["system"]):
        from .local import load_or_measure  # measuring imports torch and runs the engine: only when asked

        load_or_measure(cat, req.local_path, req.remeasure)
    hw = resolve_hardware(req.hardware, cat, req.engine)
    if req.offload.compute != "swap" and req.offload.spill != "none" and hw.host is None:
        raise PlanError(f"--offload-compute {req.offload.compute}: hardware {hw.name!r} has no host CPU beside its "
                        "device (on a CPU-only machine the experts already run on the CPU: use swap)")
    if req.objective == "cost" and not req.price_per_hour:
        raise PlanError("the cost objective needs a device price: pass --price-per-hour (per device)")

    if req.layout:
        lay = parse_layout(req.layout)
        if req.dcp and lay.tp > 1:
            lay = replace(lay, dcp=True)
        why = check_layout(cfg, lay, req.devices, req.pp_split)
        if why:
            raise PlanError(f"layout {lay.name} rejected: {why}")
        layouts, rejected = [lay], []
    else:
        layouts, rej = enumerate_layouts(cfg, req.devices, req.pp_split, req.dcp,
                                         max_tp=hw.system.scale_up_devices)
        rejected = [(l.name, why) for l, why in rej]

    cands = []
    for lay in layouts:
        cand, why = _evaluate(mp, lay, hw, req)
        if cand is None:
            rejected.append((lay.name, why))
        else:
            cands.append(cand)
    if not cands:
        reason = rejected[0][1] if len(layouts) == 1 else _common_reason(rejected)
        raise PlanError(f"no layout of {label} fits {req.devices} x {hw.name}: {reason}")
    cands.sort(key=lambda c: c.score, reverse=req.objective == "throughput")
    return PlanResult(req, label, cfg, mp, hw, model_sizes(mp, req.precision, hw), cands, rejected,
                      hw.assumptions())


def _check_request(req: PlanRequest) -> None:
    if not 1 <= req.devices <= MAX_DEVICES:
        raise PlanError(f"--devices {req.devices}: expected 1 to {MAX_DEVICES} accelerators "
                        f"(layouts are enumerated over them)")
    if req.workload not in ("serve", "lora"):
        raise PlanError(f"--workload {req.workload!r} is not 'serve' or 'lora'")
    if req.objective not in OBJECTIVES:
        raise PlanError(f"--objective {req.objective!r} is not one of {', '.join(OBJECTIVES)}")
    if req.pp_split not in ("block", "layer"):
        raise PlanError(f"--pp-split {req.pp_split!r} is not 'block' or 'layer'")
    req.precision.check()
    req.offload.check()
    (req.serve if req.workload == "serve" else req.lora).check()


def _check_trace(counts: tuple[tuple[float, ...], ...], cfg: ModelConfig) -> None:
    if not counts:
        return
    if len(counts) != cfg.num_layers:
        raise PlanError(f"--trace lists {len(counts)} layers; the model has {cfg.num_layers} (use [] for dense layers)")
    for i, layer in enumerate(counts):
        if layer and len(layer) != cfg.moe.num_experts:
            raise PlanError(f"--trace layer {i} has {len(layer)} expert counts; the model has {cfg.moe.num_experts}")


def _common_reason(rejected: list[tuple[str, str]]) -> str:
    """The first memory reason among the rejected layouts (the most telling), with how many were rejected."""
    mem = [w for _, w in rejected if "GB" in w] or [w for _, w in rejected]
    head = mem[0]
    return f"{head} (and {len(rejected) - 1} other layouts rejected; --show-rejected lists them)" if len(rejected) > 1 else head


def _memory(mp: ModelParams, lay: Layout, stages: list[range], hw: Hardware, req: PlanRequest,
            seqs_per_device: float) -> list[DeviceMemory]:
    out = []
    for s, layers in enumerate(stages):
        if req.workload == "lora":
            out.append(device_memory(mp, lay, s, layers, hw, req.precision, req.offload, lora=req.lora))
        else:
            chunk = hw.engine.prefill_chunk
            out.append(device_memory(mp, lay, s, layers, hw, req.precision, req.offload, seqs=seqs_per_device,
                                     ctx=req.serve.ctx, act_tokens=chunk, logit_tokens=seqs_per_device,
                                     ws_tokens=max(req.serve.concurrency) / lay.replicas))
    return out


def _max_sequences(mp: ModelParams, lay: Layout, stages: list[range], hw: Hardware, req: PlanRequest) -> int:
    """Deployment-wide sequences of `context` tokens that fit (state grows linearly with sequences)."""
    zero, one = _memory(mp, lay, stages, hw, req, 0), _memory(mp, lay, stages, hw, req, 1)
    best = 1 << 30
    for m0, m1 in zip(zero, one):
        per_seq = sum(m1.parts.get(k, 0) - m0.parts.get(k, 0) for k in ("KDA state", "MLA cache", "activations"))
        fixed = m0.used - m0.parts.get("experts", 0)
        need = m0.expert_need if req.offload.spill == "none" else m0.working_set
        free = m0.capacity - fixed - need
        best = min(best, math.floor(free / per_seq) if per_seq > 0 else best)
    return max(0, best) * lay.dp * lay.replicas


def _placement(mem: DeviceMemory, off: Offload) -> Placement:
    if mem.expert_need == 0 or mem.resident_fraction >= 1:
        hit = 1.0
    elif off.hit_rate is not None:
        hit = off.hit_rate
    elif off.trace_counts:
        hit = _trace_hit_rate(off.trace_counts, mem.resident_fraction)
    else:
        hit = mem.resident_fraction  # uniform routing: any policy hits in proportion to what it holds
    spilled = mem.expert_host + mem.expert_nvme
    popularity = tuple(_normalise(c) for c in off.trace_counts) if off.trace_counts else None
    return Placement(hit_rate=hit, host_fraction=mem.expert_host / spilled if spilled else 1.0,
                     compute=off.compute, swap_overlap=off.swap_overlap, touched=popularity)


def _normalise(counts: tuple[float, ...]) -> tuple[float, ...]:
    s = sum(counts) or 1.0
    return tuple(c / s for c in counts)


def _trace_hit_rate(counts: tuple[tuple[float, ...], ...], resident: float) -> float:
    """Hit rate of a cache holding the most-used `resident` fraction of each layer's experts."""
    rates = []
    for layer in counts:
        if not layer or sum(layer) == 0:
            continue
        k = int(resident * len(layer))
        rates.append(sum(sorted(layer, reverse=True)[:k]) / sum(layer))
    return sum(rates) / len(rates) if rates else resident


def _evaluate(mp: ModelParams, lay: Layout, hw: Hardware, req: PlanRequest) -> tuple[Candidate | None, str]:
    stages = stage_layers(mp.cfg, lay.pp, req.pp_split)
    if req.workload == "lora":
        mems = _memory(mp, lay, stages, hw, req, 0)
        bad = next((m.problem for m in mems if m.problem), None)
        if bad:
            return None, bad
        placements = [_placement(m, req.offload) for m in mems]
        lp = lora_point(mp, lay, stages, hw, req.precision, req.lora, placements, mems)
        cand = Candidate(lay, stages, mems, 0, min(p.hit_rate for p in placements), lora=lp)
        cand.score, cand.score_label = _score_lora(lp, req)
        return cand, ""

    serve = req.serve
    max_c = _max_sequences(mp, lay, stages, hw, req)
    one = _memory(mp, lay, stages, hw, req, 1 / (lay.dp * lay.replicas))
    bad = next((m.problem for m in one if m.problem), None)
    if bad:
        return None, bad
    if max_c < 1:
        return None, (f"no room for one sequence of {serve.ctx} tokens after weights "
                      f"({one[0].used / GB:.0f} of {one[0].capacity / GB:.0f} GB per device)")
    fitting = [c for c in serve.concurrency if c <= max_c] or [min(serve.concurrency)]
    c_mem = max(fitting)
    mems = _memory(mp, lay, stages, hw, req, c_mem / (lay.dp * lay.replicas))
    points: list[ServePoint] = []
    worst_cost = None
    for c in serve.concurrency:
        seqs = c / (lay.dp * lay.replicas)
        pl = [_placement(m, req.offload) for m in _memory(mp, lay, stages, hw, req, seqs)] \
            if req.offload.spill != "none" else [Placement()] * len(stages)
        pt, cost = _serve_point(mp, lay, stages, hw, req, pl, c)
        pt.fits = c <= max_c
        if not pt.fits:
            pt.note = f"needs more memory than fits (max {max_c})"
        points.append(pt)
        if c == c_mem:
            worst_cost = cost
    hit = min(_placement(m, req.offload).hit_rate for m in mems)
    cand = Candidate(lay, stages, mems, max_c, hit, points=points, decode_cost=worst_cost)
    cand.score, cand.score_label = _score_serve(points, req)
    if math.isnan(cand.score):
        return None, "no requested concurrency fits in memory" + (
            f" and meets TPOT <= {req.tpot_slo_ms} ms" if req.tpot_slo_ms else "")
    return cand, ""


def _serve_point(mp: ModelParams, lay: Layout, stages: list[range], hw: Hardware, req: PlanRequest,
                 pl: list[Placement], concurrency: int) -> tuple[ServePoint, Cost]:
    serve, prec = req.serve, req.precision
    costs: dict[float, list[Cost]] = {}

    def decode(seqs_per_replica: float) -> float:
        m = max(1, min(lay.pp, int(seqs_per_replica)))
        b = seqs_per_replica / m
        busiest = math.ceil(b / lay.dp - 1e-9)  # sequences on the fullest DP rank
        p = Pass(tokens=b, ctx=serve.isl + serve.osl / 2, decode=True, logits=busiest, rank_tokens=busiest)
        cs = [stage_cost(mp, r, s, lay, hw, prec, pl[s], p) for s, r in enumerate(stages)]
        costs[seqs_per_replica] = cs
        return pipeline_time([c.total for c in cs], m)

    def prefill(tokens: float, requests: float, lanes: int) -> tuple[float, float]:
        # each busy DP rank prefills its own chunk; the experts see all lanes' tokens at once
        p = Pass(tokens=tokens * lanes, ctx=serve.isl / 2, decode=False, logits=requests, rank_tokens=tokens)
        ts = [stage_cost(mp, r, s, lay, hw, prec, pl[s], p).total for s, r in enumerate(stages)]
        return sum(ts), max(ts)

    pt = serve_point(serve, concurrency, lay.replicas, lay.devices, decode, prefill, hw.engine.prefill_chunk,
                     lanes=lay.dp)
    cs = next(iter(costs.values()))
    return pt, max(cs, key=lambda c: c.total)


def _score_serve(points: list[ServePoint], req: PlanRequest) -> tuple[float, str]:
    ok = [p for p in points if p.fits and not p.saturated
          and (req.tpot_slo_ms is None or p.tpot * 1e3 <= req.tpot_slo_ms)]
    if not ok:
        return float("nan"), ""
    if req.objective == "latency":
        p = min(ok, key=lambda p: p.concurrency)
        return p.tpot * 1e3, f"TPOT {p.tpot * 1e3:.1f} ms @ c={p.concurrency}"
    best = max(ok, key=lambda p: p.tok_s_device)
    if req.objective == "cost":
        assert req.price_per_hour is not None  # plan() refuses the cost objective without a price
        usd = req.price_per_hour / 3600 / best.out_tok_s_device * 1e6
        return usd, f"${usd:.2f} per M output tokens @ c={best.concurrency}"
    return best.tok_s_device, f"{best.tok_s_device:.0f} tok/s/device @ c={best.concurrency}"


def _score_lora(pt: LoraPoint, req: PlanRequest) -> tuple[float, str]:
    if req.objective == "latency":
        return pt.step_s, f"{pt.step_s:.2f} s/step"
    if req.objective == "cost":
        assert req.price_per_hour is not None  # plan() refuses the cost objective without a price
        usd = req.price_per_hour / 3600 / pt.tok_s_device * 1e6
        return usd, f"${usd:.2f} per M training tokens"
    return pt.tok_s_device, f"{pt.tok_s_device:.1f} tok/s/device"
