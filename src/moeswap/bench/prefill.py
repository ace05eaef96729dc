"""`moeswap bench prefill MODEL`: prompt tokens/s (time to first token) at prompt lengths
128/512/2048, batch 1, side by side with llama.cpp and transformers (Kimi Linear only).

Prefill tokens/s = prompt length / time from the prompt going in to the first token's logits, as each
engine measures it (moeswap: its scheduler's prefill time, 512-token chunks).
"""

from __future__ import annotations

import argparse

from moeswap.bench import sidebyside as sbs


def measure(setup: sbs.Setup, lengths: list[int]) -> dict:
    from moeswap.config import load_config

    vocab = load_config(setup.model).vocab_size
    peers = sbs.Peers(setup, max_seqs=1, max_len=max(lengths) + 8)
    try:
        report = sbs.common_report(setup, peers)
        report.update(bench="prefill", rows=[])
        peers.warm_up(sbs.random_prompts(1, 256, vocab, seed=99)[0])
        for length in lengths:
            prompt = sbs.random_prompts(1, length, vocab, seed=length)
            best: dict[str, dict] = {}
            for _ in range(setup.reps):
                for name, worker in peers.workers.items():
                    out = worker.generate(prompt, 2)
                    rate = length / out["ttft_s"]
                    if name not in best or rate > best[name]["tokens_per_s"]:
                        best[name] = {"tokens_per_s": rate, "ttft_ms": 1e3 * out["ttft_s"], "first": out["tokens"][0][:2]}
            row = {"prompt_tokens": length, "results": best}
            for name in best:
                if name != "moeswap":
                    best[name]["moeswap_ratio"] = best["moeswap"]["tokens_per_s"] / best[name]["tokens_per_s"]
                    best[name]["first_token_agrees"] = best[name]["first"][0] == best["moeswap"]["first"][0]
            report["rows"].append(row)
        return report
    finally:
        peers.close()


def format_markdown(report: dict) -> str:
    peers = [p for p in report["peers"] if p != "moeswap"]
    head = "| prompt tokens | moeswap tok/s | TTFT ms |" + "".join(f" {p} tok/s | moeswap / {p} |" for p in peers)
    sep = "|---:|---:|---:|" + "---:|---:|" * len(peers)
    lines = [sbs.header_markdown(report), "", f"prefill, batch 1, best of {report['reps']} rounds", "", head, sep]
    for r in report["rows"]:
        m = r["results"]["moeswap"]
        cells = [str(r["prompt_tokens"]), f"{m['tokens_per_s']:.1f}", f"{m['ttft_ms']:.0f}"]
        for p in peers:
            x = r["results"].get(p)
            cells += ["-", "-"] if x is None else [f"{x['tokens_per_s']:.1f}", f"{x['moeswap_ratio']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def add_parser(benches) -> None:
    b = benches.add_parser("prefill", help="prompt tokens/s at 128/512/2048 tokens vs llama.cpp and transformers")
    sbs.add_common_flags(b)
    b.add_argument("--prompt-tokens", default="128,512,2048", help="comma list of prompt lengths")


def run(args: argparse.Namespace) -> int:
    setup = sbs.setup_from_args(args)
    report = measure(setup, sbs.int_list(args.prompt_tokens, "--prompt-tokens"))
    md = format_markdown(report)
    print(md)
    for path in sbs.write_report("prefill", report, md, args.out_dir or None, args.json, args.markdown):
        print(f"wrote {path}")
    return 0
