"""`moeswap init-tiny OUT [--arch] [--size] [--seed] [--quant] [--layers] [--experts]`: the flags and the printed line; the model and
its tokenizer are written by tiny/ (`write_tiny_model`). Entry points: `add_parser(subparsers)`, `run(args)`.
"""

from __future__ import annotations

import argparse
import time

from moeswap.archs import REGISTRY
from moeswap.tiny.sizes import SIZES


def add_parser(sub) -> None:
    p = sub.add_parser("init-tiny",
                       help="write a small random model in the published K3 / Kimi Linear / DeepSeek-V3 layout")
    p.add_argument("out", help="output directory (must not exist or be empty)")
    p.add_argument("--arch", default="kimi_k3", choices=tuple(REGISTRY))
    p.add_argument("--size", default="tiny", choices=tuple(SIZES),
                   help="tiny: tests; small: demo (~30 MB); bench: ~0.96 B parameters, 0.45 GB of MXFP4 experts; "
                        "k3-slice: Kimi K3's real widths, its first 4 layers with 304 experts each (16 GB of MXFP4 "
                        "experts and 10.4 GB of bf16 weights, 26.4 GB in all)")
    p.add_argument("--layers", type=int, default=None, help="layers instead of the size's (first dense, last MLA)")
    p.add_argument("--experts", type=int, default=None, help="routed experts a layer instead of the size's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quant", choices=("fp8", "int4"), default="",
                   help="deepseek_v3: fp8 = block-FP8 weights (float8 + weight_scale_inv per 128x128) as DeepSeek-V3 "
                        "and Kimi K2 ship them; int4 = compressed-tensors pack-quantized routed experts (K2-Thinking)")


def run(args: argparse.Namespace) -> int:
    from moeswap.tiny import write_tiny_model

    t0 = time.perf_counter()
    out = write_tiny_model(args.out, args.arch, args.size, args.seed, progress=args.size != "tiny", quant=args.quant,
                           layers=args.layers, experts=args.experts)
    quant = {"fp8": ", block FP8", "int4": ", INT4 experts"}.get(args.quant, "")
    print(f"wrote {args.arch} ({args.size}{quant}, seed {args.seed}) to {out} in {time.perf_counter() - t0:.1f}s")
    return 0
