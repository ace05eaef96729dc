"""`moeswap plan` command line: `add_parser(subparsers)` adds the subcommand, `run(args)` executes it.

A thin layer: flags map 1:1 onto PlanRequest fields; PlanError prints as one line (no traceback
unless --debug) and returns exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moeswap import jsonio
from moeswap.options import EXPERT_GPU_MIN_TOKENS

from .errors import PlanError
from .workload import (
    COMPUTE,
    DENSE_FORMATS,
    LORA_TARGETS,
    OFFLOAD_COMPUTE,
    WEIGHT_FORMATS,
    Lora,
    Offload,
    Precision,
    Serve,
)


def _ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    return vals


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan", help="plan memory, layout and speed of a model on given hardware",
        description="Size memory per device, enumerate TP/EP/PP/DP layouts, predict serving or LoRA speed.",
    )
    g = p.add_argument_group("what and where")
    g.add_argument("--model", default="kimi-k3", help="preset (kimi-k3, kimi-linear-48b), model dir or config.json")
    g.add_argument("--hardware", help="system name, accelerator name, a .toml file, or 'local' (measures this machine)")
    g.add_argument("--box", help="instead of --hardware, one machine in a line: cores=16,ram=256GB,drive=7GB/s"
                   "[,mem_bw=80GB/s][,disk=4TB][,gpu=h100], or a TOML file with those keys (docs/planner.md)")
    g.add_argument("--devices", type=int, help="number of accelerators (default: one server's worth)")
    g.add_argument("--workload", choices=("serve", "lora"), default="serve")
    g.add_argument("--layout", help="check one layout, e.g. tp8, pp4xtp8, tp16/ep16, r2,tp8,dcp (default: all)")
    g.add_argument("--objective", choices=("throughput", "latency", "cost"), default="throughput")
    g.add_argument("--catalog", action="append", default=[], help="extra hardware TOML file (repeatable)")
    g.add_argument("--engine", help="engine profile from the catalog (default: the system's)")
    g.add_argument("--price-per-hour", type=float, help="USD per device-hour, for --objective cost")
    g.add_argument("--list-hardware", action="store_true", help="list known systems and accelerators and exit")

    s = p.add_argument_group("serving")
    s.add_argument("--isl", type=int, default=8192, help="input tokens per request")
    s.add_argument("--osl", type=int, default=1024, help="output tokens per request")
    s.add_argument("--concurrency", type=_ints, default=(1, 16, 64), help="requests in flight, e.g. 1,16,64")
    s.add_argument("--context", type=int, help="cache tokens to reserve per sequence (default isl+osl)")
    s.add_argument("--arrival", choices=("burst", "steady"), default="burst")
    s.add_argument("--tpot-slo", type=float, help="only count concurrency points with TPOT <= this many ms")

    lo = p.add_argument_group("LoRA")
    lo.add_argument("--rank", type=int, default=16)
    lo.add_argument("--lora-targets", default="attn,mlp", help=f"comma list of {', '.join(LORA_TARGETS)}")
    lo.add_argument("--seq-len", type=int, default=4096)
    lo.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch per replica")
    lo.add_argument("--grad-accum", type=int, default=8, help="micro-batches per optimizer step per replica")
    lo.add_argument("--no-checkpointing", action="store_true")

    pr = p.add_argument_group("precision and parallelism")
    pr.add_argument("--experts", choices=WEIGHT_FORMATS, help="routed expert weights (default: as the checkpoint stores them)")
    pr.add_argument("--dense", choices=DENSE_FORMATS, default="bf16",
                    help="all other weights as moeswap runs them: bf16, int8 (a scale per row), int4 (a scale per 32); "
                         "fp8 only as a block-FP8 checkpoint (DeepSeek-V3, Kimi K2) stores them")
    pr.add_argument("--kv-cache", choices=("bf16", "fp8"), default="bf16")
    pr.add_argument("--expert-matmul", choices=COMPUTE, default="bf16", help="dtype the expert matmuls run in (where they run: --offload-compute)")
    pr.add_argument("--expert-kernel", choices=("fused", "materialize"), default="fused",
                    help="dequantise experts inside the GEMM, or write bf16 first")
    pr.add_argument("--pp-split", choices=("block", "layer"), default="block",
                    help="pipeline stages own whole 12-layer AttnRes blocks, or any layers")
    pr.add_argument("--dcp", action="store_true", help="split the MLA cache over TP ranks")

    o = p.add_argument_group("expert offload")
    o.add_argument("--spill", choices=("none", "host", "nvme"), default="none",
                   help="where experts that do not fit in HBM may live")
    o.add_argument("--offload-compute", choices=OFFLOAD_COMPUTE, default="swap",
                   help="swap spilled experts into HBM, run them on the host CPU, or auto: the host for passes "
                        f"under {EXPERT_GPU_MIN_TOKENS} tokens (decode), swap for longer ones (prefill), as "
                        "`--expert-compute gpu|cpu|auto` of generate/serve runs them")
    o.add_argument("--hit-rate", type=float, help="expert-cache hit rate (default: resident fraction, uniform routing)")
    o.add_argument("--trace", help="routing trace from `moeswap trace` (trace.bin), or JSON "
                   "{\"expert_counts\": [[count per expert] per layer]}, for hit rates")
    o.add_argument("--swap-overlap", type=float, default=0.0, help="fraction of swap time hidden by prefetch")

    l = p.add_argument_group("--hardware local")
    l.add_argument("--hardware-file", help="where to save/load the measurement (default ~/.cache/moeswap/hardware-local.toml)")
    l.add_argument("--remeasure", action="store_true", help="measure again even if the file exists")
    l.add_argument("--local-device", choices=("cpu", "cuda"), default="cpu", help="what to measure")

    out = p.add_argument_group("output")
    out.add_argument("--top", type=int, default=10, help="layouts to show")
    out.add_argument("--json", help="write the plan as JSON here")
    out.add_argument("--markdown", help="write a markdown report here")
    out.add_argument("--plots", help="write PNG plots into this folder")
    out.add_argument("--show-rejected", action="store_true", help="list every rejected layout and why")
    out.add_argument("--debug", action="store_true", help="show tracebacks")
    p.set_defaults(func=run)
    return p


def _trace(path: str) -> tuple[tuple[float, ...], ...]:
    from moeswap.experts.trace import is_trace_file, read_trace  # torch-free

    if is_trace_file(path):  # a routing trace from `moeswap trace` (trace.bin): its per-layer expert counts
        try:
            return tuple(tuple(float(x) for x in layer) for layer in read_trace(path).expert_counts())
        except ValueError as e:
            raise PlanError(f"--trace {e}") from None
    try:
        data = json.loads(Path(path).read_text())
        counts = data["expert_counts"]
        return tuple(tuple(float(x) for x in layer) for layer in counts)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PlanError(f"--trace {path}: expected JSON {{\"expert_counts\": [[...], ...]}} ({e})") from None


def request_from_args(args: argparse.Namespace, catalog):
    """PlanRequest from parsed flags; `catalog` already holds --catalog files and any local measurement."""
    from .hardware import resolve_hardware
    from .plan import PlanRequest

    if not args.hardware:
        raise PlanError("--hardware or --box is required (a system name, a .toml file or 'local'; --list-hardware "
                        "lists them; --box cores=16,ram=256GB,drive=7GB/s describes one machine)")
    devices = args.devices
    if devices is None:  # one server's worth
        devices = resolve_hardware(args.hardware, catalog, args.engine).system.node_devices
    return PlanRequest(
        model=args.model, hardware=args.hardware, devices=devices, workload=args.workload,
        serve=Serve(isl=args.isl, osl=args.osl, concurrency=args.concurrency, context=args.context,
                    arrival=args.arrival),
        lora=Lora(rank=args.rank, targets=tuple(t.strip() for t in args.lora_targets.split(",") if t.strip()),
                  seq_len=args.seq_len, micro_batch=args.micro_batch, grad_accum=args.grad_accum,
                  checkpointing=not args.no_checkpointing),
        precision=Precision(experts=args.experts, dense=args.dense, kv_cache=args.kv_cache,
                            expert_matmul=args.expert_matmul, expert_kernel=args.expert_kernel),
        offload=Offload(spill=args.spill, compute=args.offload_compute, hit_rate=args.hit_rate,
                        trace_counts=_trace(args.trace) if args.trace else (), swap_overlap=args.swap_overlap),
        layout=args.layout, objective=args.objective, pp_split=args.pp_split, dcp=args.dcp, engine=args.engine,
        price_per_hour=args.price_per_hour, tpot_slo_ms=args.tpot_slo, local_path=args.hardware_file,
    )


def _catalog(args: argparse.Namespace):
    from .hardware import builtin_catalog

    cat = builtin_catalog()
    for f in args.catalog:
        cat.add_file(f)
    if args.hardware == "local":
        from .local import load_or_measure

        load_or_measure(cat, args.hardware_file, args.remeasure, args.local_device)
    if getattr(args, "box", None):
        from .box import add_box, parse_box

        if args.hardware:
            raise PlanError(f"give --hardware or --box, not both (--hardware {args.hardware}, --box {args.box})")
        args.hardware = add_box(cat, parse_box(args.box), args.engine)
    return cat


def _list_hardware(cat) -> str:
    lines = ["systems (--hardware NAME):"]
    for sid in cat.names("system"):
        s = cat.get("system", sid)
        a = cat.get("accelerator", s.accelerator)
        lines.append(f"  {sid:24s} {s.name}; {a.memory_gb:g} GB per device")
    lines.append("accelerators (usable as --hardware when one system uses them): " + ", ".join(cat.names("accelerator")))
    lines.append("engine profiles (--engine): " + ", ".join(cat.names("engine")))
    lines.append("'local' measures this machine; a .toml file adds your own (see docs/planner.md)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        if args.list_hardware:
            args.hardware = None
            print(_list_hardware(_catalog(args)))
            return 0
        from . import report
        from .plan import plan

        cat = _catalog(args)
        result = plan(request_from_args(args, cat), cat)
        print(report.terminal(result, top=args.top, show_rejected=args.show_rejected))
        if args.json:
            Path(args.json).write_text(jsonio.dumps(report.to_dict(result), indent=1, default=float))
            print(f"wrote {args.json}")
        if args.markdown:
            Path(args.markdown).write_text(report.markdown(result, top=args.top))
            print(f"wrote {args.markdown}")
        if args.plots:
            from .plots import write_plots

            files, why = write_plots(result, args.plots)
            print(why or "wrote " + ", ".join(str(f) for f in files))
        return 0
    except PlanError as e:
        if getattr(args, "debug", False):
            raise
        print(f"moeswap: error: {e}", file=sys.stderr)  # one prefix for every command
        return 2


def main(argv: list[str] | None = None) -> int:
    """`python -m moeswap.planner [plan] ...` until the lead wires `plan` into moeswap's own CLI."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plan"]:
        argv = argv[1:]
    parser = argparse.ArgumentParser(prog="moeswap")
    sub = parser.add_subparsers(dest="command")
    add_parser(sub)
    args = parser.parse_args(["plan", *argv])
    return args.func(args)
