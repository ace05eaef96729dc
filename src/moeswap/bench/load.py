"""`moeswap bench load MODEL`: time to first token and decode speed of `moeswap generate` on a quiet
machine and under a background load of `--busy` spinning processes, with moeswap's thread fitting
(tuning.fit_threads_to_load, the default) next to the named baseline "OpenMP defaults"
(MOESWAP_THREADS=spin: one spin-waiting thread per core, as before the fitting).

Each measurement is a fresh `moeswap generate --json` process (OpenMP reads its settings when it starts),
all of them round-robin `--reps` times; each configuration keeps its best round. The busy processes are
started before, and stopped after, each loaded measurement. The report states the ratios; the project's goal for
them is in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from moeswap.bench import RESULTS_DIR
from moeswap.options import add_model_argument
from moeswap.tuning import ENV_THREADS, OPENMP_VARIABLES

MODES = {"fitted": "auto", "OpenMP defaults": "spin"}  # label -> MOESWAP_THREADS
BUSY_LOOP = "while True: pass"


def _generate(model: str, prompt: str, max_tokens: int, mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in OPENMP_VARIABLES}
    env[ENV_THREADS] = mode
    cmd = [sys.executable, "-m", "moeswap.cli", "generate", model, "--prompt", prompt, "--max-tokens",
           str(max_tokens), "--ignore-eos", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"moeswap generate failed: {out.stderr.strip()[-1000:]}")
    return json.loads(out.stdout)


def measure(model: str, busy: int, prompt_words: int, max_tokens: int, reps: int, log=print) -> dict:
    prompt = " ".join(["the quick brown fox jumps over the lazy dog"] * max(1, prompt_words // 9))
    best: dict[str, dict] = {}
    for rep in range(reps):
        for loaded in (False, True):
            for label, mode in MODES.items():
                key = f"{label}, {'busy' if loaded else 'quiet'}"
                spinners = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(busy if loaded else 0)]
                try:
                    if spinners:
                        time.sleep(1.0)  # let them take the cores
                    out = _generate(model, prompt, max_tokens, mode)
                finally:
                    for p in spinners:
                        p.kill()
                        p.wait()
                log(f"  round {rep + 1}: {key}: TTFT {out['ttft_ms']:.0f} ms, decode {out['decode_tokens_per_s']:.1f} "
                    f"tok/s, {out['threads']} thread(s), OpenMP: {out['openmp']}")
                if key not in best or out["ttft_ms"] < best[key]["ttft_ms"]:
                    best[key] = {k: out[k] for k in ("ttft_ms", "decode_tokens_per_s", "threads", "openmp",
                                                     "prompt_tokens", "completion_tokens")}
    rows = []
    for label in MODES:
        quiet, loaded = best[f"{label}, quiet"], best[f"{label}, busy"]
        rows.append({"settings": label, "quiet": quiet, "busy": loaded,
                     "ttft_busy_over_quiet": loaded["ttft_ms"] / quiet["ttft_ms"],
                     "decode_quiet_over_busy": quiet["decode_tokens_per_s"] / loaded["decode_tokens_per_s"]})
    return {"bench": "load", "model": model, "busy_processes": busy, "reps": reps, "cores": os.cpu_count(),
            "load_average_at_start": list(os.getloadavg()), "rows": rows,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S")}


def format_markdown(r: dict) -> str:
    quiet = r["rows"][0]["quiet"]
    lines = [f"model `{r['model']}`, {quiet['prompt_tokens']}-token prompt, {quiet['completion_tokens']} tokens, "
             f"{r['cores']} cores, background load {r['busy_processes']} spinning processes, best of {r['reps']} "
             f"rounds; load average {r['load_average_at_start'][0]:.1f} at start", "",
             "| settings | TTFT quiet ms | TTFT busy ms | busy / quiet | decode quiet tok/s | decode busy tok/s | "
             "threads busy |", "|---|---:|---:|---:|---:|---:|---|"]
    for row in r["rows"]:
        q, b = row["quiet"], row["busy"]
        lines.append(f"| {row['settings']} | {q['ttft_ms']:.0f} | {b['ttft_ms']:.0f} | {row['ttft_busy_over_quiet']:.2f}x | "
                     f"{q['decode_tokens_per_s']:.1f} | {b['decode_tokens_per_s']:.1f} | {b['openmp'] or b['threads']} |")
    fitted = r["rows"][0]["ttft_busy_over_quiet"]
    lines += ["", f"TTFT under load with the default (fitted) settings: {fitted:.2f}x quiet."]
    return "\n".join(lines)


def add_parser(benches) -> None:
    b = benches.add_parser("load", help="time to first token quiet vs under a background load, fitted threads vs "
                                        "OpenMP defaults")
    add_model_argument(b)
    b.add_argument("--busy", type=int, default=2, help="spinning background processes (default 2)")
    b.add_argument("--prompt-words", type=int, default=450, help="prompt length in words (default 450)")
    b.add_argument("--max-tokens", type=int, default=16)
    b.add_argument("--reps", type=int, default=2, help="rounds; each configuration keeps its best")
    b.add_argument("--out-dir", default=RESULTS_DIR,
                   help="where load-<time>.{json,md} go ('' = only print; default %(default)s)")


def run(args: argparse.Namespace) -> int:
    from moeswap.bench.sidebyside import write_report

    if args.busy < 0 or args.reps < 1 or args.max_tokens < 2 or args.prompt_words < 1:
        raise ValueError("--busy must be >= 0, --reps >= 1, --max-tokens >= 2 and --prompt-words >= 1")
    report = measure(args.model, args.busy, args.prompt_words, args.max_tokens, args.reps)
    markdown = format_markdown(report)
    print(markdown)
    for path in write_report("load", report, markdown, args.out_dir or None, None, None):
        print(f"wrote {path}")
    return 0
