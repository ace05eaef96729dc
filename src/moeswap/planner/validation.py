"""Validation: the planner's predictions against every published figure in shared/docs/hardware.md.

Published figures are data (CASES); each carries the request that reproduces its setting and says
which settings are assumptions. Nothing here is fitted: the engine profile's constants are fixed in
catalog/engines.toml. `python -m moeswap.planner.validation` prints the markdown table for the docs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources

from .layouts import parse_layout
from .lora import LoraPoint
from .plan import PlanRequest, PlanResult, plan
from .serving import ServePoint
from .workload import Lora, Offload, Precision, Serve


def _proxy(name: str) -> str:
    return str(resources.files("moeswap.planner") / "presets" / f"{name}.json")


def _at(c: int) -> Callable[[PlanResult], ServePoint]:
    return lambda r: next(p for p in r.best.points if p.concurrency == c)


def _at_c(c: int, value: Callable[[ServePoint], float]) -> Callable[[PlanResult], float]:
    return lambda r: value(_at(c)(r))


def _lora(r: PlanResult) -> LoraPoint:
    assert r.best.lora is not None  # a LoRA request's candidates carry their LoRA point
    return r.best.lora


@dataclass(frozen=True)
class Figure:
    metric: str
    kind: str  # "decode" (TPOT, output rate) | "prefill" (TTFT, prefill rate) | "throughput" | "lora"
    published: float
    pick: Callable[[PlanResult], float]


@dataclass(frozen=True)
class Case:
    name: str
    request: PlanRequest
    figures: tuple[Figure, ...]
    assumptions: str = ""


def _mi350x() -> Case:
    figs = []
    for c, ttft, tpot, tps in ((1, 590, 18.55, 58), (16, 6331, 32.80, 462), (64, 18665, 70.39, 813)):
        figs += [
            Figure(f"TTFT ms @ c={c}", "prefill", ttft, _at_c(c, lambda p: p.ttft * 1e3)),
            Figure(f"TPOT ms @ c={c}", "decode", tpot, _at_c(c, lambda p: p.tpot * 1e3)),
            Figure(f"tok/s per GPU @ c={c}", "throughput", tps, _at_c(c, lambda p: p.tok_s_device)),
        ]
    return Case(
        "SGLang, 8 x MI350X, TP8/DCP8, MXFP4, ISL 8192 / OSL 1024",
        PlanRequest(hardware="mi350x", devices=8, layout="tp8,dcp", serve=Serve(8192, 1024, (1, 16, 64))),
        tuple(figs),
        "tok/s per GPU read as (input + output) tokens / s / GPU, which the published TTFT/TPOT reproduce; "
        "benchmark waves of `c` requests arriving together",
    )


def _gb200() -> list[Case]:
    out = []
    for lay, split, pub in (("pp16", "layer", 4550), ("pp8xtp2", "block", 3596), ("tep16", "block", 2407),
                            ("tp16", "block", 1652)):
        name = parse_layout(lay).name
        out.append(Case(
            f"SGLang, 16 x GB200, prefill ISL 8192, conc 32, {name}",
            PlanRequest(hardware="gb200-nvl72", devices=16, layout=lay, pp_split=split,
                        serve=Serve(8192, 1, (32,))),
            (Figure("prefill tok/s per GPU", "prefill", pub, lambda r: _at(32)(r).tok_s_device),),
            "16 GPUs of one NVL72 rack; one output token per request" + (
                "; PP16 splits inside AttnRes blocks (--pp-split layer), as the published run must" if split == "layer" else ""),
        ))
    return out


def _mi325x() -> Case:
    return Case(
        "custom engine, 8 x MI325X, TP8, FP8 MLA KV, ISL 32 / OSL 2048, conc 32",
        PlanRequest(hardware="mi325x", devices=8, layout="tp8", serve=Serve(32, 2048, (32,)),
                    precision=Precision(kv_cache="fp8", expert_kernel="materialize")),
        (Figure("output tok/s (all GPUs)", "decode", 131, lambda r: _at(32)(r).out_tok_s),
         Figure("TPOT ms (p50)", "decode", 238, lambda r: _at(32)(r).tpot * 1e3)),
        "MXFP4 decoded to bf16 in software modelled as one bf16 write + read of each touched expert per step; "
        "mean TPOT compared with the published median",
    )


def _lora_cases() -> list[Case]:
    kt = Offload(spill="host", compute="host")
    return [
        Case(
            "KTransformers LoRA, DeepSeek-V3 671B (proxy), r=8, qlen 512, 1 GPU + Xeon AMX host",
            PlanRequest(model=_proxy("deepseek_v3_proxy"), hardware="h100", devices=1, workload="lora",
                        lora=Lora(rank=8, seq_len=512, grad_accum=1, checkpointing=False),
                        precision=Precision(experts="bf16"), offload=kt),
            (Figure("LoRA tok/s", "lora", 40.35, lambda r: _lora(r).tok_s),),
            "GPU taken as an 80 GB H100 (~70 GB used); bf16 experts computed on the 2-socket Sapphire Rapids "
            "host (1.2-1.3 TB RAM used); one 512-token sequence per step",
        ),
        Case(
            "KTransformers-style LoRA, Qwen3-235B (proxy), 2 GPUs + host",
            PlanRequest(model=_proxy("qwen3_235b_proxy"), hardware="h100", devices=2, layout="tp2", workload="lora",
                        lora=Lora(rank=8, seq_len=512, grad_accum=1, checkpointing=False),
                        precision=Precision(experts="bf16"), offload=kt),
            (Figure("LoRA tok/s", "lora", 147.9, lambda r: _lora(r).tok_s),),
            "GPU model, sequence length and CPU not published: 2 H100s as TP2, 512-token sequences and the H100 "
            "server's host assumed; bf16 experts computed on the host",
        ),
        Case(
            "ms-swift Megatron LoRA, Qwen3-235B (proxy), 8 x 80 GB, mbs 8, seq 2048",
            PlanRequest(model=_proxy("qwen3_235b_proxy"), hardware="h100", devices=8, workload="lora",
                        lora=Lora(rank=8, seq_len=2048, micro_batch=8, grad_accum=1),
                        precision=Precision(experts="bf16")),
            (Figure("seconds per iteration", "lora", 3.2, lambda r: _lora(r).step_s),),
            "one iteration = 8 sequences of 2048 tokens over the 8 GPUs; bf16 weights; best layout chosen by "
            "the planner (Megatron's actual parallel sizes not published)",
        ),
    ]


def cases() -> list[Case]:
    return [_mi350x(), *_gb200(), _mi325x(), *_lora_cases()]


@dataclass
class Row:
    case: str
    metric: str
    kind: str
    published: float
    predicted: float

    @property
    def error(self) -> float:
        return (self.predicted - self.published) / self.published


def run(selected: list[Case] | None = None) -> list[Row]:
    rows = []
    for case in selected or cases():
        result = plan(case.request)
        rows += [Row(case.name, f.metric, f.kind, f.published, f.pick(result)) for f in case.figures]
    return rows


# Published deployments (kimi_k3.md §8): does the planner find them feasible, and what does it predict?
DEPLOYMENTS = (
    ("8 x B300, TP8", "b300", 8, "tp8"),
    ("16 x GB300", "gb300-nvl72", 16, None),
    ("16 x H200, TP16/EP16", "h200", 16, "tp16/ep16"),
    ("32 x H200, TP8 x PP4", "h200", 32, "pp4xtp8"),
    ("4 x Atlas 800 A3 (64 cards)", "atlas-800-a3", 64, None),
)


def deployments() -> list[dict]:
    out = []
    for name, hw, n, lay in DEPLOYMENTS:
        r = plan(PlanRequest(hardware=hw, devices=n, layout=lay, serve=Serve(8192, 1024, (1, 64))))
        c = r.best
        out.append({"deployment": name, "layout": c.layout.name, "max_concurrency": c.max_concurrency,
                    "gb_per_device": c.worst_memory.used / 1e9, "capacity_gb": c.worst_memory.capacity / 1e9,
                    "tpot_ms_c1": c.points[0].tpot * 1e3, "tpot_ms_c64": c.points[1].tpot * 1e3,
                    "tok_s_device_c64": c.points[1].tok_s_device})
    return out


def markdown(rows: list[Row]) -> str:
    lines = ["| case | metric | kind | published | predicted | error |", "|---|---|---|---:|---:|---:|"]
    for r in rows:
        pred = f"{r.predicted:.0f}" if r.predicted >= 100 else f"{r.predicted:.3g}"
        lines.append(f"| {r.case} | {r.metric} | {r.kind} | {r.published:g} | {pred} | {r.error:+.0%} |")
    return "\n".join(lines)


def main() -> None:
    rows = run()
    print(markdown(rows))
    print()
    for case in cases():
        if case.assumptions:
            print(f"- {case.name}: {case.assumptions}")
    print()
    print("| deployment | layout | GB/device used | max concurrency (9216-token context) | TPOT c=1 ms | TPOT c=64 ms | tok/s/device c=64 |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for d in deployments():
        print(f"| {d['deployment']} | {d['layout']} | {d['gb_per_device']:.0f} of {d['capacity_gb']:.0f} | "
              f"{d['max_concurrency']} | {d['tpot_ms_c1']:.1f} | {d['tpot_ms_c64']:.1f} | {d['tok_s_device_c64']:.0f} |")


if __name__ == "__main__":
    main()
