"""The card's measurements (stdlib_model/evaluate.py): the unigram baseline against its formula, and the
held-out loss of a model directory against a direct cross-entropy over the same targets."""

from __future__ import annotations

import json
import math

import torch
import torch.nn.functional as F

from moeswap.stdlib_model import evaluate as ev
from moeswap.stdlib_model.corpus import EVAL_FILE, TRAIN_FILE
from moeswap.train.data import Sample


def test_unigram_loss_is_the_smoothed_frequency_cross_entropy():
    train = [Sample((1, 2, 2, 3), (False, True, True, True), "a"), Sample((2, 4), (False, True), "b")]
    held = [Sample((9, 2, 5), (False, True, True), "c")]
    vocab = 6
    counts = {2: 2, 3: 1, 4: 1}  # the targets of the train split
    total = 4 + vocab
    want = -(math.log((counts[2] + 1) / total) + math.log(1 / total)) / 2
    assert math.isclose(ev.unigram_loss(train, held, vocab), want, rel_tol=1e-12)


def test_heldout_loss_is_the_mean_next_token_cross_entropy(tiny_k3_dir, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    texts = ["def f(x):\n    return x\n", "import os\nprint(os.sep)\n", "class A:\n    pass\n"]
    for name in (TRAIN_FILE, EVAL_FILE):
        (corpus / name).write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    report = ev.evaluate_models(corpus, {"a": tiny_k3_dir, "b": tiny_k3_dir}, seq_len=64)
    a, b = report["models"]["a"], report["models"]["b"]
    assert a["loss"] == b["loss"] and math.isclose(a["perplexity"], math.exp(a["loss"]))

    from moeswap.models.loader import load_model
    from moeswap.text.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_k3_dir)
    model, store = load_model(tiny_k3_dir)
    nll, n = 0.0, 0
    with torch.no_grad():
        for t in texts:
            ids = tok.encode(t) + [tok.eos_ids[0]]
            logits = model(torch.tensor([ids]))[0, :-1].float()
            nll += F.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum").item()
            n += len(ids) - 1
    store.close()
    assert report["heldout_target_tokens"] == n
    assert math.isclose(a["loss"], nll / n, rel_tol=1e-4)
    assert report["unigram"]["loss"] > 0
