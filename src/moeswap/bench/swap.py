"""`moeswap bench swap MODEL`: decode tokens/s with the fast tier at fractions of the experts' bytes, for every
cache policy with and without next-layer prefetch, next to "all experts resident" (the reference of every
ratio) and "no cache: read each expert from disk every time". Every configuration must reproduce the
all-resident tokens (checked and reported). Entry points: `run_bench`, `add_parser`, `run`.
"""

from __future__ import annotations

import argparse
import os
import time
from functools import partial
from pathlib import Path

from moeswap.bench import RESULTS_DIR
from moeswap.options import NO_CACHE, PREFETCH_MODES, LoadOptions, add_load_flags, add_model_argument

BASELINE_RESIDENT = "all experts resident"
BASELINE_NO_CACHE = "no cache: every expert read from disk every time"


def _drop_page_cache(ckpt) -> None:
    for file in ckpt.files():
        try:
            fd = os.open(file, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except (AttributeError, OSError):
            pass
        finally:
            os.close(fd)


def run_bench(model_dir: str, budgets=(10, 25, 50, 100), policies=None, prompt_tokens: int = 8,
              max_tokens: int = 16, options: LoadOptions = LoadOptions(), cold: bool = True,
              out_dir: str | Path = RESULTS_DIR, repeats: int = 1, warmup_tokens: int = 24, log=print,
              prompts: list[str] | None = None, timed_prompts: int | None = None) -> dict:
    """Every configuration `repeats` times, round-robin (so machine noise hits all alike); tokens/s is the
    median over rounds, hit rate and stall are those of the timed decode steps. Each run first generates
    `warmup_tokens` from another prompt with the same store (untimed), so the cache is measured warm, as
    in a server that has been running, not just filling up. `policies`: default every registered one;
    `options`: how the model is loaded (its store's budget, policy and prefetch are what this varies).
    `prompts`: texts (encoded with the model's tokenizer), real text where a trained model's routing matters;
    default seeded random tokens. The first `timed_prompts` are decoded one after another with the same store
    (as a server's requests; default: all but two of `prompts`, one random prompt), the next one profiles
    `static` and the one after warms the cache (cycled). Tokens/s is decoded tokens over decode time of all
    timed prompts: a few dozen tokens of a small model take tens of ms, which a shared machine's noise swamps.

    One process and one model load; each configuration gets a fresh store, the same prompts (seeded random
    token ids, or a file's lines decoded one after another) and greedy decoding. Budgets are fractions of all
    experts' bytes in the fast tier's form (MXFP4, or decoded with --decoded-experts). Disk reads are cold by
    default (each expert's pages are dropped from the OS page cache after it is read), as for a checkpoint
    larger than RAM. Static is profiled on a second prompt; Belady replays the reference run's own trace.
    """
    import statistics

    import torch

    from moeswap.engine.generate import GenerationConfig, generate
    from moeswap.experts.build import build_store
    from moeswap.experts.policy import POLICIES
    from moeswap.experts.trace import TraceRecorder, model_meta, write_trace
    from moeswap.models.loader import attach_store, load_model

    policies = tuple(POLICIES) if policies is None else tuple(policies)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model, store = load_model(model_dir, options.replace(expert_policy=NO_CACHE, prefetch="none"))
    ckpt, index, config = store.ckpt, store.index, model.config
    wdtype = next(model.parameters()).dtype
    keys = sorted(index.entries)
    vocab = config.vocab_size
    n_timed = timed_prompts or (max(1, len(prompts) - 2) if prompts else 1)
    if prompts:
        from moeswap.text.tokenizer import load_tokenizer

        tok = load_tokenizer(model_dir)
        encoded = [tok.encode(prompts[i % len(prompts)]) for i in range(n_timed + 2)]
    else:
        encoded = [torch.randint(0, vocab, (prompt_tokens,), generator=torch.Generator().manual_seed(i)).tolist()
                   for i in range(n_timed + 2)]
    timed, (profile_prompt, warmup_prompt) = encoded[:n_timed], encoded[n_timed:]
    prompt_tokens = sum(map(len, timed)) / n_timed
    gen_cfg = GenerationConfig(max_tokens=max_tokens, stop_ids=())

    def make(policy: str, budget: int, prefetch: str = "none", profile: str | None = None):
        opts = options.replace(expert_memory=budget, expert_policy=policy, prefetch=prefetch, expert_profile=profile,
                               drop_page_cache=cold)
        return build_store(ckpt, index, config, wdtype, "cpu", opts)

    probe = make("lru", 1 << 62)
    expert_bytes = probe.fast.cost(keys[0])
    total = sum(probe.fast.cost(k) for k in keys)
    probe.close()

    def generate_with(store, record=None, prompts_=None) -> dict:
        if cold:
            _drop_page_cache(ckpt)
        attach_store(model, store)
        store.trace = record
        if warmup_tokens:
            generate(model, warmup_prompt, GenerationConfig(max_tokens=warmup_tokens, stop_ids=()))
        books = lambda s: (s.hits, s.misses, s.stall_s, s.disk_bytes)
        decoding = [0, 0, 0.0, 0]  # the decode steps' hits, misses, stall seconds and disk bytes
        tokens, decoded, decode_s, ttft = [], 0, 0.0, []
        for ids in prompts_ or timed:
            at_first = []

            def on_token(_, at_first=at_first):  # the first token ends the prompt: decode-only statistics start here
                if not at_first:
                    at_first.extend(books(store.stats))

            result = generate(model, ids, gen_cfg, on_token=on_token)
            for i, (now, then) in enumerate(zip(books(store.stats), at_first)):
                decoding[i] += now - then
            tokens.append(result.tokens)
            decoded, decode_s = decoded + result.decoded, decode_s + result.decode_s
            ttft.append(result.ttft_s)
        store.close()
        s = store.stats
        hits, misses, stall_s, disk_bytes = decoding
        return {"tokens_per_s": decoded / decode_s, "tokens": tokens, "ttft_s": statistics.median(ttft),
                "decoded": decoded, "hit_rate": hits / max(1, hits + misses),
                "stall_ms_per_token": stall_s * 1e3 / max(1, decoded), "disk_reads": s.disk_reads,
                "prefetch_stats": s.as_dict()["prefetch"],
                # what the disk delivered while decoding: when it is the limit, tokens/s follows this
                "disk_mb_per_token": disk_bytes / 1e6 / max(1, decoded),
                "disk_gb_per_s": disk_bytes / 1e9 / decode_s if decode_s else 0.0}

    def resident_store():
        store = make("lru", total + expert_bytes)
        store.preload(keys)
        return store

    log(f"{model_dir}: {len(keys)} experts, {total / 2**20:.1f} MiB in the fast tier's form "
        f"({'decoded ' + str(wdtype) if options.decoded_experts else 'MXFP4'}), {'cold' if cold else 'warm'} disk reads, "
        f"torch threads {torch.get_num_threads()}, {repeats} round(s)")
    meta = model_meta(model, store, model_dir)
    recorder = TraceRecorder(meta)
    ref_tokens = generate_with(resident_store(), recorder)["tokens"]  # also warms up
    trace_path = write_trace(recorder.trace, out_dir / "swap-trace.bin")
    profile_path = None
    if "static" in policies:
        prof = TraceRecorder(meta)
        generate_with(resident_store(), prof, [profile_prompt])
        profile_path = write_trace(prof.trace, out_dir / "swap-profile.bin")

    configs = [{"name": BASELINE_RESIDENT, "make": resident_store},
               {"name": BASELINE_NO_CACHE, "make": lambda: make(NO_CACHE, 0)}]
    for pct in budgets:
        budget = int(total * pct / 100)
        if budget < config.moe.top_k * expert_bytes:
            log(f"  {pct}%: skipped, below one layer's {config.moe.top_k} active experts")
            continue
        for policy in policies:
            for prefetch in PREFETCH_MODES:
                name = policy + (" + next-layer prefetch" if prefetch != "none" else "")
                path = {"belady": trace_path, "static": profile_path}.get(policy)
                configs.append({"name": f"{name} @ {pct}%", "policy": policy, "prefetch": prefetch, "budget_pct": pct,
                                "budget_bytes": budget,
                                "make": partial(make, policy, budget, prefetch, str(path) if path else None)})
    samples: dict[str, list[dict]] = {c["name"]: [] for c in configs}
    for round_ in range(repeats):
        for c in configs:
            row = generate_with(c["make"]())
            samples[c["name"]].append(row)
            log(f"  [{round_ + 1}/{repeats}] {c['name']}: {row['tokens_per_s']:.2f} tokens/s, decode hit rate "
                f"{row['hit_rate']:.0%}, stalled {row['stall_ms_per_token']:.1f} ms/token, disk "
                f"{row['disk_mb_per_token']:.1f} MB/token at {row['disk_gb_per_s']:.2f} GB/s")
    rows = []
    for c in configs:
        runs = samples[c["name"]]
        row = {k: v for k, v in c.items() if k != "make"}
        row.update(runs[0])
        row["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in runs)
        row["tokens_per_s_all"] = [r["tokens_per_s"] for r in runs]
        for k in ("stall_ms_per_token", "disk_mb_per_token", "disk_gb_per_s"):
            row[k] = statistics.median(r[k] for r in runs)
        row["same_tokens"] = all(r["tokens"] == ref_tokens for r in runs)
        rows.append(row)
    reference, no_cache = rows[0]["tokens_per_s"], rows[1]["tokens_per_s"]
    for row in rows:
        row["vs_resident"] = row["tokens_per_s"] / reference
        row["vs_no_cache"] = row["tokens_per_s"] / no_cache
    from moeswap.bench.cache import environment

    return {"bench": "swap", "model": str(model_dir), "experts": len(keys), "expert_bytes_total": total,
            "expert_bytes": expert_bytes, "form": "decoded" if options.decoded_experts else "mxfp4", "dtype": str(wdtype),
            "cold_disk": cold, "prompt_tokens": prompt_tokens, "timed_prompts": n_timed, "text_prompts": bool(prompts),
            "max_tokens": max_tokens, "budgets": list(budgets),
            "policies": list(policies), "repeats": repeats, "warmup_tokens": warmup_tokens,
            "reference_tokens_per_s": reference,
            "baselines": rows[:2], "runs": rows[2:], "environment": environment()}


def format_report(r: dict) -> str:
    budgets = sorted({c["budget_pct"] for c in r["runs"]})
    resident, no_cache = r["baselines"]
    head = ["configuration", *[f"{b}% of expert bytes" for b in budgets]]
    lines = [
        f"Decode tokens/s on {Path(r['model']).name} ({r['experts']} experts, {r['expert_bytes_total'] / 2**20:.0f} MiB "
        f"as {r['form']}; {'cold' if r['cold_disk'] else 'warm'} disk; {r['max_tokens']} tokens after each of "
        f"{r['timed_prompts']} {'text' if r.get('text_prompts') else 'random'} prompt(s) of {r['prompt_tokens']:.0f} "
        f"tokens on average, cache warmed by {r['warmup_tokens']} tokens of another; torch threads "
        f"{r['environment']['torch_threads']}; median of "
        f"{r['repeats']} round(s)). Cells: tokens/s · ratio to all-resident · decode hit rate · expert stall ms/token · "
        f"disk MB read per token.",
        "",
        f"- {BASELINE_RESIDENT}: {resident['tokens_per_s']:.2f} tokens/s (the reference; rounds: "
        f"{', '.join(f'{x:.2f}' for x in resident['tokens_per_s_all'])})",
        f"- {BASELINE_NO_CACHE}: {no_cache['tokens_per_s']:.2f} tokens/s ({no_cache['vs_resident']:.2f}x all-resident, "
        f"stall {no_cache['stall_ms_per_token']:.1f} ms/token, disk {no_cache['disk_mb_per_token']:.1f} MB/token at "
        f"{no_cache['disk_gb_per_s']:.2f} GB/s)",
        "",
        "| " + " | ".join(head) + " |", "|" + "---|" * len(head),
    ]
    names = []
    for c in r["runs"]:
        n = c["name"].rsplit(" @ ", 1)[0]
        if n not in names:
            names.append(n)
    for n in names:
        cells = []
        for b in budgets:
            c = next((c for c in r["runs"] if c["name"] == f"{n} @ {b}%"), None)
            if c is None:
                cells.append("—")
                continue
            flag = "" if c["same_tokens"] else " DIFFERENT TOKENS"
            cells.append(f"{c['tokens_per_s']:.2f} · {c['vs_resident']:.2f}x · {c['hit_rate']:.0%} · "
                         f"{c['stall_ms_per_token']:.1f} · {c['disk_mb_per_token']:.1f}{flag}")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    wrong = [c["name"] for c in r["runs"] + r["baselines"] if not c["same_tokens"]]
    lines.append("")
    lines.append("All configurations produced the all-resident tokens." if not wrong
                 else f"DIFFERENT TOKENS from all-resident: {', '.join(wrong)}")
    online = [c for c in r["runs"] if c["budget_pct"] == 25 and c["prefetch"] != "none" and c["policy"] != "belady"]
    if online:
        best = max(online, key=lambda c: c["tokens_per_s"])
        lines.append(f"Best non-oracle policy + prefetch at 25%: {best['name']}: {best['vs_resident']:.2f}x "
                     f"all-resident, {best['vs_no_cache']:.2f}x no-cache (all-resident itself is "
                     f"{1 / no_cache['vs_resident']:.2f}x no-cache here).")
    return "\n".join(lines)


def add_parser(benches) -> None:
    b = benches.add_parser("swap", help="decode tokens/s by fast-tier budget, policy and prefetch vs all-resident")
    add_model_argument(b)
    b.add_argument("--budgets", default="10,25,50,100", help="fast-tier budgets in %% of expert bytes (default %(default)s)")
    b.add_argument("--policies", help="comma list of cache policies (default: every one, "
                                      "from experts/policy.py POLICIES)")
    b.add_argument("--prompt-tokens", type=int, default=8, help="random prompt tokens when no --prompts (default 8)")
    b.add_argument("--prompts", metavar="FILE",
                   help="text file, one prompt per line, for real routing on a trained model: all but the last two "
                        "are timed (see --timed-prompts), then the static policy's profile and the warm-up "
                        "(default: seeded random tokens)")
    b.add_argument("--timed-prompts", type=int,
                   help="prompts decoded one after another per configuration, each --max-tokens (default: all but "
                        "two of --prompts, else 1)")
    b.add_argument("--max-tokens", type=int, default=16, help="tokens per timed prompt (default 16)")
    b.add_argument("--repeats", type=int, default=3, help="rounds over all configurations; tokens/s is the median")
    b.add_argument("--warmup-tokens", type=int, default=24,
                   help="untimed tokens from another prompt first, so the cache is warm (default 24; 0: cold start)")
    b.add_argument("--warm-disk", action="store_true", help="let the OS page cache serve repeated disk reads")
    # what this bench varies (budget, policy, prefetch) comes from its own flags above
    add_load_flags(b, only=("dtype", "dense_weights", "expert_activations", "gemm_precision", "decoded_experts"))
    b.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1: leaves a core to the prefetch thread, and shared "
                        "machines spin badly with more)")
    b.add_argument("--out-dir", default=RESULTS_DIR,
                   help="where swap-<time>.{md,json} and the traces go (default: %(default)s, as the other benches)")


def run(args: argparse.Namespace) -> int:
    import torch

    from moeswap.bench.cache import comma_list
    from moeswap.experts.policy import POLICIES

    budgets = [int(b) for b in comma_list(args.budgets, "--budgets", float)]
    policies = comma_list(args.policies, "--policies") if args.policies else list(POLICIES)
    for p in policies:
        if p not in POLICIES:
            raise ValueError(f"--policies: unknown policy {p!r}; expected some of {', '.join(POLICIES)}")
    if args.max_tokens < 2 or args.prompt_tokens < 1:
        raise ValueError("--max-tokens must be >= 2 and --prompt-tokens >= 1")
    if args.timed_prompts is not None and args.timed_prompts < 1:
        raise ValueError(f"--timed-prompts must be >= 1, got {args.timed_prompts}")
    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    from moeswap.commands.trace import read_prompts

    prompts = read_prompts(Path(args.prompts)) if args.prompts else None
    result = run_bench(args.model, budgets, policies, args.prompt_tokens, args.max_tokens, LoadOptions.from_args(args),
                       not args.warm_disk, args.out_dir, args.repeats, args.warmup_tokens, prompts=prompts,
                       timed_prompts=args.timed_prompts)
    result["elapsed_s"] = time.perf_counter() - t0
    from moeswap.bench.sidebyside import write_report

    report = format_report(result)
    paths = write_report("swap", result, report, args.out_dir or None, None, None)
    print(report)
    print(f"wrote {' and '.join(paths)} in {result['elapsed_s']:.0f}s")
    return 0
