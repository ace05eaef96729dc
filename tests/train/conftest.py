"""The training tests' task and settings: a tiny K3 (the session's, seed 0) and a synthetic task it cannot
know, chains of words where each word fixes the next by a random permutation (every target but a
sample's first word is predictable once the permutation is learnt, and nothing in the init knows it)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from moeswap.text.tokenizer import load_tokenizer
from moeswap.train.config import TrainConfig


def single_token_words(tok, n: int) -> list[str]:
    """n words that are one token each with their leading space, so a chain's ids are its words' ids."""
    words = []
    for i in range(tok.vocab_size):
        s = "" if i in tok.id_to_special else tok.decode([i])
        if s.startswith(" ") and s[1:].isalpha() and len(s) > 2 and tok.encode(s) == [i]:
            words.append(s)
    assert len(words) >= n, f"the tiny tokenizer has only {len(words)} one-token words"
    return words[:n]


def write_chains(path: Path, tok, *, samples: int, words: int = 8, length: int = 8, seed: int = 1) -> Path:
    """JSONL of {"text": chain}: a start word, then each word the permutation's image of the one before."""
    vocab = single_token_words(tok, words)
    rng = random.Random(seed)
    image = vocab[:]
    rng.shuffle(image)
    step = dict(zip(vocab, image))
    lines = []
    for _ in range(samples):
        w = rng.choice(vocab)
        chain = [w]
        for _ in range(length - 1):
            w = step[w]
            chain.append(w)
        lines.append(json.dumps({"text": "".join(chain)}))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# LoRA on attention, the routed experts and the output head: the lora-mode runs' targets
LORA_TARGETS = ("q_proj", "o_proj", "w1", "w2", "w3", "lm_head")
LORA_RUN = dict(mode="lora", target_modules=LORA_TARGETS, rank=16, alpha=32.0, lr=2e-2)


@pytest.fixture(scope="session")
def k3_tok(tiny_k3_dir):
    return load_tokenizer(tiny_k3_dir)


@pytest.fixture(scope="session")
def chains(tiny_k3_dir, k3_tok, tmp_path_factory) -> Path:
    return write_chains(tmp_path_factory.mktemp("data") / "chains.jsonl", k3_tok, samples=40)


@pytest.fixture
def small_run(tiny_k3_dir, chains, tmp_path):
    """small_run(**changes) -> a TrainConfig of a few seconds: full mode on the chains, output in tmp_path
    (small_run(**LORA_RUN) for lora mode)."""

    def make(**changes) -> TrainConfig:
        base = dict(model=str(tiny_k3_dir), train_data=str(chains), eval_split=0.2, mode="full", lr=1e-2,
                    max_steps=4, micro_batch=2, seq_len=32, output=str(tmp_path / "out"))
        return TrainConfig(**{**base, **changes})

    return make


@pytest.fixture(scope="session")
def learned(tiny_k3_dir, k3_tok, tmp_path_factory):
    """One full-mode run on the chain task (20 steps), shared by the learning and manifest tests."""
    from moeswap.train.loop import train

    d = tmp_path_factory.mktemp("learned")
    data = write_chains(d / "chains.jsonl", k3_tok, samples=80, words=8, length=8)
    cfg = TrainConfig(model=str(tiny_k3_dir), train_data=str(data), eval_split=0.2, mode="full", lr=1e-2,
                      warmup_steps=2, max_steps=20, micro_batch=4, seq_len=32, eval_interval=10,
                      output=str(d / "out"))
    return train(cfg, progress=False)


@pytest.fixture(scope="session")
def lora_learned(tiny_k3_dir, k3_tok, tmp_path_factory):
    """One lora-mode run on the chain task (20 steps; adapters on attention, routed experts and lm_head)."""
    from moeswap.train.loop import train

    d = tmp_path_factory.mktemp("lora_learned")
    data = write_chains(d / "chains.jsonl", k3_tok, samples=80, words=8, length=8)
    cfg = TrainConfig(model=str(tiny_k3_dir), train_data=str(data), eval_split=0.2, warmup_steps=2, max_steps=20,
                      micro_batch=4, seq_len=32, eval_interval=10, output=str(d / "out"), **LORA_RUN)
    return train(cfg, progress=False)


@pytest.fixture(scope="session")
def lora_settings() -> dict:
    """The lora-mode runs' settings (TrainConfig fields): small_run(**lora_settings)."""
    return dict(LORA_RUN)
