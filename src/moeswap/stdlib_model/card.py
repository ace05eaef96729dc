"""The shipped default model: the MXFP4 model directory plus its record (manifest, loss curve, corpus and
evaluation JSON) and a model card written from those files, so every number on the card has a source.
Entry point: `publish(work, out)`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from moeswap import jsonio
from moeswap.atomic_dir import atomic_directory
from moeswap.stdlib_model import recipe
from moeswap.stdlib_model.recipe import PROMPTS_FILE, REPRODUCTION

RECORD = ("manifest.json", "loss.csv", "loss.png")


def _evals(m: dict) -> str:
    return ", ".join(f"{e['step']}: {e['loss']:.3f}" for e in m["eval"])


def _status(m: dict) -> str:
    """Whether the run had converged: the last eval interval's drop per step against the run's average."""
    evals = m["eval"]
    if len(evals) < 3:
        return ""
    (s0, l0), (s1, l1), (s2, l2) = [(e["step"], e["loss"]) for e in (evals[0], evals[-2], evals[-1])]
    late, overall = (l1 - l2) / max(1, s2 - s1), (l0 - l2) / max(1, s2 - s0)
    if late > 0.05 * overall:
        return ("The loss was still falling when the run ended: a short run, what one session of a shared 2-core "
                "machine afforded; a longer one (recipe.MAX_STEPS) should write much better code.")
    return "The loss had levelled off."


def card_text(work: Path, out: Path) -> str:
    m = json.loads((work / "trained" / "manifest.json").read_text())
    ev = json.loads((work / "evaluation.json").read_text())
    corpus = json.loads((work / "corpus" / "corpus.json").read_text())
    config = json.loads((out / "config.json").read_text())
    text = config.get("text_config", config)
    from moeswap.config import load_config
    from moeswap.planner.params import model_params

    params = model_params(load_config(out))
    total, active = params.total, params.active
    models = ev["models"]
    bf16, mx = models["bf16 experts"], models["MXFP4 experts"]
    env = m["environment"]
    hw = env.get("hardware", {})
    t = m["config"]
    lines = [
        "# stdlib-k3: a small Kimi K3-architecture model trained by moeswap on the Python standard library",
        "",
        "The default model of `make demo`, `moeswap serve` and the benchmarks: real weights in the real K3 layout",
        "(compressed-tensors MXFP4 routed experts, `language_model.` prefix), small enough to ship in the",
        "repository, trained from scratch by `moeswap train --mode full` on text every Python installation has.",
        "It writes Python-looking code; it is not a useful assistant.",
        "",
        "## Model",
        "",
        f"- {total / 1e6:.1f} M parameters, {active / 1e6:.1f} M active per token (embeddings excluded); "
        f"{text['num_hidden_layers']} layers, width {text['hidden_size']}, vocabulary {text['vocab_size']}.",
        f"- KDA layers {text['linear_attn_config']['kda_layers']} (bounded gate, full-rank output gate), gated "
        f"MLA layers {text['linear_attn_config']['full_attn_layers']} (1-based, as K3 lists them).",
        f"- Latent MoE: {text['num_experts']} routed experts, top-{text['num_experts_per_token']}, SiTU-GLU, "
        f"latent width {text['routed_expert_hidden_size']}, {text['num_shared_experts']} shared experts; the first "
        f"{text['first_k_dense_replace']} layer dense; block attention residuals of {text['attn_res_block_size']} "
        "layers.",
        "- Routed experts in MXFP4 (written by `moeswap quantize`; its per-tensor errors are in "
        "`quantization_report.json`); everything else bf16 (fp32 where K3 keeps it).",
        "",
        "## Data and tokenizer",
        "",
        f"- The standard library of CPython {corpus['python']} (`*.py`, test suites and site-packages left out), "
        f"licence {corpus['licence']}.",
        f"- Split by the SHA-256 of each file's path ({corpus['eval_per_mille']} per mille held out): train "
        f"{corpus['train.jsonl']['files']} files, {corpus['train.jsonl']['chars']:,} characters; held out "
        f"{corpus['eval.jsonl']['files']} files, {corpus['eval.jsonl']['chars']:,} characters. Files are cut at "
        f"top-level boundaries into pieces of at most {corpus['max_chars']} characters.",
        f"- Byte-level BPE of {text['vocab_size']} ids (Kimi's pre-tokenization, `tokenizers`) trained on the train "
        "split; the chat markers of the built-in template are special tokens.",
        "",
        "## Training",
        "",
        f"- `scripts/train-default-model.sh` (the exact steps; settings in `stdlib_model/recipe.py`): full mode, every "
        f"parameter, routed experts included; router biases balanced by K3's rule (rate {t['router_bias_rate']}).",
        f"- {m['steps']} steps of {t['micro_batch'] * t['grad_accum']} rows of {t['seq_len']} tokens, "
        f"{m['tokens']:,} tokens seen; AdamW lr {t['lr']} (warm-up {t['warmup_steps']}, cosine to "
        f"{t['min_lr_ratio']}×), weight decay {t['weight_decay']}, betas {t['betas']}, seed {t['seed']}.",
        f"- {m['wall_s'] / 3600:.2f} h wall on {hw.get('cpu', 'a CPU')} ({hw.get('torch_threads')} threads), "
        f"{m['tokens_per_s']:.0f} tokens/s; peak RSS {m['peak_rss_bytes'] / 2**30:.2f} GiB.",
        f"- Final expert load: worst layer max/mean {m.get('expert_load', {}).get('worst_max_over_mean')}.",
        "- `manifest.json` records everything (data hashes, base fingerprint, config, versions, the loss curve);",
        "  `loss.png` plots it.",
        f"- Held-out loss by step: {_evals(m)}. {_status(m)}",
        "",
        "## Held-out results",
        "",
        f"{ev['heldout_samples']} held-out pieces, {ev['heldout_target_tokens']:,} target tokens "
        "(`python -m moeswap.stdlib_model evaluate`):",
        "",
        "| | loss (nats/token) | perplexity |",
        "|---|---:|---:|",
        f"| unigram baseline (train-split frequencies) | {ev['unigram']['loss']:.4f} | {ev['unigram']['perplexity']:.1f} |",
        f"| this model, bf16 experts | {bf16['loss']:.4f} | {bf16['perplexity']:.2f} |",
        f"| this model, MXFP4 experts (shipped) | {mx['loss']:.4f} | {mx['perplexity']:.2f} |",
        *(f"| this model, MXFP4 experts, `--dense-weights {d}` | {models[n]['loss']:.4f} | "
          f"{models[n]['perplexity']:.2f} ({100 * (models[n]['perplexity'] / mx['perplexity'] - 1):+.2f} %) |"
          for d, n in DENSE_ROWS.items() if n in models),
        "",
        f"MXFP4 experts cost {100 * (mx['perplexity'] / bf16['perplexity'] - 1):+.2f} % held-out perplexity against "
        f"bf16 experts; the model's perplexity is {ev['unigram']['perplexity'] / mx['perplexity']:.1f}× below the "
        "unigram baseline's.",
        "",
        "## Samples",
        "",
        "Greedy and sampled (temperature 0.8, top-p 0.95, seed 0) continuations, 96 tokens, MXFP4 experts:",
        "",
    ]
    for s in ev.get("samples", []):
        for kind in ("greedy", "sampled"):
            lines += [f"{kind}:", "", "```python", s["prompt"] + s[kind], "```", ""]
    lines += [
        "## Reproducing",
        "",
        "`scripts/train-default-model.sh DIR` rebuilds corpus, tokenizer, initial weights and the run, then",
        "quantises, evaluates and writes this directory. `moeswap train --reproduce manifest.json --output DIR`",
        "reruns the recorded configuration and compares the loss curves step by step. On the same machine, thread",
        "count and library versions the run is deterministic (every random draw comes from the seed; the kernels",
        "sum in fixed orders); another CPU, thread count or torch build sums in other orders, and the curves then",
        "agree to rounding early and drift apart slowly. The corpus is this interpreter's standard library: another",
        "Python version gives other data (its SHA-256 then differs from the manifest's and --reproduce says so).",
        "",
    ]
    check = work / REPRODUCTION
    if check.is_file():
        n = recipe.CHECK_STEPS
        lines += [f"Checked after the run (`python -m moeswap.stdlib_model check`: `moeswap train --reproduce "
                  f"trained/manifest.json --first-steps {n}`, the run's first {n} steps on its schedule, same "
                  f"machine and thread count): `{check.read_text().strip()}`.", ""]
    lines += [
        "Licence: the weights Apache-2.0 (as moeswap); the training text is the PSF-licensed standard library.",
    ]
    return "\n".join(lines) + "\n"


def publish(work: str | Path, out: str | Path) -> Path:
    """Copies work/mxfp4 (the quantised model) and the run's record into `out` (atomically) with README.md."""
    work, out = Path(work), Path(out)
    with atomic_directory(out) as tmp:
        for p in sorted((work / "mxfp4").iterdir()):
            if p.is_file():
                shutil.copy2(p, tmp / p.name)
        for name in RECORD:
            if (work / "trained" / name).is_file():
                shutil.copy2(work / "trained" / name, tmp / name)
        shutil.copy2(work / "evaluation.json", tmp / "evaluation.json")
        shutil.copy2(work / "corpus" / "corpus.json", tmp / "corpus.json")
        shutil.copy2(work / PROMPTS_FILE, tmp / PROMPTS_FILE)
        (tmp / "README.md").write_text(card_text(work, tmp))
    return out


# the shipped model again with its dense weights quantised at load (weights/dense_quant.py): what they cost
DENSE_ROWS = {"int8": "MXFP4 experts, int8 dense", "int4": "MXFP4 experts, int4 dense"}


def write_evaluation(work: str | Path) -> dict:
    from moeswap.stdlib_model.evaluate import evaluate_models

    work = Path(work)
    models = {"bf16 experts": work / "trained", "MXFP4 experts": work / "mxfp4",
              **{n: work / "mxfp4" for n in DENSE_ROWS.values()}}
    report = evaluate_models(work / "corpus", models, with_samples="MXFP4 experts",
                             dense_weights={n: d for d, n in DENSE_ROWS.items()})
    (work / "evaluation.json").write_text(jsonio.dumps(report, indent=2) + "\n")
    return report
