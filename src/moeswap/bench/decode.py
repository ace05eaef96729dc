"""`moeswap bench decode MODEL`: decode tokens/s at batch sizes 1/4/16, side by side with llama.cpp
(same checkpoint converted by its own converter, same threads) and transformers (Kimi Linear only).

Each batch: random prompts of --prompt-tokens, prefilled one by one (not timed here), then
--tokens greedy steps; aggregate tokens/s = batch x steps / decode time, as each engine measures it.
Also: the first 16 greedy tokens of moeswap and each peer at batch 1 (a cross-implementation check).
"""

from __future__ import annotations

import argparse

from moeswap.bench import sidebyside as sbs


def measure(setup: sbs.Setup, batches: list[int], prompt_tokens: int, tokens: int) -> dict:
    from moeswap.config import load_config

    vocab = load_config(setup.model).vocab_size
    peers = sbs.Peers(setup, max_seqs=max(batches), max_len=prompt_tokens + tokens + 8)
    try:
        report = sbs.common_report(setup, peers)
        report.update(bench="decode", prompt_tokens=prompt_tokens, tokens=tokens, rows=[])
        peers.warm_up(sbs.random_prompts(1, 256, vocab, seed=99)[0])
        for batch in batches:
            prompts = sbs.random_prompts(batch, prompt_tokens, vocab, seed=batch)
            best: dict[str, dict] = {}
            for _ in range(setup.reps):
                for name, worker in peers.workers.items():  # interleaved: load hits everyone alike
                    out = worker.generate(prompts, tokens)
                    rate = batch * out["decoded"] / out["decode_s"]
                    if name not in best or rate > best[name]["tokens_per_s"]:
                        best[name] = {"tokens_per_s": rate, "ms_per_step": 1e3 * out["decode_s"] / out["decoded"],
                                      "tokens": out["tokens"], "engine": out.get("engine")}
            row = {"batch": batch, "results": {k: {kk: vv for kk, vv in v.items() if kk != "tokens"}
                                               for k, v in best.items()}}
            ours = best["moeswap"]["tokens_per_s"]
            for name in best:
                if name != "moeswap":
                    row["results"][name]["moeswap_ratio"] = ours / best[name]["tokens_per_s"]
                    row["results"][name]["greedy_agree_16"] = [
                        sbs.agreement(a[:16], b[:16]) for a, b in zip(best["moeswap"]["tokens"], best[name]["tokens"])]
            row["moeswap_tokens_first_seq"] = best["moeswap"]["tokens"][0][:16]
            report["rows"].append(row)
        report["rooflines"] = [sbs.batch_roofline(report["bytes"], report["bandwidth"]["read_GBps"],
                                                  report["gemm_gflops"], b) for b in batches]
        for r, roof in zip(report["rows"], report["rooflines"]):  # the step's bytes over its time
            ms = r["results"]["moeswap"]["ms_per_step"]
            r["moeswap_bandwidth_share"] = roof["step_bytes"] / (ms * 1e-3) / (report["bandwidth"]["read_GBps"] * 1e9)
        one = next((r for r in report["rows"] if r["batch"] == 1), None)
        for r in report["rows"]:
            if one:
                r["moeswap_scaling_vs_batch1"] = r["results"]["moeswap"]["tokens_per_s"] / one["results"]["moeswap"]["tokens_per_s"]
        return report
    finally:
        peers.close()


def format_markdown(report: dict) -> str:
    peers = [p for p in report["peers"] if p != "moeswap"]
    head = "| batch | moeswap tok/s | ms/step | x batch 1 |" + "".join(f" {p} tok/s | moeswap / {p} | greedy 16 agree |" for p in peers)
    sep = "|---:|---:|---:|---:|" + "---:|---:|---|" * len(peers)
    lines = [sbs.header_markdown(report), "",
             f"decode, prompts of {report['prompt_tokens']} tokens, {report['tokens']} greedy tokens, best of {report['reps']} rounds",
             "", head, sep]
    for r in report["rows"]:
        m = r["results"]["moeswap"]
        cells = [str(r["batch"]), f"{m['tokens_per_s']:.1f}", f"{m['ms_per_step']:.1f}",
                 f"{r.get('moeswap_scaling_vs_batch1', float('nan')):.2f}"]
        for p in peers:
            x = r["results"].get(p)
            if x is None:
                cells += ["-", "-", "-"]
                continue
            agree = x["greedy_agree_16"]
            cells += [f"{x['tokens_per_s']:.1f}", f"{x['moeswap_ratio']:.2f}",
                      f"{sum(a == 16 for a in agree)}/{len(agree)} seqs (min {min(agree)})"]
        lines.append("| " + " | ".join(cells) + " |")
    engines = [r["results"]["moeswap"].get("engine") or {} for r in report["rows"]]
    if engines and all("native_steps" in e for e in engines):
        native = sum(e["native_steps"] for e in engines)
        off = {e["native_off"] for e in engines if e.get("native_off")}
        fast = ("replayed from CUDA graphs (engine/cuda_graph.py)" if report["settings"]["device"].startswith("cuda")
                else "in the native C call (engine/native_step.py)")
        lines += ["", f"moeswap's decode steps {fast}: {native} of "
                      f"{sum(e['decode_steps'] for e in engines)} in the rounds kept"
                  + (f" (otherwise: {'; '.join(sorted(off))})" if off else "")]
    roofs = report.get("rooflines") or []
    if roofs:
        one = sbs.batch_roofline(report["bytes"], report["bandwidth"]["read_GBps"], report["gemm_gflops"], 1)
        lines += ["", f"ceilings at the measured read bandwidth and GEMM rate ({report['gemm_gflops']:.0f} GFLOP/s; "
                      "distinct experts as under uniform routing): " + ", ".join(
                          f"batch {r['batch']} {r['tokens_per_s']:.0f} tok/s ({r['bound']}-bound, "
                          f"{r['tokens_per_s'] / one['tokens_per_s']:.1f}x batch 1)" for r in roofs),
                  "moeswap's step reads its bytes (as in those ceilings) at " + ", ".join(
                      f"{r['moeswap_bandwidth_share']:.0%} (batch {r['batch']})" for r in report["rows"])
                  + " of the measured read bandwidth"]
    return "\n".join(lines)


def add_parser(benches) -> None:
    b = benches.add_parser("decode", help="decode tokens/s at batch 1/4/16 vs llama.cpp and transformers")
    sbs.add_common_flags(b)
    b.add_argument("--batch", default="1,4,16", help="comma list of batch sizes (default 1,4,16)")
    b.add_argument("--prompt-tokens", type=int, default=128)
    b.add_argument("--tokens", type=int, default=32, help="greedy tokens per sequence (default 32)")


def run(args: argparse.Namespace) -> int:
    setup = sbs.setup_from_args(args)
    if args.tokens < 2 or args.prompt_tokens < 1:
        raise ValueError("--tokens must be >= 2 and --prompt-tokens >= 1")
    report = measure(setup, sbs.int_list(args.batch, "--batch"), args.prompt_tokens, args.tokens)
    md = format_markdown(report)
    print(md)
    for path in sbs.write_report("decode", report, md, args.out_dir or None, args.json, args.markdown):
        print(f"wrote {path}")
    return 0
