"""`moeswap quantize SRC DST --experts mxfp4|mxfp8|int4|fp8 [--mode even|floor|rceil] [--dense int8|int4]`: the flags, the run
(quantize.quantize, then quantize.compare_models with --eval-tokens) and the printed report. The work itself
is moeswap/quantize.py. Entry points: `add_parser(subparsers)`, `run(args)`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moeswap import jsonio
from moeswap.atomic_dir import atomic_file
from moeswap.formats import mx
from moeswap.quantize import EXPERT_CHOICES, EXPERT_PATTERN, REPORT_NAME, QuantizeOptions, compare_models, quantize
from moeswap.weights.dense_quant import FORMATS as DENSE_CHOICES


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("quantize", help="store a checkpoint's routed experts as MXFP4, MXFP8, INT4 or block FP8 "
                                               "(+ error report)")
    p.add_argument("src", help="model directory (bf16, block-FP8 or compressed-tensors checkpoint)")
    p.add_argument("dst", help="output directory (must not exist or be empty)")
    p.add_argument("--experts", required=True, choices=EXPERT_CHOICES,
                   help="format of the routed experts (fp8: DeepSeek block FP8, E4M3 with fp32 scales per 128x128)")
    p.add_argument("--mode", default="even", choices=mx.MODES,
                   help="block scale rule: even (compressed-tensors, default), floor (OCP spec), rceil (never clips)")
    p.add_argument("--expert-pattern", default=EXPERT_PATTERN, help="regex matching routed-expert module names")
    p.add_argument("--dense", choices=tuple(DENSE_CHOICES), default=None,
                   help="also store the large dense matrices (attention, MLPs, shared experts, lm_head) as int8 (one "
                        "scale per row) or int4 (one per 32 inputs): what --dense-weights makes at load, bit for bit")
    p.add_argument("--eval-tokens", type=int, default=0, metavar="N",
                   help="afterwards, compare logits with the source on N random tokens (both must load in moeswap)")
    p.add_argument("--json", action="store_true", help="print the whole report as JSON")


def run(args: argparse.Namespace) -> int:
    options = QuantizeOptions(args.experts, args.mode, args.expert_pattern, progress=sys.stderr.isatty(),
                              dense=args.dense)
    report = quantize(args.src, args.dst, options)
    if args.eval_tokens > 0:
        report["quality"] = compare_models(args.src, args.dst, tokens=args.eval_tokens)
        with atomic_file(Path(args.dst) / REPORT_NAME) as f:
            f.write((jsonio.dumps(report, indent=2) + "\n").encode())
    print(jsonio.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def format_report(report: dict) -> str:
    s = report["summary"]
    lines = [f"wrote {report['destination']}: routed experts as {report['format']} ({report['mode']}) in "
             f"{report['seconds']:.1f}s; {s['bytes_in'] / 1e6:,.1f} MB -> {s['bytes_out'] / 1e6:,.1f} MB of tensors"]
    lines.append(f"expert weights: {s['encoded']} encoded, {s['copied']} copied unchanged")
    if s["encoded"]:
        lines.append(f"relative error (||Q - W|| / ||W||): mean {s['mean_rel_error']:.4g}, "
                     f"max {s['max_rel_error']:.4g} "
                     f"({s['worst_tensor']}); max abs error {s['max_abs_error']:.4g}")
        worst = sorted((r for r in report["tensors"] if r["action"] == "encoded"), key=lambda r: -r["rel_error"])[:5]
        lines += ["| tensor | shape | rel error | max abs error |", "|---|---|---:|---:|"]
        lines += [f"| {r['name']} | {r['shape']} | {r['rel_error']:.4g} | {r['max_abs_error']:.4g} |" for r in worst]
    if "dense" in report:
        d = report["dense"]["summary"]
        lines.append(f"dense weights as {report['dense']['format']}: {d['encoded']} encoded, "
                     f"{d['bytes_in'] / 1e6:,.1f} MB -> {d['bytes_out'] / 1e6:,.1f} MB"
                     + (f"; relative RMS error mean {d['mean_rel_error']:.4g}, max {d['max_rel_error']:.4g} "
                        f"({d['worst_tensor']}); max abs error {d['max_abs_error']:.4g}" if d["encoded"] else ""))
    if report["dequantized_to_bf16"]:
        lines.append(f"{len(report['dequantized_to_bf16'])} quantised non-expert weights written as bf16")
    if "quality" in report:
        q = report["quality"]
        lines.append(f"vs source on {q['tokens']} tokens: logit rel error {q['logit_rel_error']:.4g}, max abs "
                     f"{q['logit_max_abs_error']:.4g}, top-1 agreement {q['top1_agreement']:.1%}, greedy "
                     f"{q['greedy_identical_prefix']}/{q['greedy_tokens']} identical tokens before the first "
                     f"difference")
    lines.append(f"per-tensor report: {Path(report['destination']) / REPORT_NAME}")
    return "\n".join(lines)
