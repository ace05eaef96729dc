"""The greedy check of `bench serve`: completed requests of moeswap servers against `moeswap generate`'s
greedy tokens for the same prompt. Entry point: `check_greedy`.
"""

from __future__ import annotations

from moeswap.bench.serve.client import Outcome
from moeswap.bench.serve.stats import MAX_ERRORS
from moeswap.options import LoadOptions


def check_greedy(model_dir: str, load: LoadOptions, runs: dict[str, list[list[Outcome]]], per_target: int,
                 threads: int | None = None) -> dict:
    """Up to `per_target` completed requests of each moeswap target (spread over its run) against
    `moeswap generate`'s greedy tokens for the same prompt and max_tokens (engine.generate, batch 1), on
    the servers' `threads`: torch's GEMM (prompts over 32 tokens) rounds differently at another thread
    count, and a random model's near-tied logits then pick other tokens (docs/benchmarks.md)."""
    import torch

    from moeswap.engine.generate import GenerationConfig, generate
    from moeswap.engine.scheduler import EngineConfig
    from moeswap.models.loader import load_model
    from moeswap.text.tokenizer import load_tokenizer

    picked: list[tuple[str, Outcome]] = []
    for name, levels in runs.items():
        done = [o for outs in levels for o in outs if o.ok and o.token_ids is not None]
        step = max(1, len(done) / per_target)
        picked += [(name, done[int(k * step)]) for k in range(min(per_target, len(done)))]
    report: dict = {"checked": len(picked), "equal": 0, "mismatches": []}
    if not picked:
        report["ok"] = False
        report["note"] = "no completed request returned its token ids"
        return report
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    model, store = load_model(model_dir, load)
    tok = load_tokenizer(model_dir)
    reference: dict[tuple, list[int]] = {}
    try:
        for name, o in picked:
            ids = tok.encode(o.prompt) if isinstance(o.prompt, str) else list(o.prompt)
            key = (tuple(ids), o.max_tokens)
            if key not in reference:
                cfg = GenerationConfig(max_tokens=o.max_tokens, stop_ids=())
                reference[key] = generate(model, ids, cfg, engine=EngineConfig(max_batch=1, max_len=len(ids) + o.max_tokens)).tokens
            ref = reference[key]
            if o.token_ids == ref:
                report["equal"] += 1
            elif len(report["mismatches"]) < MAX_ERRORS:
                first = next((i for i, (a, b) in enumerate(zip(o.token_ids, ref)) if a != b),
                             min(len(o.token_ids), len(ref)))
                report["mismatches"].append({"target": name, "request": o.index, "first_difference": first,
                                             "server_tokens": len(o.token_ids), "generate_tokens": len(ref)})
    finally:
        store.close()
        torch.set_num_threads(before)
    report["ok"] = report["equal"] == report["checked"]
    return report
