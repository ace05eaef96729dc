"""`moeswap trace MODEL --prompts FILE -o trace.bin`: record which experts a real run routes to.

Generates from each prompt of FILE (one per line) with a TraceRecorder on the expert store and writes
the (step, layer, experts) events as a routing trace (experts/trace.py), for `moeswap bench cache`,
`--expert-policy static --expert-profile` and the planner's `--trace`. Routing does not depend on the
cache, so the store flags only change how fast the recording runs.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from moeswap.options import LoadOptions, add_load_flags


def add_parser(sub) -> None:
    p = sub.add_parser("trace", help="record a routing trace (step, layer, experts) of a real run")
    p.add_argument("model", help="model directory")
    p.add_argument("--prompts", required=True, metavar="FILE", help="text file with one prompt per line")
    p.add_argument("-o", "--out", required=True, metavar="TRACE", help="output file, e.g. trace.bin")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per prompt (default 32)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    add_load_flags(p)


def model_meta(model, store, model_dir: str) -> dict:
    """What a trace says about the model it came from (bench cache sizes budgets with it)."""
    c = model.config
    first = min(store.index.entries)
    return {
        "model": str(model_dir), "num_layers": c.num_layers, "num_experts": c.moe.num_experts, "top_k": c.moe.top_k,
        "moe_layers": [i for i, k in enumerate(c.mlp_kinds) if k == "moe"],
        "expert_stored_bytes": store.index.stored_bytes(store.ckpt, *first),
    }


def run(args: argparse.Namespace) -> int:
    from moeswap.engine.generate import GenerationConfig, generate
    from moeswap.engine.tokenizer import load_tokenizer
    from moeswap.experts.trace import TraceRecorder, write_trace
    from moeswap.models.loader import load_model

    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    prompts = [line for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"--prompts {args.prompts}: the file has no prompts (expected one per line)")
    model, store = load_model(args.model, LoadOptions.from_args(args))
    tok = load_tokenizer(args.model)
    recorder = TraceRecorder({**model_meta(model, store, args.model), "prompts": len(prompts),
                              "max_tokens": args.max_tokens, "created": time.strftime("%Y-%m-%dT%H:%M:%S")})
    store.trace = recorder
    stop = () if args.ignore_eos else (tuple(tok.eos_ids) or model.config.eos_token_ids)
    cfg = GenerationConfig(max_tokens=args.max_tokens, stop_ids=stop)
    t0, generated = time.perf_counter(), 0
    for text in prompts:
        ids = tok.encode_chat([{"role": "user", "content": text}]) if args.chat else tok.encode(text)
        generated += len(generate(model, ids, cfg).tokens)
    store.close()
    trace = recorder.trace
    out = write_trace(trace, args.out)
    print(f"wrote {out}: {len(prompts)} prompts, {generated} tokens, {trace.num_steps} steps, {len(trace)} layer steps, "
          f"{len(trace.experts)} expert uses of {len(set(trace.accesses()))} distinct experts "
          f"in {time.perf_counter() - t0:.1f}s")
    return 0
