"""`moeswap bench train LINEAR [--k3 K3]`: LoRA fine-tuning tokens/s and peak memory, moeswap against PEFT +
transformers on one Kimi Linear checkpoint (the same rows, LoRA, optimiser and steps, each in its own
process), and moeswap on a K3 checkpoint at full and reduced expert budgets. Entry points: `add_parser`,
`run`; `python -m moeswap.bench.train --worker peft SPEC.json` is the PEFT process.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from moeswap import jsonio
from moeswap.bench import RESULTS_DIR

PEFT_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
K3_TARGETS = "q_proj,k_proj,v_proj,o_proj,w1,w2,w3"
PEFT_NAME = "PEFT + transformers KimiLinearForCausalLM (eager, fp32)"


# ----------------------------------------------------------------------------------------------------
# The data


def write_data(path: Path, model_dir: str, samples: int, seq_len: int, seed: int = 0) -> Path:
    """JSONL of {"text"}: random words that are one token each, more than seq_len of them (cut to it)."""
    from moeswap.text.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    words = []
    for i in range(tok.vocab_size):
        s = "" if i in tok.id_to_special else tok.decode([i])
        if s.startswith(" ") and s[1:].isalpha() and tok.encode(s) == [i]:
            words.append(s)
        if len(words) >= 2000:
            break
    if len(words) < 10:
        raise ValueError(f"{model_dir}: its tokenizer has too few one-token words for the benchmark's text")
    rng = random.Random(seed)
    lines = [json.dumps({"text": "".join(rng.choice(words) for _ in range(seq_len + 8))}) for _ in range(samples)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def train_config(model: str, data: Path, out: Path, a: argparse.Namespace, targets: str, expert_memory: int | None):
    from moeswap.options import LoadOptions
    from moeswap.train.config import TrainConfig

    load = LoadOptions() if expert_memory is None else LoadOptions(expert_memory=expert_memory)
    return TrainConfig(model=model, train_data=str(data), seq_len=a.seq_len, truncate=True, mode="lora",
                       target_modules=tuple(t for t in targets.split(",") if t), rank=a.rank, alpha=2.0 * a.rank,
                       lr=a.lr, schedule="constant", max_steps=a.steps, micro_batch=a.micro_batch, output=str(out),
                       load=load)


def step_batches(cfg) -> list[dict]:
    """The micro-batches `moeswap train` runs for cfg, as token and label lists (labels: the next token,
    or -100), in its order: what the PEFT run gets."""
    from moeswap.text.tokenizer import load_tokenizer
    from moeswap.train.data import RowStream, batch, load_data

    tok = load_tokenizer(cfg.model)
    data = load_data(cfg, tok)
    stream = RowStream(data.train, cfg.seed, cfg.seq_len, cfg.packing)
    out = []
    for step in range(cfg.max_steps):
        rows = stream.rows(step * cfg.rows_per_step, cfg.rows_per_step)
        tokens, labels = batch(rows, tok.eos_ids[0])
        out.append({"tokens": tokens.tolist(), "labels": labels.tolist(), "real": sum(len(i) for i, _ in rows)})
    return out


# ----------------------------------------------------------------------------------------------------
# The runs, each in its own process


def _env(threads: int) -> dict:
    src = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "PYTHONPATH": src + (os.pathsep + path if path else "")}


def run_moeswap(cfg, threads: int, timeout: float) -> dict:
    """`moeswap train CONFIG` in a fresh process; what its manifest says."""
    import yaml

    out = Path(cfg.output)
    spec = out.with_suffix(".yaml")
    data = cfg.as_dict()
    data.update(data.pop("load"))
    spec.write_text(yaml.safe_dump(data))
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "moeswap", "train", str(spec), "--no-progress"], env=_env(threads),
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"moeswap train exited {done.returncode}: {done.stderr.strip()[-800:]}")
    m = json.loads((out / "manifest.json").read_text())
    store = m["expert_store"]
    later = m["curve"][1:]
    return {"tokens_per_s": m["tokens_per_s"],
            "steady_tokens_per_s": sum(p["tokens"] for p in later) / sum(p["time_s"] for p in later) if later else None,
            "peak_rss_bytes": m["peak_rss_bytes"], "train_s": m["train_s"],
            "tokens": m["tokens"], "steps": m["steps"], "first_loss": m["curve"][0]["loss"],
            "last_loss": m["curve"][-1]["loss"], "trainable_parameters": m["trainable"]["parameters"],
            "trainable_tensors": m["trainable"]["tensors"], "process_s": time.perf_counter() - t0,
            "expert_hit_rate": store.get("hit_rate"), "expert_evictions": store["tiers"]["fast"]["evictions"],
            "graph": store.get("graph"), "expert_memory": cfg.load.expert_memory}


def run_peft(model: str, batches_file: Path, a: argparse.Namespace, threads: int, timeout: float) -> dict:
    spec = batches_file.with_suffix(".spec.json")
    spec.write_text(json.dumps({"model": model, "batches": str(batches_file), "rank": a.rank, "alpha": 2.0 * a.rank,
                                "targets": [t for t in a.targets.split(",") if t], "lr": a.lr, "threads": threads}))
    done = subprocess.run([sys.executable, "-m", "moeswap.bench.train", "--worker", "peft", str(spec)],
                          env=_env(threads), capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"the PEFT run exited {done.returncode}: {done.stderr.strip()[-800:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def peft_worker(spec_path: str) -> dict:
    """The PEFT process: transformers' Kimi Linear with PEFT's LoRA, the loop `moeswap train` runs."""
    import warnings

    import torch
    import torch.nn.functional as F

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    import peft
    from transformers import KimiLinearForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = KimiLinearForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
        model = peft.get_peft_model(base, peft.LoraConfig(r=spec["rank"], lora_alpha=spec["alpha"], lora_dropout=0.0,
                                                          target_modules=spec["targets"]))
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.0}], lr=spec["lr"], betas=(0.9, 0.999), eps=1e-8,
                            foreach=False)
    model.train()
    batches = json.loads(Path(spec["batches"]).read_text())
    losses, tokens, train_s, times = [], 0, 0.0, []
    for b in batches:
        t0 = time.perf_counter()
        ids, labels = torch.tensor(b["tokens"]), torch.tensor(b["labels"])
        logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
        targets = int((labels != -100).sum())
        (loss / targets).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        train_s += times[-1]
        losses.append(loss.item() / targets)
        tokens += b["real"]
    from moeswap.procfs import peak_rss_bytes

    later = batches[1:]
    return {"tokens_per_s": tokens / train_s, "peak_rss_bytes": peak_rss_bytes(),
            "steady_tokens_per_s": sum(b["real"] for b in later) / sum(times[1:]) if later else None,
            "train_s": train_s, "tokens": tokens,
            "steps": len(batches), "first_loss": losses[0], "last_loss": losses[-1],
            "trainable_parameters": sum(p.numel() for p in params), "trainable_tensors": len(params),
            "versions": {"peft": peft.__version__, "transformers": __import__("transformers").__version__}}


# ----------------------------------------------------------------------------------------------------
# The benchmark


def measure(a: argparse.Namespace, work: Path) -> dict:
    """Same work for both on Kimi Linear: the rows `moeswap train` makes from one synthetic JSONL (random one-token
    words, every sample cut to --seq-len tokens, no packing: each row is seq_len real tokens), in its order; the
    same LoRA (rank, alpha, no dropout, --targets: modules both reach; PEFT cannot target transformers' fused
    routed experts), AdamW (constant lr, betas, eps 1e-8, no weight decay), gradient clipping at 1.0, micro-batch
    and steps, fp32 math. moeswap runs as users run it (`moeswap train CONFIG`, its manifest's tokens/s and peak
    RSS); PEFT as `get_peft_model` on `KimiLinearForCausalLM.from_pretrained(dtype=float32)` with a plain loop
    (no Trainer overhead) and the same loss. Each run is its own process with the same threads
    (OMP_NUM_THREADS, torch.set_num_threads); tokens/s = real tokens / time in the training steps (the first
    included: both pay their warm-up alike), peak RSS = the process's VmHWM (model load included). The first
    step's loss of both is reported as a check that they train the same model on the same data (B = 0 at
    the start: the base model's loss, equal up to fp32 rounding); and tokens/s after the first step (the
    steady state, without either's warm-up: lazy imports, kernel loads, experts' first reads).
    K3 runs: `moeswap train` with expert LoRA too (--k3-targets), at each --budgets percentage of the routed
    experts' bytes (100: all resident)."""
    from moeswap.bench.sidebyside import machine_info
    from moeswap.config import load_config

    if load_config(a.model).arch != "kimi_linear":
        raise ValueError(f"{a.model}: bench train compares with transformers' KimiLinearForCausalLM; give a Kimi "
                         f"Linear checkpoint (moeswap init-tiny DIR --arch kimi_linear --size small), and K3 as --k3")
    rows = a.steps * a.micro_batch
    report = {"bench": "train", "machine": machine_info(a.threads), "model": a.model, "k3": a.k3,
              "settings": {"steps": a.steps, "micro_batch": a.micro_batch, "seq_len": a.seq_len, "rank": a.rank,
                           "alpha": 2.0 * a.rank, "lr": a.lr, "targets": a.targets, "k3_targets": a.k3_targets,
                           "budgets": a.budgets, "threads": a.threads, "rounds": a.rounds},
              "linear": {}, "k3_runs": [], "skipped": {}}
    data = write_data(work / "linear.jsonl", a.model, rows, a.seq_len)
    from moeswap.bench.peers import hf

    ok, why = hf.available()
    try:
        import peft  # noqa: F401
    except ImportError as err:
        ok, why = False, f"peft is not importable ({err})"
    if not ok:
        report["skipped"]["peft"] = why
    # rounds alternate moeswap and PEFT, so that a shared machine's slow spell hits both sides
    rounds = []
    for i in range(a.rounds):
        cfg = train_config(a.model, data, work / f"linear-moeswap-{i}", a, a.targets, None)
        r = {"moeswap": run_moeswap(cfg, a.threads, a.timeout)}
        if ok:
            batches = work / "linear-batches.json"
            batches.write_text(json.dumps(step_batches(cfg)))
            r["peft"] = run_peft(a.model, batches, a, a.threads, a.timeout)
            ours, theirs = r["moeswap"], r["peft"]
            r["speedup"] = ours["tokens_per_s"] / theirs["tokens_per_s"]
            if ours["steady_tokens_per_s"] and theirs["steady_tokens_per_s"]:
                r["steady_speedup"] = ours["steady_tokens_per_s"] / theirs["steady_tokens_per_s"]
            r["memory_ratio"] = ours["peak_rss_bytes"] / theirs["peak_rss_bytes"]
        rounds.append(r)
    # the round with the median ratio stands for the run (its runs, its ratios); every round's are kept
    middle = sorted(rounds, key=lambda r: r.get("speedup", 0.0))[(len(rounds) - 1) // 2]
    report["linear"] = {**middle, "rounds": rounds}
    if a.k3:
        total = expert_bytes(a.k3)
        k3_data = write_data(work / "k3.jsonl", a.k3, rows, a.seq_len)
        for pct in a.budgets:
            budget = max(1, total * pct // 100)
            cfg = train_config(a.k3, k3_data, work / f"k3-{pct}", a, a.k3_targets, budget)
            report["k3_runs"].append({"budget_percent": pct, "expert_bytes": total,
                                      **run_moeswap(cfg, a.threads, a.timeout)})
        full = next((r for r in report["k3_runs"] if r["budget_percent"] == 100), None)
        for r in report["k3_runs"]:
            r["slowdown_vs_100"] = full["tokens_per_s"] / r["tokens_per_s"] if full else None
            r["steady_slowdown_vs_100"] = (full["steady_tokens_per_s"] / r["steady_tokens_per_s"]
                                           if full and r["steady_tokens_per_s"] else None)
    report["load_average_end"] = os.getloadavg()
    return report


def expert_bytes(model_dir: str) -> int:
    """The routed experts' bytes in the fast tier (what a 100 % budget holds)."""
    from moeswap.models.loader import load_model
    from moeswap.options import LoadOptions

    _, store = load_model(model_dir, LoadOptions())
    try:
        return sum(store.fast.cost(k) for k in store.index.entries)
    finally:
        store.close()


def format_markdown(report: dict) -> str:
    m, s = report["machine"], report["settings"]
    lines = [f"bench train, {m['date']}: {m['threads']} threads on {m['cores']} cores ({m['cpu']}), git {m['git']}, "
             f"load average {m['load_average'][0]:.1f} at start, {report['load_average_end'][0]:.1f} at the end",
             f"LoRA r={s['rank']}, alpha={s['alpha']:g}, lr {s['lr']:g}; {s['steps']} steps of {s['micro_batch']} rows x "
             f"{s['seq_len']} tokens; fp32 math", "",
             f"Kimi Linear `{report['model']}`, targets {s['targets']}:", "",
             "| run | tokens/s | after step 1 | peak RSS | first-step loss | last loss | trainable params |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, label in (("moeswap", "moeswap train"), ("peft", PEFT_NAME)):
        r = report["linear"].get(name)
        if r is not None:
            lines.append(f"| {label} | {r['tokens_per_s']:.1f} | {_num(r['steady_tokens_per_s'])} | "
                         f"{r['peak_rss_bytes'] / 2**20:.0f} MiB | {r['first_loss']:.4f} | {r['last_loss']:.4f} | "
                         f"{r['trainable_parameters']:,} |")
    if "speedup" in report["linear"]:
        steady = report["linear"].get("steady_speedup")
        lines += ["", f"moeswap / PEFT: {report['linear']['speedup']:.2f}x tokens/s"
                      + (f" ({steady:.2f}x after step 1)" if steady else "") + ", "
                      f"{report['linear']['memory_ratio']:.2f}x peak RSS"]
        rounds = report["linear"]["rounds"]
        if len(rounds) > 1:
            lines[-1] += f"; the median of {len(rounds)} rounds, shown above"
            lines.append("each round, moeswap / PEFT tokens/s (peak RSS): " + ", ".join(
                f"{r['speedup']:.2f}x ({r['memory_ratio']:.2f}x)" for r in rounds))
    for peer, why in report["skipped"].items():
        lines.append(f"- {peer}: SKIPPED, {why}")
    if report["k3_runs"]:
        lines += ["", f"K3 `{report['k3']}`, targets {s['k3_targets']} (routed experts through the store):", "",
                  "| expert budget | tokens/s | after step 1 | time vs 100 % (after step 1) | peak RSS | "
                  "fast-tier hit rate | evictions | refetched for backward | last loss |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in report["k3_runs"]:
            g = r.get("graph") or {}
            slow, steady = r.get("slowdown_vs_100"), r.get("steady_slowdown_vs_100")
            lines.append(f"| {r['budget_percent']} % ({r['expert_memory'] / 2**20:.1f} MiB) | {r['tokens_per_s']:.1f} | "
                         f"{_num(r['steady_tokens_per_s'])} | {'-' if slow is None else f'{slow:.2f}x'}"
                         f"{'' if steady is None else f' ({steady:.2f}x)'} | {r['peak_rss_bytes'] / 2**20:.0f} MiB | "
                         f"{(r['expert_hit_rate'] or 0):.0%} | {r['expert_evictions']} | {g.get('refetched', '-')} | "
                         f"{r['last_loss']:.4f} |")
    return "\n".join(lines)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def add_parser(benches) -> None:
    b = benches.add_parser("train", help="LoRA fine-tuning tokens/s and peak RSS: moeswap vs PEFT + transformers "
                                         "(Kimi Linear), and K3 at reduced expert budgets")
    b.add_argument("model", help="Kimi Linear checkpoint (moeswap init-tiny DIR --arch kimi_linear --size small)")
    b.add_argument("--k3", metavar="DIR", help="a K3 checkpoint to train at each --budgets expert budget")
    b.add_argument("--steps", type=int, default=8, help="optimizer steps per run (default 8)")
    b.add_argument("--micro-batch", type=int, default=2, help="rows per step (default 2)")
    b.add_argument("--seq-len", type=int, default=256, help="tokens per row (default 256)")
    b.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 x rank)")
    b.add_argument("--lr", type=float, default=1e-4)
    b.add_argument("--targets", default=PEFT_TARGETS, help=f"Kimi Linear LoRA targets (default {PEFT_TARGETS})")
    b.add_argument("--k3-targets", default=K3_TARGETS, help=f"K3 LoRA targets (default {K3_TARGETS})")
    b.add_argument("--budgets", default="100,25", help="K3 expert budgets, percent of the experts' bytes")
    b.add_argument("--threads", type=int, default=2, help="threads of every run (default 2)")
    b.add_argument("--rounds", type=int, default=1,
                   help="Kimi Linear runs of each side, alternating; the report stands on the median ratio (default 1)")
    b.add_argument("--timeout", type=float, default=1800, help="seconds one run may take")
    b.add_argument("--out-dir", default=RESULTS_DIR,
                   help="where the JSON and markdown go ('' = only print; default %(default)s)")
    b.add_argument("--json", metavar="FILE", help="JSON path (default: OUT_DIR/train-<time>.json)")
    b.add_argument("--markdown", metavar="FILE", help="markdown path (default: OUT_DIR/train-<time>.md)")


def run(args: argparse.Namespace) -> int:
    from moeswap.bench import sidebyside as sbs

    args.budgets = sbs.int_list(args.budgets, "--budgets")
    for flag in ("steps", "micro_batch", "rank", "threads", "rounds"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1")
    if args.seq_len < 2:
        raise ValueError("--seq-len must be >= 2")
    for d in (args.model, args.k3):
        if d is not None and not (Path(d) / "config.json").is_file():
            raise FileNotFoundError(f"{d}: no config.json; give a checkpoint directory")
    # absolute: the runs' CONFIG.yaml lives in a temporary directory, and its relative paths resolve there
    args.model = os.path.abspath(args.model)
    args.k3 = None if args.k3 is None else os.path.abspath(args.k3)
    with tempfile.TemporaryDirectory(prefix="moeswap-bench-train-") as work:
        report = measure(args, Path(work))
    md = format_markdown(report)
    print(md)
    for path in sbs.write_report("train", report, md, args.out_dir or None, args.json, args.markdown):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker" and sys.argv[2] == "peft":
        print(jsonio.dumps(peft_worker(sys.argv[3])))
    else:
        sys.exit("usage: python -m moeswap.bench.train --worker peft SPEC.json")
