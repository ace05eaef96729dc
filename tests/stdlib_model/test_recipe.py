"""The default model's recipe end to end on a tiny scale: a made-up standard library's corpus, full
training of a tiny K3 on it, MXFP4 experts by `moeswap quantize`, the evaluation and the published
directory, whose card quotes the evaluation and whose model loads and generates."""

from __future__ import annotations

import json
import shutil

import pytest

from moeswap.quantize import quantize
from moeswap.stdlib_model import card, corpus, recipe
from moeswap.train.config import TrainConfig
from moeswap.train.loop import train


@pytest.mark.slow
def test_tiny_recipe_publishes_a_card_that_quotes_its_measurements(tiny_k3_dir, tmp_path, monkeypatch):
    lib = tmp_path / "lib"
    for i in range(12):
        (lib / f"m{i}.py").parent.mkdir(parents=True, exist_ok=True)
        (lib / f"m{i}.py").write_text("".join(f"def f{j}(x):\n    return x + {j}\n\n" for j in range(i + 3)))
    work = tmp_path / "work"
    corpus.write_corpus(work / "corpus", lib, max_chars=200, eval_per_mille=300)
    recipe.write_prompts(work)
    shutil.copytree(tiny_k3_dir, work / "base")
    cfg = TrainConfig(model=str(work / "base"), train_data=str(work / "corpus" / corpus.TRAIN_FILE),
                      eval_data=str(work / "corpus" / corpus.EVAL_FILE), output=str(work / "trained"), mode="full",
                      seq_len=96, truncate=True, packing="concat", micro_batch=2, max_steps=2, lr=1e-3)
    train(cfg, progress=False)
    monkeypatch.setattr(recipe, "CHECK_STEPS", 1)
    assert recipe.check(work) == (True, "reproduced: 1 steps and 1 evals reproduced exactly")
    quantize(work / "trained", work / "mxfp4")
    monkeypatch.setattr("moeswap.stdlib_model.evaluate.PROMPTS", ("def ",))
    report = card.write_evaluation(work)
    out = card.publish(work, tmp_path / "published")

    text = (out / "README.md").read_text()
    mx = report["models"]["MXFP4 experts"]
    assert f"{mx['loss']:.4f}" in text and f"{report['unigram']['perplexity']:.1f}" in text
    for dense, name in card.DENSE_ROWS.items():  # the shipped model with its dense weights quantised at load
        row = report["models"][name]
        assert row["dense_weights"] == dense and f"`--dense-weights {dense}` | {row['loss']:.4f}" in text
    assert report["samples"][0]["prompt"] == "def " and report["samples"][0]["greedy"] in text
    assert "`reproduced: 1 steps and 1 evals reproduced exactly`" in text
    assert json.loads((out / "manifest.json").read_text())["steps"] == 2
    assert (out / recipe.PROMPTS_FILE).read_text().startswith("def f0(x):")
    assert not (out / "checkpoints").exists()
    from moeswap.engine.generate import GenerationConfig, generate
    from moeswap.models.loader import load_model

    model, store = load_model(out)
    try:
        assert len(generate(model, [1, 2, 3], GenerationConfig(max_tokens=3, stop_ids=())).tokens) == 3
    finally:
        store.close()


def test_initial_weights_zero_the_pseudo_queries_and_keep_the_rest(tiny_k3_dir, tmp_path):
    import torch

    from moeswap.models.loader import load_model
    from moeswap.options import LoadOptions

    out = recipe.initial_weights(tiny_k3_dir, tmp_path / "base")
    new, new_store = load_model(out, LoadOptions(dense_weights="compute"))
    old, old_store = load_model(tiny_k3_dir, LoadOptions(dense_weights="compute"))
    try:
        before = dict(old.named_parameters())
        zeroed = 0
        for name, p in new.named_parameters():
            if name.endswith("res_proj.weight"):
                assert not p.any(), name
                zeroed += 1
            else:
                assert torch.equal(p, before[name].to(p.dtype)), name
        assert zeroed > 0
    finally:
        new_store.close()
        old_store.close()


def test_the_recipe_module_refuses_bad_usage_with_exit_2(capsys):
    from moeswap.stdlib_model.__main__ import USAGE, main

    assert main([]) == 2 and main(["publish", "only-one"]) == 2 and main(["train", "x"]) == 2
    assert capsys.readouterr().err.count(USAGE) == 3
