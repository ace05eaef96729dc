"""`moeswap train [CONFIG.yaml] [flags]`, `--resume`, `--reproduce MANIFEST`: parses, runs train.loop, prints.

Torch-free at import (cli.py builds every subcommand's parser). A config or data error is one line and
exit 2 (cli.main); a reproduction whose curve differs exits 1.
"""

from __future__ import annotations

import argparse
import sys

from moeswap.train.config import add_train_flags, resolve


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="fine-tune a model (LoRA or full) from JSONL text or chat data",
                       description="Train from CONFIG.yaml and/or flags (a flag wins over the file). Writes the "
                                   "adapter or trained weights, manifest.json, loss.csv and loss.png to --output.")
    p.add_argument("config", nargs="?", metavar="CONFIG.yaml", help="settings file (keys: the flags' names with _)")
    p.add_argument("--resume", action="store_true", help="continue the run in --output from its newest checkpoint")
    p.add_argument("--reproduce", metavar="MANIFEST",
                   help="run a finished run's manifest.json again into --output and check its loss curve")
    p.add_argument("--tolerance", type=float, default=0.0,
                   help="--reproduce: largest absolute loss difference accepted (default 0: identical)")
    p.add_argument("--first-steps", type=int, metavar="N",
                   help="--reproduce: run and check only the first N steps, on the recorded schedule (minutes "
                        "instead of the whole run; writes no model)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (default: one on a terminal)")
    add_train_flags(p)


def run(args: argparse.Namespace) -> int:
    from moeswap.train import loop

    progress = False if args.no_progress else None
    if args.reproduce:
        return _reproduce(args, progress)
    if args.first_steps is not None:
        raise ValueError("--first-steps goes with --reproduce MANIFEST")
    cfg = resolve(args.config, args)
    result = loop.train(cfg, resume=args.resume, progress=progress)
    m = result.manifest
    if not m:  # a rank other than 0 under torchrun: rank 0 reports
        return 0
    rate = m["tokens_per_s"]
    print(f"trained {m['steps']} steps, {m['tokens']} tokens in {m['wall_s']:.1f}s"
          + (f" ({rate:.0f} tokens/s)" if rate else "")
          + f"; loss {m['curve'][0]['loss']:.4f} -> {m['curve'][-1]['loss']:.4f}"
          + (f"; eval {m['eval_loss_before']:.4f} -> {m['eval_loss_after']:.4f}"
             if m["eval_loss_before"] is not None else "")
          + f"; wrote {result.out_dir}")
    return 0


def _reproduce(args: argparse.Namespace, progress) -> int:
    from moeswap.train import loop
    from moeswap.train.config import given_flags

    extra = sorted(set(given_flags(args)) - {"output"})
    if args.config or args.resume or extra:
        what = "CONFIG.yaml" if args.config else "--resume" if args.resume else "--" + extra[0].replace("_", "-")
        raise ValueError(f"--reproduce takes the manifest's settings; {what} cannot be given with it "
                         "(only --output)")
    output = getattr(args, "output", None)
    if output is None:
        raise ValueError("--reproduce needs --output DIR for the new run")
    ok, message, _ = loop.reproduce(args.reproduce, output, tolerance=args.tolerance, progress=progress,
                                    first_steps=args.first_steps)
    print(("reproduced: " if ok else "NOT reproduced: ") + message, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1
