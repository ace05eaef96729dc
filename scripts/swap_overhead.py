"""The expert store's CPU cost on the model's thread while swapping, per decoded token and per load.

Decodes `--tokens` tokens with the fast tier at `--budget` % of the experts' bytes and a warm page cache,
recording every fetch, table hit and lookahead hint the model makes; then replays that sequence `--rounds` times
through fresh stores with no model compute, the per-expert load path (ExpertStore.batch_loads False) and
the batched one taking turns, and measures the CPU seconds of this thread (time.thread_time: the native
reader threads and other processes are not counted, so a busy machine inflates it far less than wall
time). Prints one JSON object: the decode's model-thread CPU and wall ms per token, loads per token
(demand reads on this thread plus background loads), and per path the replay's CPU ms per token and
µs per load (medians over rounds, and each round), the load average before and after.

    PYTHONPATH=src python scripts/swap_overhead.py MODEL [--budget 25] [--policy lfru]
                                                     [--prefetch next-layer] [--tokens 32] [--rounds 5]

A checkout without `batch_loads` replays its one path under both names.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--budget", type=float, default=25.0, help="fast tier, percent of all experts' bytes")
    ap.add_argument("--policy", default="lfru")
    ap.add_argument("--prefetch", default="next-layer")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    load0 = os.getloadavg()[0]

    import torch

    torch.set_num_threads(1)
    from moeswap.engine.generate import GenerationConfig, generate
    from moeswap.experts.build import build_store
    from moeswap.models.loader import attach_store, load_model
    from moeswap.options import LoadOptions

    model, probe = load_model(args.model, LoadOptions(expert_policy="none", prefetch="none"))
    ckpt, index, cfg = probe.ckpt, probe.index, model.config
    dtype = next(model.parameters()).dtype
    total = sum(probe.fast.cost(k) for k in index.entries)
    opts = LoadOptions(expert_memory=int(total * args.budget / 100), expert_policy=args.policy, prefetch=args.prefetch)
    for path in ckpt.files():  # warm page cache: the reads cost this thread only their bookkeeping
        with open(path, "rb") as f:
            while f.read(1 << 24):
                pass

    def loads(store) -> int:
        s = store.stats
        return s.misses - s.prefetch.late + s.prefetch.loaded

    # the decode, recording what the model asks of the store
    store = build_store(ckpt, index, cfg, dtype, "cpu", opts)
    events: list[tuple[str, int, list[int], dict]] = []  # (what, layer, ids, fetch's keywords)
    fetch = store.fetch
    store.fetch = lambda layer, ids, **kw: (events.append(("fetch", layer, [int(e) for e in ids], kw)),
                                            fetch(layer, ids, **kw))[1]
    table_hits = store.table_hits  # the native decode step's hits, served from the resident tables
    store.table_hits = lambda layer, ids: (events.append(("hits", layer, [int(e) for e in ids], {})),
                                           table_hits(layer, ids))[1]
    if store.prefetcher is not None:
        hint = store.prefetcher.hint
        store.prefetcher.hint = lambda layer, ids: (events.append(("hint", layer, [int(e) for e in ids], {})),
                                                    hint(layer, ids))[1]
    attach_store(model, store)
    prompt = torch.randint(0, cfg.vocab_size, (8,), generator=torch.Generator().manual_seed(0)).tolist()
    generate(model, prompt, GenerationConfig(max_tokens=8, stop_ids=()))  # the cache warm, as in bench swap
    warm_events, loads0 = len(events), loads(store)
    c0, w0 = time.thread_time(), time.perf_counter()
    result = generate(model, prompt, GenerationConfig(max_tokens=args.tokens, stop_ids=()))
    c1, w1 = time.thread_time(), time.perf_counter()
    steps = result.decoded + 1  # the prompt's step is one
    decode_loads = loads(store) - loads0
    store.close()

    def replay(batched: bool) -> tuple[float, int]:
        """CPU seconds of this thread for the timed part of the sequence, and the loads it made."""
        s = build_store(ckpt, index, cfg, dtype, "cpu", opts)
        if hasattr(s, "batch_loads"):
            s.batch_loads = batched
        cpu = 0.0
        for i, (kind, layer, ids, kw) in enumerate(events):
            if i == warm_events:
                cpu, before = time.thread_time(), loads(s)
            if kind == "hint":
                s.prefetcher.hint(layer, ids)
            elif kind == "hits":
                s.table_hits(layer, ids)
            else:
                got = s.fetch(layer, ids, **kw)
                for j in range(len(ids)):
                    got[j]  # each expert handed over and let go, as the MoE block does
                del got  # (the MoE block's fetch result dies with its call)
        cpu = time.thread_time() - cpu
        n = loads(s) - before
        s.close()
        return cpu, n

    paths = {"per_expert": [], "batched": []}
    for _ in range(args.rounds):
        for name in paths:
            paths[name].append(replay(name == "batched"))
    out = {"model": os.path.basename(os.path.normpath(args.model)), "budget_pct": args.budget, "policy": args.policy,
           "prefetch": args.prefetch, "tokens": steps, "decode_cpu_ms_per_token": (c1 - c0) * 1e3 / steps,
           "decode_wall_ms_per_token": (w1 - w0) * 1e3 / steps, "decode_loads_per_token": decode_loads / steps,
           "has_batch_loads": hasattr(probe, "batch_loads")}
    for name, runs in paths.items():
        out[name] = {"cpu_ms_per_token": statistics.median(c for c, _ in runs) * 1e3 / steps,
                     "us_per_load": statistics.median(c / max(1, n) for c, n in runs) * 1e6,
                     "loads_per_token": statistics.median(n for _, n in runs) / steps,
                     "rounds_cpu_ms_per_token": [round(c * 1e3 / steps, 2) for c, _ in runs]}
    out["loadavg"] = [load0, os.getloadavg()[0]]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
