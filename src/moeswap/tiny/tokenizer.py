"""The deterministic tiny tokenizers `moeswap init-tiny` ships, for test and demo models.

A byte-level BPE trained on the built-in corpus (corpus.txt, package data) with Kimi's pre-tokenization
and specials numbered after the BPE ranks, written as HF `tokenizer.json` or Kimi's `tiktoken.model`
(the same merges), each with its `tokenizer_config.json`. text/tokenizer.py loads what this writes.
Entry points: `build_tiny_tokenizer(out_dir, vocab_size)`, `build_tiny_tiktoken(out_dir, vocab_size)`, and
`train_bpe` (the same recipe on other text: the default model's tokenizer, stdlib_model/).
"""

from __future__ import annotations

import base64
from collections.abc import Iterable
from importlib import resources
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, trainers

from moeswap import jsonio
from moeswap.text.tokenizer import KIMI_PAT_STR, byte_level_token_bytes

# K2-style chat markers (the built-in chat template's) and K3's tag markers (its published template's)
DEFAULT_SPECIALS = ("<|bos|>", "<|end_of_msg|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>",
                    "<|open|>", "<|close|>", "<|sep|>")
_BOS_NAMES = ("<|bos|>", "[BOS]", "<s>")
_EOS_NAMES = ("<|end_of_msg|>", "[EOS]", "<|im_end|>", "</s>")


def build_tiny_tokenizer(out_dir: str | Path, vocab_size: int, specials: dict[str, int] | None = None,
                         lines: Iterable[str] | None = None) -> None:
    """Write a deterministic byte-level BPE tokenizer.json + tokenizer_config.json with exactly
    `vocab_size` ids, specials (content -> id) on the top ids, trained on `lines` (default: the built-in
    corpus)."""
    tok, id_to_special = train_bpe(vocab_size, specials, lines)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    _write_tiny_config(out, id_to_special, {"tokenizer_class": "PreTrainedTokenizerFast",
                                            "clean_up_tokenization_spaces": False})


def build_tiny_tiktoken(out_dir: str | Path, vocab_size: int, specials: dict[str, int] | None = None) -> None:
    """Kimi-format twin of build_tiny_tokenizer: the same merges as tiktoken.model ranks (rank = id,
    token = raw bytes) plus tokenizer_config.json, so the tiktoken path is testable offline."""
    tok, id_to_special = train_bpe(vocab_size, specials)
    n_ranks = tok.get_vocab_size(with_added_tokens=False)
    lines = []
    for i in range(n_ranks):
        raw = byte_level_token_bytes(tok.id_to_token(i))
        lines.append(f"{base64.b64encode(raw).decode('ascii')} {i}\n")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tiktoken.model").write_text("".join(lines), encoding="ascii")
    _write_tiny_config(out, id_to_special, {})


def _place_specials(vocab_size: int, specials: dict[str, int] | None) -> dict[int, str]:
    if specials is None:
        specials = {s: vocab_size - len(DEFAULT_SPECIALS) + k for k, s in enumerate(DEFAULT_SPECIALS)}
    if vocab_size < 256 + len(specials) + 1:
        raise ValueError(f"vocab_size {vocab_size} is too small: a byte-level BPE needs 256 byte tokens, "
                         f"at least one merge and {len(specials)} specials ({256 + len(specials) + 1} ids)")
    top = set(range(vocab_size - len(specials), vocab_size))
    if set(specials.values()) != top or len(specials) != len(top):
        raise ValueError(f"specials must take the top ids {min(top)}..{vocab_size - 1} once each "
                         f"(specials follow the BPE ranks, as in Kimi), found {sorted(specials.values())}")
    return {i: s for s, i in specials.items()}


def train_bpe(vocab_size: int, specials: dict[str, int] | None = None,
              lines: Iterable[str] | None = None) -> tuple[tokenizers.Tokenizer, dict[int, str]]:
    """The BPE (Kimi pre-tokenization, byte level) trained on `lines` (default: the built-in corpus), with
    specials on the top ids; returns it and id -> special."""
    id_to_special = _place_specials(vocab_size, specials)
    n_bpe = vocab_size - len(id_to_special)
    # ignore_merges: a piece that is itself a token is used whole, as tiktoken does, so both formats agree
    tok = tokenizers.Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(KIMI_PAT_STR), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=n_bpe, show_progress=False, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus_lines() if lines is None else lines, trainer=trainer)
    n_trained = tok.get_vocab_size(with_added_tokens=False)
    # A few-KB corpus runs out of pairs before big vocabularies: fill the gap with reserved specials
    for i in range(n_trained, n_bpe):
        id_to_special[i] = f"<|reserved_token_{i}|>"
    tok.add_special_tokens([AddedToken(id_to_special[i], special=True, normalized=False)
                            for i in sorted(id_to_special)])
    # add_special_tokens numbers tokens after the model's; check it put each where Kimi would
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size or any(
            tok.token_to_id(s) != i for i, s in id_to_special.items()):
        raise RuntimeError(f"BPE tokenizer ids came out wrong for vocab_size={vocab_size}")
    return tok, {i: id_to_special[i] for i in sorted(id_to_special)}


def _write_tiny_config(out: Path, id_to_special: dict[int, str], extra: dict[str, Any]) -> None:
    names = set(id_to_special.values())
    cfg: dict[str, Any] = {
        "added_tokens_decoder": {str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": True}
                                 for i, s in id_to_special.items()},
        "bos_token": next((s for s in _BOS_NAMES if s in names), None),
        "eos_token": next((s for s in _EOS_NAMES if s in names), None),
        **extra,
    }
    (out / "tokenizer_config.json").write_text(jsonio.dumps(cfg, indent=2, ensure_ascii=False) + "\n",
                                               encoding="utf-8")


def _corpus_lines() -> list[str]:
    # Upper- and title-case copies give the trainer enough distinct pairs for vocabularies of ~4k
    lines = [ln for ln in corpus_text().splitlines() if ln.strip()]
    return lines + [ln.upper() for ln in lines] + [ln.title() for ln in lines]


def corpus_text() -> str:
    """The training text: written for this project, plain prose, a little code and numbers, and a few
    other languages so that merges inside multi-byte characters exist and streaming has split characters
    to deal with."""
    return (resources.files("moeswap.tiny") / "corpus.txt").read_text(encoding="utf-8")
