"""Render a PlanResult: terminal table, markdown report, JSON-ready dict.

Knows nothing of how the numbers were computed. Entry points: `terminal`, `markdown`, `to_dict`.
"""

from __future__ import annotations

from typing import Any

from .plan import Candidate, PlanResult

GB = 1e9


def _fmt_params(n: float) -> str:
    return f"{n / 1e12:.3f}T" if n >= 1e12 else f"{n / 1e9:.2f}B"


def _header(r: PlanResult) -> list[str]:
    s, hw, req = r.sizes, r.hardware, r.request
    lines = [
        f"model {r.model_label}: {_fmt_params(s['total_params'])} params ({_fmt_params(s['routed_params'])} in "
        f"{int(s['experts'])} routed experts, {_fmt_params(s['non_expert_params'])} other), "
        f"{_fmt_params(s['active_params'])} active/token; weights {s['weight_bytes'] / GB:.1f} GB "
        f"({req.precision.experts} experts {s['expert_bytes'] / 1e6:.2f} MB each, {req.precision.dense} dense)",
        f"per sequence: MLA cache {s['mla_cache_bytes_per_token'] / 1024:.2f} KiB/token, KDA state "
        f"{s['kda_state_bytes_per_seq'] / 2**20:.0f} MiB + conv {s['kda_conv_bytes_per_seq'] / 2**20:.1f} MiB",
        f"hardware {hw.name}: {req.devices} x {hw.accel.name} ({hw.accel.memory_gb:g} GB); weights alone need "
        f"{s['devices_for_weights']:.1f} devices' memory; engine profile '{hw.engine.id}'",
    ]
    if req.workload == "serve":
        sv = req.serve
        lines.append(f"workload serve: ISL {sv.isl}, OSL {sv.osl}, context {sv.ctx}, concurrency "
                     f"{','.join(map(str, sv.concurrency))}, arrival {sv.arrival}; objective {req.objective}")
    else:
        lo = req.lora
        lines.append(f"workload lora: rank {lo.rank} on {','.join(lo.targets)}, {lo.micro_batch} x {lo.seq_len} "
                     f"tokens per micro-batch, {lo.grad_accum} micro-batches/step, checkpointing "
                     f"{'on' if lo.checkpointing else 'off'}; objective {req.objective}")
    return lines


def _sig(x: float) -> str:
    """Three significant digits: output rates run from a fraction of a token/s (a drive-bound box) to 10^5."""
    return f"{x:.3g}" if x < 1000 else f"{x:.0f}"


def decode_rate(c: Candidate) -> tuple[int, float, float]:
    """(concurrency, seconds per decode step, output tokens/s while decoding = concurrency / step) at the
    largest concurrency that fits: every sequence gains one token per step."""
    p = max((p for p in c.points if p.fits), key=lambda p: p.concurrency)
    return p.concurrency, p.step, p.concurrency / p.step


def _mem_cell(c: Candidate) -> str:
    m = c.worst_memory
    cell = f"{m.used / GB:.0f}/{m.capacity / GB:.0f}"
    if m.expert_need and m.resident_fraction < 1:
        cell += f" ({m.resident_fraction:.0%} exp)"
    return cell


def rows(r: PlanResult, top: int) -> tuple[list[str], list[list[str]]]:
    if r.request.workload == "serve":
        head = ["#", "layout", "stages", "GB/device", "max conc"]
        for conc in r.request.serve.concurrency:
            head += [f"c={conc} TTFT s", "TPOT ms", "tok/s/dev", "out tok/s"]
        body = []
        for i, c in enumerate(r.candidates[:top], 1):
            row = [str(i), c.layout.name, "/".join(str(len(s)) for s in c.stages), _mem_cell(c), str(c.max_concurrency)]
            for p in c.points:
                mark = "" if p.fits else "*"
                row += [f"{p.ttft:.2f}{mark}", f"{p.tpot * 1e3:.1f}{mark}", f"{p.tok_s_device:.0f}{mark}",
                        f"{_sig(p.out_tok_s)}{mark}"]
            body.append(row)
        return head, body
    head = ["#", "layout", "stages", "GB/device", "hit rate", "step s", "tok/s", "tok/s/dev", "swap GB/step/dev"]
    body = []
    for i, c in enumerate(r.candidates[:top], 1):
        lp = c.lora
        assert lp is not None  # a LoRA request's candidates carry their LoRA point
        body.append([str(i), c.layout.name, "/".join(str(len(s)) for s in c.stages), _mem_cell(c),
                     f"{c.hit_rate:.2f}", f"{lp.step_s:.2f}", f"{lp.tok_s:.0f}", f"{lp.tok_s_device:.1f}",
                     f"{lp.swap_bytes_device / GB:.0f}"])
    return head, body


