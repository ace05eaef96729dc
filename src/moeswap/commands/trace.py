"""`moeswap trace MODEL --prompts FILE -o trace.bin`: record which experts a real run routes to.

Generates from each prompt of FILE (one per line) with a TraceRecorder on the expert store and writes
the (step, layer, experts) events as a routing trace (experts/trace.py), for `moeswap bench cache`,
`--expert-policy static --expert-profile` and the planner's `--trace`. Routing does not depend on the
cache, so the store flags only change how fast the recording runs. The output is checked before the model
loads (an existing file needs --force; a directory or the prompts file never) and written atomically.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from moeswap.options import LoadOptions, add_load_flags, add_model_argument


def add_parser(sub) -> None:
    p = sub.add_parser("trace", help="record a routing trace (step, layer, experts) of a real run")
    add_model_argument(p)
    p.add_argument("--prompts", required=True, metavar="FILE", help="text file with one prompt per line")
    p.add_argument("-o", "--out", required=True, metavar="TRACE", help="output file, e.g. trace.bin")
    p.add_argument("--force", action="store_true", help="overwrite TRACE if it exists")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per prompt (default 32)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    add_load_flags(p)


MAX_PROMPTS_BYTES = 256 << 20  # a prompts file past this is refused, not read (a device would never end)


def read_prompts(path: Path) -> list[str]:
    if path.is_dir() or not path.exists():
        found = "a directory" if path.is_dir() else "nothing"
        raise FileNotFoundError(f"--prompts {path}: expected a text file with one prompt per line, found {found}")
    if not path.is_file():  # /dev/zero, a FIFO: endless or blocking
        raise ValueError(f"--prompts {path}: expected a regular text file, found a device, FIFO or socket")
    with path.open("rb") as f:
        data = f.read(MAX_PROMPTS_BYTES + 1)
    if len(data) > MAX_PROMPTS_BYTES:
        raise ValueError(f"--prompts {path}: more than {MAX_PROMPTS_BYTES >> 20} MiB of prompts; trace a smaller file")
    try:
        prompts = [line for line in data.decode("utf-8").splitlines() if line.strip()]
    except UnicodeDecodeError as err:
        raise ValueError(f"--prompts {path}: not UTF-8 text (byte {err.object[err.start]:#04x} at offset "
                         f"{err.start})") from None
    if not prompts:
        raise ValueError(f"--prompts {path}: the file has no prompts (expected one per line)")
    return prompts


def check_output(out: Path, prompts: Path, force: bool) -> None:
    """Refuses, before anything runs, an output that is a directory, the prompts file, or (without
    --force) any existing file: a mistyped -o must not destroy a shard or the prompts."""
    if out.is_dir():
        raise ValueError(f"-o {out}: is a directory; give the trace a file name, e.g. -o {out / 'trace.bin'}")
    if not out.parent.is_dir():
        raise FileNotFoundError(f"-o {out}: directory {out.parent} does not exist")
    if not (out.exists() or out.is_symlink()):
        return
    try:
        same = os.path.samefile(out, prompts) or out.resolve() == prompts.resolve()
    except OSError:  # a dangling link
        same = out.resolve() == prompts.resolve()
    if same:
        raise ValueError(f"-o {out} is the --prompts file; write the trace to another file")
    if not force:
        raise FileExistsError(f"-o {out} exists; pass --force to overwrite it, or choose another file")


def run(args: argparse.Namespace) -> int:
    from moeswap.engine.generate import GenerationConfig, generate
    from moeswap.experts.trace import TraceRecorder, model_meta, write_trace
    from moeswap.models.loader import load_model
    from moeswap.text.tokenizer import load_tokenizer

    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    prompts = read_prompts(Path(args.prompts))
    check_output(Path(args.out), Path(args.prompts), args.force)
    model, store = load_model(args.model, LoadOptions.from_args(args))
    tok = load_tokenizer(args.model)
    recorder = TraceRecorder({**model_meta(model, store, args.model), "prompts": len(prompts),
                              "max_tokens": args.max_tokens, "created": time.strftime("%Y-%m-%dT%H:%M:%S")})
    store.trace = recorder
    stop = () if args.ignore_eos else tok.stop_ids(model.config.eos_token_ids)
    cfg = GenerationConfig(max_tokens=args.max_tokens, stop_ids=stop)
    t0, generated = time.perf_counter(), 0
    for text in prompts:
        ids = tok.encode_chat([{"role": "user", "content": text}]) if args.chat else tok.encode(text)
        generated += len(generate(model, ids, cfg).tokens)
    store.close()
    trace = recorder.trace
    out = write_trace(trace, args.out, overwrite=args.force)
    print(f"wrote {out}: {len(prompts)} prompts, {generated} tokens, {trace.num_steps} steps, {len(trace)} layer steps, "
          f"{len(trace.experts)} expert uses of {len(set(trace.accesses()))} distinct experts "
          f"in {time.perf_counter() - t0:.1f}s")
    return 0
