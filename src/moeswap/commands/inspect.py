"""`moeswap inspect MODEL [--json] [--verify]`: the flags and the printed result of summary.summarize (headers
only) and, with --verify, verify.verify (every tensor and file; exit 2 on any problem). Entry points:
`add_parser(subparsers)`, `run(args)`.
"""

from __future__ import annotations

import argparse
import sys

from moeswap.hub import resolve_model
from moeswap.jsonio import dumps


def add_parser(sub) -> None:
    p = sub.add_parser("inspect", help="architecture summary, parameters and bytes by component and precision")
    p.add_argument("model", type=resolve_model, help="model directory, or a Hugging Face name ORG/NAME[@REVISION] "
                                                      "from its cache")
    p.add_argument("--json", action="store_true")
    p.add_argument("--verify", action="store_true",
                   help="also read every tensor and file: non-finite values, MX scales out of range, SHA-256 against "
                        "*.sha256 / SHA256SUMS / manifest.json beside the checkpoint (exit 2 on any problem)")


def run(args: argparse.Namespace) -> int:
    from moeswap.summary import format_summary, summarize

    s = summarize(args.model)
    if not args.verify:
        print(dumps(s, indent=2) if args.json else format_summary(s))
        return 0
    from moeswap.verify import format_verify, summary_line, verify

    v = verify(args.model, progress=sys.stderr.isatty())
    print(dumps({**s, "verify": v}, indent=2) if args.json else
          f"{format_summary(s)}\n\n{format_verify(v)}")
    if v["ok"]:
        return 0
    print(f"moeswap: error: {summary_line(v)}", file=sys.stderr)
    return 2