def _table(head: list[str], body: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return [line(head), line(["-" * w for w in widths])] + [line(r) for r in body]


def _breakdown(c: Candidate) -> list[str]:
    out = []
    for m in c.memory:
        parts = ", ".join(f"{k} {v / GB:.1f}" for k, v in m.parts.items() if v >= 0.05 * GB)
        where = ""
        if m.expert_host and m.expert_nvme:
            where = f"; experts also in host {m.expert_host / GB:.0f} GB, NVMe {m.expert_nvme / GB:.0f} GB per device"
        elif m.expert_host or m.expert_nvme:
            where = (f"; experts also in host {m.expert_host / GB:.0f} GB per device" if m.expert_host else
                     f"; experts also on the drive {m.expert_nvme / GB:.0f} GB per device")
        out.append(f"  stage {m.stage} (layers {c.stages[m.stage].start}-{c.stages[m.stage].stop - 1}): "
                   f"{m.used / GB:.1f} of {m.capacity / GB:.0f} GB: {parts}{where}")
    return out


def terminal(r: PlanResult, top: int = 10, show_rejected: bool = False) -> str:
    lines = _header(r) + [""]
    head, body = rows(r, top)
    lines += _table(head, body)
    if r.request.workload == "serve" and any(not p.fits for c in r.candidates[:top] for p in c.points):
        lines.append("* concurrency beyond what fits in memory (shown for comparison)")
    best = r.best
    lines += ["", f"best by {r.request.objective}: {best.layout.name} ({best.score_label}); memory per device:"]
    lines += _breakdown(best)
    if best.decode_cost is not None:
        parts = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in best.decode_cost.parts.items() if v > 0)
        conc, step, rate = decode_rate(best)
        lines.append(f"  decode step at c={conc} (ms, bottleneck stage): {parts}")
        lines.append(f"  decoding: {step:.4g} s per step of {conc} sequence{'s' if conc > 1 else ''} = "
                     f"{_sig(rate)} output tok/s")
    if best.lora is not None:
        parts = ", ".join(f"{k} {v:.3f}" for k, v in best.lora.micro_batch_cost.parts.items() if v > 0)
        lines.append(f"  one micro-batch fwd+recompute+bwd (s, bottleneck stage): {parts}")
        lines.append(f"  without per-layer expert reuse in backward: {best.lora.step_s_no_reuse:.2f} s/step")
    lines.append(f"{len(r.rejected)} layouts rejected" + ("" if show_rejected else " (--show-rejected lists why)"))
    if show_rejected:
        lines += [f"  {name}: {why}" for name, why in r.rejected]
    if r.assumptions:
        lines.append(f"{len(r.assumptions)} hardware numbers behind this plan are assumptions, not published figures:")
        lines += [f"  {a}" for a in r.assumptions]
    return "\n".join(lines)


def markdown(r: PlanResult, top: int = 10) -> str:
    out = [f"# moeswap plan: {r.model_label} on {r.request.devices} x {r.hardware.name}", ""]
    out += [f"- {l}" for l in _header(r)] + [""]
    head, body = rows(r, top)
    out.append("| " + " | ".join(head) + " |")
    out.append("|" + "---|" * len(head))
    out += ["| " + " | ".join(row) + " |" for row in body]
    best = r.best
    out += ["", f"## Best by {r.request.objective}: {best.layout.name}", "", best.score_label, ""]
    out += [f"- {l.strip()}" for l in _breakdown(best)]
    if r.rejected:
        out += ["", "## Rejected layouts", "", "| layout | why |", "|---|---|"]
        out += [f"| {n} | {w} |" for n, w in r.rejected]
    if r.assumptions:
        out += ["", "## Assumed hardware numbers", ""] + [f"- {a}" for a in r.assumptions]
    return "\n".join(out) + "\n"


def _candidate_dict(c: Candidate) -> dict[str, Any]:
    d: dict[str, Any] = {
        "layout": c.layout.name,
        "tp": c.layout.tp, "pp": c.layout.pp, "dp": c.layout.dp, "ep": c.layout.ep,
        "replicas": c.layout.replicas, "dcp": c.layout.dcp,
        "stage_layers": [[s.start, s.stop] for s in c.stages],
        "score": c.score, "score_label": c.score_label,
        "max_concurrency": c.max_concurrency, "expert_hit_rate": c.hit_rate,
        "memory_per_device": [
            {"stage": m.stage, "capacity_bytes": m.capacity, "used_bytes": m.used, "parts_bytes": m.parts,
             "expert_need_bytes": m.expert_need, "expert_host_bytes": m.expert_host,
             "expert_nvme_bytes": m.expert_nvme}
            for m in c.memory
        ],
    }
    if c.points:
        # a saturated point's queue grows without bound: no steady TTFT or TPOT (null; the model's inf)
        d["serve"] = [
            {"concurrency": p.concurrency, "fits": p.fits, "ttft_s": None if p.saturated else p.ttft,
             "tpot_s": None if p.saturated else p.tpot, "step_s": p.step,
             "tok_s_per_device": p.tok_s_device, "output_tok_s_per_device": p.out_tok_s_device,
             "output_tok_s": p.out_tok_s, "prefill_tok_s_per_device": p.prefill_tok_s_device,
             "saturated": p.saturated}
            for p in c.points
        ]
    if c.decode_cost is not None:
        d["decode_step_seconds"] = c.decode_cost.parts
    if c.lora is not None:
        p = c.lora
        d["lora"] = {"step_s": p.step_s, "tokens_per_step": p.tokens_per_step, "tok_s": p.tok_s,
                     "tok_s_per_device": p.tok_s_device, "swap_bytes_per_step_per_device": p.swap_bytes_device,
                     "swap_passes": p.swap_passes, "step_s_without_reuse": p.step_s_no_reuse,
                     "micro_batch_seconds": p.micro_batch_cost.parts}
    return d


def to_dict(r: PlanResult, top: int | None = None) -> dict[str, Any]:
    req = r.request
    return {
        "model": r.model_label,
        "hardware": {"system": r.hardware.name, "accelerator": r.hardware.accel.id, "devices": req.devices,
                     "engine": r.hardware.engine.id},
        "workload": req.workload,
        "objective": req.objective,
        "sizes": r.sizes,
        "candidates": [_candidate_dict(c) for c in r.candidates[:top]],
        "rejected": [{"layout": n, "why": w} for n, w in r.rejected],
        "assumptions": r.assumptions,
    }
