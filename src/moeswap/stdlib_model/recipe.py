"""The steps that rebuild the default model from nothing but this interpreter and moeswap.

`prepare(work)` writes work/corpus/ (corpus.py), work/base/ (a K3-layout model of init-tiny's "stdlib"
size, random weights, its byte-level BPE trained on the corpus's train split), work/train.yaml (the
training run, relative paths) and work/heldout-prompts.txt (held-out openings for traces and benchmarks). Then `moeswap train work/train.yaml` trains every weight (full mode, routed
experts included) and `moeswap quantize work/trained work/mxfp4 --experts mxfp4` stores the experts as
MXFP4. scripts/train-default-model.sh runs all of it.
"""

from __future__ import annotations

import json
from pathlib import Path

from moeswap.stdlib_model import corpus

SIZE = "stdlib"
SEED = 0
# The run: rows of 1024 tokens packed from whole pieces (a 2000-character piece is ~600 tokens; the rare
# denser one is cut), 2 rows a step, AdamW with warm-up and cosine decay to a tenth. 1000 steps see ~1.5 M
# real tokens, about half the train split (its time: docs/benchmarks.md). MAX_STEPS is the knob for a longer
# run (the schedule follows it).
MAX_STEPS = 1000
TRAIN = {
    "model": "base", "train_data": "corpus/train.jsonl", "eval_data": "corpus/eval.jsonl", "output": "trained",
    "mode": "full", "seq_len": 1024, "truncate": True, "packing": "concat", "micro_batch": 2, "grad_accum": 1,
    "lr": 1.0e-3, "min_lr_ratio": 0.1, "warmup_steps": 30, "weight_decay": 0.1, "betas": [0.9, 0.95],
    "max_grad_norm": 1.0, "max_steps": MAX_STEPS, "router_bias_rate": 1.0e-3, "eval_interval": 250,
    "save_interval": 50, "keep_checkpoints": 2, "loss_chunk": 1024, "seed": SEED,
}
EVAL_PER_MILLE = 20  # ~2 % of the files held out: ~80 k tokens, quick to evaluate


def tokenizer_lines(train_jsonl: Path) -> list[str]:
    with open(train_jsonl, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def initial_weights(random_dir: Path, out: Path) -> Path:
    """The run's starting point: init-tiny's random K3 with its attention-residual pseudo-queries zeroed,
    so every mix over depth starts as the plain average (init-tiny's ~1 vectors make each mix a nearly
    one-hot pick of one source, through which little gradient flows), routed experts as bf16."""
    import torch

    from moeswap.atomic_dir import atomic_directory
    from moeswap.models.loader import load_model
    from moeswap.options import LoadOptions
    from moeswap.train.experts import make_experts_trainable
    from moeswap.train.export import write_model

    model, store = load_model(random_dir, LoadOptions(dense_weights="compute"))
    try:
        make_experts_trainable(model)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("res_proj.weight"):
                    p.zero_()
        with atomic_directory(out) as tmp:
            write_model(model, random_dir, tmp)
    finally:
        store.close()
    return out


def prepare(work: str | Path) -> Path:
    import yaml

    from moeswap.tiny.model import write_tiny_model

    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    corpus.write_corpus(work / "corpus", eval_per_mille=EVAL_PER_MILLE)
    write_tiny_model(work / "random", "kimi_k3", SIZE, seed=SEED, progress=True,
                     tokenizer_lines=tokenizer_lines(work / "corpus" / corpus.TRAIN_FILE))
    initial_weights(work / "random", work / "base")
    (work / "train.yaml").write_text(yaml.safe_dump(TRAIN, sort_keys=False))
    write_prompts(work)
    return work


CHECK_STEPS = 20  # what `check` runs again of the finished run
REPRODUCTION = "reproduction.txt"  # ... and where it leaves its verdict, which the card quotes


def check(work: str | Path) -> tuple[bool, str]:
    """The finished run's first CHECK_STEPS steps again from its manifest (train --reproduce --first-steps),
    into work/reproduce-check; the verdict line goes to work/reproduction.txt too."""
    from moeswap.train.loop import reproduce

    work = Path(work)
    ok, message, _ = reproduce(work / "trained" / "manifest.json", work / "reproduce-check", progress=False,
                               first_steps=CHECK_STEPS)
    line = ("reproduced: " if ok else "NOT reproduced: ") + message
    (work / REPRODUCTION).write_text(line + "\n")
    return ok, line


PROMPTS_FILE = "heldout-prompts.txt"


def write_prompts(work: str | Path, count: int = 16) -> Path:
    """work/heldout-prompts.txt: the first line of the first `count` held-out pieces that open a def or a
    class, one per line: real prompts the model never trained on (`moeswap trace`, `bench swap --prompts`)."""
    work = Path(work)
    lines = []
    with open(work / "corpus" / corpus.EVAL_FILE, encoding="utf-8") as f:
        for line in f:
            first = json.loads(line)["text"].split("\n", 1)[0]
            if first.startswith(("def ", "class ")) and first not in lines:
                lines.append(first)
            if len(lines) == count:
                break
    path = work / PROMPTS_FILE
    path.write_text("".join(p + "\n" for p in lines), encoding="utf-8")
    return path
