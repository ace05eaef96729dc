"""What the default model's card reports, measured: held-out loss and perplexity of one or more model
directories (bf16 experts, MXFP4 experts) against a unigram baseline, and sample generations.

The held-out set is the corpus's eval split, tokenized and masked exactly as training's eval (train/data.py:
each piece plus EOS, every token after the first a target), and the loss is train/loop.py's `evaluate`, so
the card's numbers and the training manifest's eval curve are one measurement. The unigram baseline
predicts every token by its frequency in the train split (add-one smoothed over the vocabulary): what a
model that ignores context can reach. Entry point: `evaluate_models(corpus_dir, models, prompts)`.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import torch

from moeswap.stdlib_model.corpus import EVAL_FILE, TRAIN_FILE

# Openings every Python programmer recognises; the card shows what the model writes after each.
# Prompts end on a whole word: the tokenizer joins a space to the word after it, so a prompt ending in a space
# leaves a token the model never saw before a word (the greedy text then derails at once).
PROMPTS = ("import os\nimport sys\n\n\ndef", "class Stack:\n    \"\"\"A last-in, first-out stack.\"\"\"\n\n    def",
           "    def __repr__(self):\n        return", "for i in range(", "try:\n    import threading\nexcept")


def _data(model_dir: Path, corpus_dir: Path, seq_len: int):
    from moeswap.text.tokenizer import load_tokenizer
    from moeswap.train.config import TrainConfig
    from moeswap.train.data import load_data

    cfg = TrainConfig(model=str(model_dir), train_data=str(corpus_dir / TRAIN_FILE),
                      eval_data=str(corpus_dir / EVAL_FILE), output="unused", seq_len=seq_len, truncate=True)
    tok = load_tokenizer(model_dir)
    return cfg, tok, load_data(cfg, tok)


def unigram_loss(train, held_out, vocab_size: int) -> float:
    """Mean cross-entropy (nats per target token) of held-out samples under the train split's unigram."""
    counts = Counter(t for s in train for t, m in zip(s.ids, s.mask) if m)
    total = sum(counts.values()) + vocab_size
    nll, n = 0.0, 0
    for s in held_out:
        for t, m in zip(s.ids, s.mask):
            if m:
                nll -= math.log((counts.get(t, 0) + 1) / total)
                n += 1
    return nll / n


def heldout_loss(model_dir: str | Path, rows, pad_id: int, cfg, dense_weights: str = "auto") -> float:
    from moeswap.models.loader import load_model
    from moeswap.options import LoadOptions
    from moeswap.train.loop import evaluate

    model, store = load_model(model_dir, LoadOptions(dense_weights=dense_weights))
    try:
        return evaluate(model, rows, pad_id, cfg.replace(micro_batch=4), torch.device("cpu"))
    finally:
        store.close()


def samples(model_dir: str | Path, prompts=None, max_tokens: int = 96, seed: int = 0) -> list[dict]:
    """Greedy and sampled (temperature 0.8, top-p 0.95, seeded) continuations of each prompt (default PROMPTS)."""
    from moeswap.engine.generate import GenerationConfig, generate
    from moeswap.engine.sampling import SamplingParams
    from moeswap.models.loader import load_model
    from moeswap.options import LoadOptions
    from moeswap.text.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    model, store = load_model(model_dir, LoadOptions())
    out = []
    try:
        for prompt in PROMPTS if prompts is None else prompts:
            ids = tok.encode(prompt)
            entry = {"prompt": prompt}
            for name, sampling in (("greedy", SamplingParams()), ("sampled", SamplingParams(0.8, 0, 0.95))):
                got = generate(model, ids, GenerationConfig(max_tokens=max_tokens, sampling=sampling, seed=seed))
                entry[name] = tok.decode(got.tokens)
            out.append(entry)
    finally:
        store.close()
    return out


def evaluate_models(corpus_dir: str | Path, models: dict[str, str | Path], seq_len: int = 1024,
                    with_samples: str | None = None, dense_weights: dict[str, str] | None = None) -> dict:
    """{"unigram": ..., "models": {name: {"loss", "perplexity"}}, "samples": [...] of `with_samples`};
    dense_weights: a model's --dense-weights (default auto), e.g. int8 / int4 to measure their cost."""
    corpus_dir = Path(corpus_dir)
    first = Path(next(iter(models.values())))
    cfg, tok, data = _data(first, corpus_dir, seq_len)
    from moeswap.train.data import eval_rows

    rows = eval_rows(data.eval)
    targets = sum(s.targets for s in data.eval)
    uni = unigram_loss(data.train, data.eval, tok.vocab_size)
    report = {"heldout_samples": len(data.eval), "heldout_target_tokens": targets,
              "unigram": {"loss": uni, "perplexity": math.exp(uni)}, "models": {}}
    for name, path in models.items():
        dense = (dense_weights or {}).get(name, "auto")
        loss = heldout_loss(path, rows, tok.eos_ids[0], cfg, dense)
        report["models"][name] = {"path": str(path), "dense_weights": dense, "loss": loss,
                                  "perplexity": math.exp(loss)}
    if with_samples is not None:
        report["samples"] = samples(models[with_samples])
    return report
