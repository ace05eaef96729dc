"""`moeswap bench memory`: peak resident memory while generating, against what must be resident.

Runs in a fresh process so the peak (ru_maxrss) belongs to this measurement alone, and reports it
next to its parts: the process before loading (Python + torch, with the compiler stack torch imports
lazily), the dense weights as loaded, and the experts kept in the store's fast tier (capped by
--expert-memory).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from moeswap import jsonio
from moeswap.options import LoadOptions, add_load_flags, add_model_argument
from moeswap.procfs import peak_rss_bytes, rss_bytes
from moeswap.tuning import tune_process


def _dtypes(model) -> str:
    """The parameter dtypes by share of bytes, e.g. "bfloat16 96%, float32 4%" (CPU keeps bf16 Linears)."""
    by: dict[str, int] = {}
    for p in model.parameters():
        name = str(p.dtype).removeprefix("torch.")
        by[name] = by.get(name, 0) + p.numel() * p.element_size()
    total = sum(by.values()) or 1
    return ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in sorted(by.items(), key=lambda kv: -kv[1]))


def measure(model_dir: str, prompt_tokens: int, max_tokens: int, options: LoadOptions) -> dict:
    """Runs inside the child process, tuned as the moeswap command is."""
    tune_process()
    import torch

    from moeswap.engine.generate import GenerationConfig, generate
    from moeswap.models.loader import load_model

    torch.set_num_threads(max(1, torch.get_num_threads()))
    # torch imports its compiler stack lazily on the first model built (nn.init goes through torch._dynamo,
    # which imports triton where it is installed: tens of MB): torch's, not moeswap's, so part of the baseline
    import torch._dynamo  # noqa: F401

    base = rss_bytes()
    model, store = load_model(model_dir, options)
    after_load = rss_bytes()
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = torch.randint(0, model.config.vocab_size, (prompt_tokens,), generator=torch.Generator().manual_seed(0))
    result = generate(model, ids.tolist(), GenerationConfig(max_tokens=max_tokens, stop_ids=()))
    store.close()
    peak = peak_rss_bytes()
    touched = store.stats.disk_reads  # experts read from the checkpoint
    per_expert = store.fast.cost(min(store.index.entries))
    return {
        "model": model_dir, "dtype": _dtypes(model), "prompt_tokens": prompt_tokens,
        "generated": len(result.tokens), "expert_memory": options.expert_memory,
        "expert_bytes_in_checkpoint": sum(store.index.stored_bytes(store.ckpt, *k) for k in store.index.entries),
        "rss_before_load": base, "rss_after_load": after_load, "peak_rss": peak,
        "dense_weight_bytes": dense, "decoded_expert_bytes": per_expert,
        "expert_loads": touched, "experts_resident_at_end": len(store.fast),
        "expert_cache_bytes_at_end": store.fast.used, "policy": options.expert_policy, "prefetch": options.prefetch,
        "overhead": peak - base - dense - store.fast.used,
    }


def run_isolated(model_dir: str, prompt_tokens: int = 64, max_tokens: int = 32,
                 options: LoadOptions = LoadOptions()) -> dict:
    argv = [str(model_dir), "--prompt-tokens", str(prompt_tokens), "--max-tokens", str(max_tokens), *options.to_argv()]
    out = subprocess.run([sys.executable, "-m", "moeswap.bench.memory", *argv], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"memory benchmark failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def format_report(r: dict) -> str:
    mib = lambda b: f"{b / 2**20:,.1f} MiB"  # noqa: E731
    rows = [
        ("routed experts in the checkpoint (MXFP4)", mib(r["expert_bytes_in_checkpoint"])),
        ("process before loading (Python + torch)", mib(r["rss_before_load"])),
        (f"dense weights as loaded ({r['dtype']})", mib(r["dense_weight_bytes"])),
        (f"experts kept in the fast tier at the end ({r['experts_resident_at_end']}, {r['expert_loads']} reads; "
         f"budget {mib(r['expert_memory'])})", mib(r["expert_cache_bytes_at_end"])),
        ("peak resident memory", mib(r["peak_rss"])),
        ("overhead = peak - before - dense - kept experts", mib(r["overhead"])),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"| {k:<{width}} | {v:>14} |" for k, v in rows)


def _add_measure_flags(b: argparse.ArgumentParser) -> None:
    add_model_argument(b)
    b.add_argument("--prompt-tokens", type=int, default=64)
    b.add_argument("--max-tokens", type=int, default=32)
    add_load_flags(b)


def add_parser(benches) -> None:
    b = benches.add_parser("memory", help="peak resident memory while generating vs dense weights + experts kept")
    _add_measure_flags(b)
    b.add_argument("--json", metavar="FILE", help="also write the result as JSON to FILE")


def run(args: argparse.Namespace) -> int:
    result = run_isolated(args.model, args.prompt_tokens, args.max_tokens, LoadOptions.from_args(args))
    print(format_report(result))
    if args.json:
        with open(args.json, "w") as f:
            jsonio.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":  # the child process of run_isolated: one JSON line on stdout
    parser = argparse.ArgumentParser()
    _add_measure_flags(parser)
    a = parser.parse_args()
    print(jsonio.dumps(measure(a.model, a.prompt_tokens, a.max_tokens, LoadOptions.from_args(a))))
