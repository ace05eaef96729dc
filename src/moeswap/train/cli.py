"""`moeswap train [CONFIG.yaml] [flags]`, `--resume`, `--reproduce MANIFEST`: parses, runs train.loop, prints.

Torch-free at import (cli.py builds every subcommand's parser). A config or data error is one line and
exit 2 (cli.main); a reproduction whose curve differs exits 1. A run stopped by Ctrl-C or SIGTERM says the
command that continues it (exit 130; 143 for SIGTERM).
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import signal
import sys
import threading
from pathlib import Path

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
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (default: one on a terminal; without one, a line every --log-interval steps)")
    add_train_flags(p)


def run(args: argparse.Namespace) -> int:
    from moeswap.train import loop

    progress = False if args.no_progress else None
    if args.reproduce:
        return _reproduce(args, progress)
    if args.first_steps is not None:
        raise ValueError("--first-steps goes with --reproduce MANIFEST")
    cfg = resolve(args.config, args)
    try:
        with _sigterm_interrupts():
            result = loop.train(cfg, resume=args.resume, progress=progress)
    except KeyboardInterrupt:
        if cfg.output is not None:
            print("\n" + resume_hint(cfg, getattr(args, "argv", None)), file=sys.stderr)
        raise  # cli.main: "interrupted", exit 130 (SIGTERM: "terminated", 143)
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


def resume_hint(cfg, argv: list[str] | None) -> str:
    """What to run next after an interruption: the command as typed plus --resume when a checkpoint holds the
    run, else (no checkpoint yet) the same command, which starts it over."""
    from moeswap.train.checkpoint import latest_checkpoint, read_state

    found = latest_checkpoint(Path(cfg.output))
    words = ["moeswap", *(argv if argv is not None else ["train", "..."])]
    if found is None:
        return ("moeswap: stopped before its first checkpoint (--save-interval N writes one every N steps); "
                f"start it again with: {shlex.join(words)}")
    try:
        step = read_state(found)["step"]
    except ValueError:  # damaged: --resume will say so and what to do
        step = "?"
    if "--resume" not in words:
        words.append("--resume")
    return f"moeswap: stopped; the newest checkpoint is step {step} ({found}); continue with: {shlex.join(words)}"


class Terminated(KeyboardInterrupt):
    """SIGTERM's stop: a Ctrl-C for the run (it says how to resume), which cli.main reports as "terminated",
    exit 143 (128 + SIGTERM, what a shell reports for a process the signal ended; Ctrl-C is 130)."""

    exit_code = 128 + signal.SIGTERM
    what = "terminated"


@contextlib.contextmanager
def _sigterm_interrupts():
    """SIGTERM (a batch system's stop, `kill`) ends the run as Ctrl-C does, so it says how to resume."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise Terminated

    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


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
