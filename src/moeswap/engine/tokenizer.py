"""Text <-> token ids for the CLI and server; the engine itself only ever sees ids.

Owns: loading a checkpoint's tokenizer (HF `tokenizer.json`, or Kimi's `tiktoken.model` with specials
from `tokenizer_config.json`), bos/eos discovery, a minimal Kimi-style chat template, streamed
detokenization (`StreamDecoder`), and the deterministic tiny tokenizers `moeswap init-tiny` ships.
Entry points: `load_tokenizer(model_dir)`, `build_tiny_tokenizer(out_dir, vocab_size)`.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, trainers

from moeswap import jsonio


class TokenizerError(ValueError):
    """A tokenizer directory or file moeswap cannot use."""


TOKENIZER_FILES = ("tokenizer.json", "tiktoken.model")

# Pre-tokenization in the spirit of Kimi/cl100k: Han runs alone, words (other letters) with one leading
# space or symbol and an English contraction tail, digits in threes, symbol runs, then whitespace rules
# that leave a single space to lead the next word. Every character matches some branch, which matters:
# tiktoken silently drops text no branch matches.
PRETOKENIZE_PATTERN = "|".join([
    r"\p{Han}+",
    r"[^\r\n\p{L}\p{N}]?[\p{L}\p{M}&&[^\p{Han}]]+(?:'(?i:[sdmt]|ll|ve|re))?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])

DEFAULT_SPECIALS = ("<|bos|>", "<|end_of_msg|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>")
_BOS_NAMES = ("<|bos|>", "[BOS]", "<s>")
_EOS_NAMES = ("<|end_of_msg|>", "[EOS]", "<|im_end|>", "</s>")
_CHAT_TOKENS = ("<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>")


def _byte_chars() -> list[str]:
    """Byte-level BPE alphabet: printable Latin-1 bytes stand for themselves, every other byte
    (controls, space, 0x7F-0xA0, 0xAD) is moved to code points from 256 up, so tokens are visible text."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    out, shifted = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + shifted))
            shifted += 1
    return out


BYTE_TO_CHAR = _byte_chars()
CHAR_TO_BYTE = {c: b for b, c in enumerate(BYTE_TO_CHAR)}


def _byte_level_token_bytes(token: str) -> bytes:
    try:
        return bytes(CHAR_TO_BYTE[c] for c in token)
    except KeyError:  # not a byte-level string (e.g. an added token with spaces): taken as its UTF-8, like HF
        return token.encode()


# ----------------------------------------------------------------------------------------------------
# Tokenizer


class Tokenizer:
    """What the CLI and server need from a tokenizer. Backends implement `_encode`, `decode`,
    `token_bytes` and `token_to_id`; `byte_level` says whether token_bytes is available."""

    byte_level: bool = False

    def __init__(self, *, vocab_size: int, id_to_special: dict[int, str], bos_id: int | None = None,
                 eos_ids: Sequence[int] = ()) -> None:
        self.vocab_size = vocab_size
        self.id_to_special = dict(id_to_special)
        self.special_to_id = {s: i for i, s in self.id_to_special.items()}
        self.bos_id = bos_id
        self.eos_ids = tuple(eos_ids)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of `text`; special-token strings in the text become their special ids."""
        ids = self._encode(text)
        if add_bos:
            if self.bos_id is None:
                raise TokenizerError("add_bos=True but this tokenizer has no BOS token "
                                     "(no bos_token in tokenizer_config.json); encode without add_bos")
            ids.insert(0, self.bos_id)
        return ids

    def _encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes of one token (byte-level tokenizers only)."""
        raise NotImplementedError(f"{type(self).__name__} is not byte-level")

    def token_to_id(self, token: str) -> int | None:
        return self.special_to_id.get(token)

    def _check_ids(self, ids: Sequence[int]) -> None:
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise TokenizerError(f"token id {i} is outside the vocabulary (0..{self.vocab_size - 1})")

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """Kimi-style `<|im_user|>user<|im_middle|>...<|im_end|>` turns when the vocabulary has those
        specials, else plain `role: content` lines. Ends with an open assistant turn by default."""
        kimi = all(t in self.special_to_id for t in _CHAT_TOKENS)
        parts = []
        for n, m in enumerate(messages):
            role, content = _message_role_text(m, n)
            if kimi:
                # Kimi marks system and tool turns with <|im_system|>; tiny vocabularies lack it, use user's
                start = f"<|im_{role}|>"
                if start not in self.special_to_id:
                    start = "<|im_system|>" if "<|im_system|>" in self.special_to_id else "<|im_user|>"
                parts.append(f"{start}{role}<|im_middle|>{content}<|im_end|>")
            else:
                parts.append(f"{role}: {content}\n")
        if add_generation_prompt:
            parts.append("<|im_assistant|>assistant<|im_middle|>" if kimi else "assistant: ")
        return "".join(parts)


def _message_role_text(m: Any, n: int) -> tuple[str, str]:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ValueError(f"messages[{n}]: expected an object with a string 'role', found {m!r:.80}")
    content = m.get("content")
    if content is None:
        return m["role"], ""
    if isinstance(content, str):
        return m["role"], content
    # OpenAI-style list of parts: only text parts carry meaning for a text model
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return m["role"], "".join(str(p.get("text", "")) for p in content)
    raise ValueError(f"messages[{n}].content: expected a string or a list of text parts, found {content!r:.80}")


class HFTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer` loaded from tokenizer.json."""

    def __init__(self, tok: tokenizers.Tokenizer, *, byte_level: bool) -> None:
        self._tok = tok
        self.byte_level = byte_level
        added = tok.get_added_tokens_decoder()
        self._added = {i: t.content for i, t in added.items()}
        super().__init__(vocab_size=tok.get_vocab_size(with_added_tokens=True),
                         id_to_special={i: t.content for i, t in added.items() if t.special})

    def _encode(self, text: str) -> list[int]:
        # add_special_tokens=False: BOS is our explicit add_bos, not a post-processor's choice
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        ids = list(ids)
        self._check_ids(ids)
        return self._tok.decode(ids, skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        if not self.byte_level:
            return super().token_bytes(token_id)
        if token_id in self._added:
            return self._added[token_id].encode()
        token = self._tok.id_to_token(token_id)
        if token is None:
            self._check_ids([token_id])
            raise TokenizerError(f"token id {token_id} has no token in this vocabulary")
        return _byte_level_token_bytes(token)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


class TiktokenTokenizer(Tokenizer):
    """Kimi's format: tiktoken BPE ranks plus specials numbered right after them."""

    byte_level = True

    def __init__(self, enc: Any, ranks: dict[bytes, int], id_to_special: dict[int, str]) -> None:
        self._enc = enc
        self._ranks = ranks
        super().__init__(vocab_size=max([len(ranks) - 1, *id_to_special]) + 1, id_to_special=id_to_special)

    def _encode(self, text: str) -> list[int]:
        return self._enc.encode(text, allowed_special="all", disallowed_special=())

    def decode(self, ids: Sequence[int]) -> str:
        ids = list(ids)
        self._check_ids(ids)
        return self._enc.decode(ids)

    def token_bytes(self, token_id: int) -> bytes:
        self._check_ids([token_id])
        return self._enc.decode_single_token_bytes(token_id)

    def token_to_id(self, token: str) -> int | None:
        i = self.special_to_id.get(token)
        return i if i is not None else self._ranks.get(token.encode())


# ----------------------------------------------------------------------------------------------------
# Streaming


class StreamDecoder:
    """Incremental detokenizer: `push(id)` returns only newly completed text, holding back the bytes of
    a character split across tokens; the concatenation of pushes and `flush()` equals decode(all ids)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # Text-diff state, for tokenizers that cannot give per-token bytes (SentencePiece-style vocabularies)
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, token_id: int) -> str:
        if self._tok.byte_level:
            # The incremental decoder keeps an incomplete trailing UTF-8 sequence until it completes
            return self._utf8.decode(self._tok.token_bytes(token_id))
        self._ids.append(token_id)
        before = self._tok.decode(self._ids[self._prefix:self._read])
        now = self._tok.decode(self._ids[self._prefix:])
        # A trailing U+FFFD means the last token ended mid-character: wait for the next one
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return now[len(before):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an unfinished character decodes to U+FFFD, as decode() would)."""
        if self._tok.byte_level:
            out = self._utf8.decode(b"", final=True)
            self._utf8.reset()
            return out
        before = self._tok.decode(self._ids[self._prefix:self._read])
        out = self._tok.decode(self._ids[self._prefix:])[len(before):]
        self._ids, self._prefix, self._read = [], 0, 0
        return out


# ----------------------------------------------------------------------------------------------------
# Loading


def load_tokenizer(model_dir: str | Path, *, eos_ids: Sequence[int] | None = None) -> Tokenizer:
    """Tokenizer of a model directory: tokenizer.json if present, else tiktoken.model (Kimi).
    eos ids: the `eos_ids` override, else the union of generation_config.json, config.json and
    tokenizer_config.json's eos_token."""
    d = Path(model_dir)
    if not d.is_dir():
        raise TokenizerError(f"{d}: no such directory; expected a model directory with one of "
                             f"{', '.join(TOKENIZER_FILES)}")
    tok_cfg = _read_json(d / "tokenizer_config.json")
    if (d / "tokenizer.json").is_file():
        tok: Tokenizer = _load_hf(d / "tokenizer.json")
    elif (d / "tiktoken.model").is_file():
        tok = _load_tiktoken(d / "tiktoken.model", tok_cfg)
    else:
        raise TokenizerError(f"{d}: no tokenizer found (looked for {', '.join(TOKENIZER_FILES)}); copy the "
                             f"checkpoint's tokenizer files into this directory")
    tok.bos_id = _find_bos(d, tok, tok_cfg)
    if eos_ids is not None:
        tok._check_ids(list(eos_ids))
        tok.eos_ids = tuple(eos_ids)
    else:
        tok.eos_ids = _find_eos(d, tok, tok_cfg)
    return tok


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file, {} when absent."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path}: not valid JSON ({e}); the file is corrupt, replace it") from e
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def _load_hf(path: Path) -> HFTokenizer:
    spec = _read_json(path)  # first, so plain JSON damage gets the clearer message
    try:
        tok = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises a bare Exception with a serde message
        raise TokenizerError(f"{path}: not a tokenizers tokenizer.json ({e}); "
                             "the file is corrupt, replace it") from e
    dec = spec.get("decoder") or {}
    parts = dec.get("decoders", []) if dec.get("type") == "Sequence" else [dec]
    return HFTokenizer(tok, byte_level=any(p.get("type") == "ByteLevel" for p in parts))


def _read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split()
        try:
            if len(fields) != 2:
                raise ValueError(f"{len(fields)} fields")
            token, rank = base64.b64decode(fields[0], validate=True), int(fields[1])
        except (ValueError, binascii.Error) as e:
            raise TokenizerError(f"{path}: line {n}: expected '<base64 token> <rank>', found {line[:60]!r} ({e}); "
                                 "the file is corrupt, replace it") from e
        if token in ranks:
            raise TokenizerError(f"{path}: line {n}: token {token!r} already has rank {ranks[token]}")
        ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(f"{path}: ranks must be 0..{len(ranks) - 1} with none missing or repeated")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:  # without every single byte some text could not be encoded at all
        raise TokenizerError(f"{path}: {len(missing)} single-byte tokens are missing (first: {missing[0]:#04x})")
    return ranks


def _load_tiktoken(path: Path, tok_cfg: dict[str, Any]) -> TiktokenTokenizer:
    ranks = _read_tiktoken_ranks(path)
    cfg_path = path.parent / "tokenizer_config.json"
    specials: dict[int, str] = {}
    for key, entry in (tok_cfg.get("added_tokens_decoder") or {}).items():
        content = entry.get("content") if isinstance(entry, dict) else None
        if not (str(key).isdigit() and isinstance(content, str)):
            raise TokenizerError(f"{cfg_path}: added_tokens_decoder[{key!r}] must map an id to {{'content': ...}}")
        if int(key) < len(ranks):
            raise TokenizerError(f"{cfg_path}: special token {content!r} has id {key}, inside the "
                                 f"{len(ranks)} BPE ranks of {path.name}; specials must come after them")
        specials[int(key)] = content
    # Kimi numbers specials right after the ranks; name any hole so every id below vocab_size decodes
    for i in range(len(ranks), max(specials, default=len(ranks) - 1)):
        specials.setdefault(i, f"<|reserved_token_{i}|>")
    try:
        import tiktoken  # lazy: only Kimi-format checkpoints need it
    except ImportError as e:
        raise TokenizerError(f"{path} needs the tiktoken package, which is not installed: "
                             "pip install tiktoken (or pip install 'moeswap[tiktoken]')") from e
    enc = tiktoken.Encoding(name=f"moeswap:{path.parent.name}", pat_str=PRETOKENIZE_PATTERN,
                            mergeable_ranks=ranks, special_tokens={s: i for i, s in specials.items()})
    return TiktokenTokenizer(enc, ranks, specials)


def _token_content(value: Any) -> str | None:
    """tokenizer_config spells a token as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _config_ids(d: Path, key: str) -> list[tuple[str, int]]:
    """(file name, id) for `key` in generation_config.json and config.json (K3 nests it in text_config)."""
    found = []
    for name in ("generation_config.json", "config.json"):
        cfg = _read_json(d / name)
        if key not in cfg and isinstance(cfg.get("text_config"), dict):
            cfg = cfg["text_config"]
        value = cfg.get(key)
        for v in (value if isinstance(value, list) else [] if value is None else [value]):
            if not isinstance(v, int) or isinstance(v, bool):
                raise TokenizerError(f"{d / name}: {key} must be an integer or a list of integers, "
                                     f"found {value!r}")
            found.append((name, v))
    return found


def _lookup(tok: Tokenizer, d: Path, field: str, tok_cfg: dict[str, Any]) -> int | None:
    content = _token_content(tok_cfg.get(field))
    if content is None:
        return None
    i = tok.token_to_id(content)
    if i is None:
        raise TokenizerError(f"{d / 'tokenizer_config.json'}: {field} {content!r} is not in the vocabulary")
    return i


def _find_bos(d: Path, tok: Tokenizer, tok_cfg: dict[str, Any]) -> int | None:
    i = _lookup(tok, d, "bos_token", tok_cfg)
    if i is not None:
        return i
    for name, i in _config_ids(d, "bos_token_id")[:1]:
        if not 0 <= i < tok.vocab_size:
            raise TokenizerError(f"{d / name}: bos_token_id {i} is outside the tokenizer's vocabulary "
                                 f"(0..{tok.vocab_size - 1})")
        return i
    return None


def _find_eos(d: Path, tok: Tokenizer, tok_cfg: dict[str, Any]) -> tuple[int, ...]:
    ids = []
    for name, i in _config_ids(d, "eos_token_id"):
        if not 0 <= i < tok.vocab_size:
            raise TokenizerError(f"{d / name}: eos_token_id {i} is outside the tokenizer's vocabulary "
                                 f"(0..{tok.vocab_size - 1})")
        ids.append(i)
    i = _lookup(tok, d, "eos_token", tok_cfg)
    if i is not None:
        ids.append(i)
    return tuple(dict.fromkeys(ids))  # union, first-seen order: chat models stop on any of them


# ----------------------------------------------------------------------------------------------------
# Tiny tokenizers for test models


def build_tiny_tokenizer(out_dir: str | Path, vocab_size: int, specials: dict[str, int] | None = None) -> None:
    """Write a deterministic byte-level BPE tokenizer.json + tokenizer_config.json with exactly
    `vocab_size` ids, specials (content -> id) on the top ids, trained on the built-in corpus."""
    tok, id_to_special = _train_tiny(vocab_size, specials)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    _write_tiny_config(out, id_to_special, {"tokenizer_class": "PreTrainedTokenizerFast",
                                            "clean_up_tokenization_spaces": False})


def build_tiny_tiktoken(out_dir: str | Path, vocab_size: int, specials: dict[str, int] | None = None) -> None:
    """Kimi-format twin of build_tiny_tokenizer: the same merges as tiktoken.model ranks (rank = id,
    token = raw bytes) plus tokenizer_config.json, so the tiktoken path is testable offline."""
    tok, id_to_special = _train_tiny(vocab_size, specials)
    n_ranks = tok.get_vocab_size(with_added_tokens=False)
    lines = []
    for i in range(n_ranks):
        raw = _byte_level_token_bytes(tok.id_to_token(i))
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


def _train_tiny(vocab_size: int, specials: dict[str, int] | None) -> tuple[tokenizers.Tokenizer, dict[int, str]]:
    id_to_special = _place_specials(vocab_size, specials)
    n_bpe = vocab_size - len(id_to_special)
    # ignore_merges: a piece that is itself a token is used whole, as tiktoken does, so both formats agree
    tok = tokenizers.Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=n_bpe, show_progress=False, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus_lines(), trainer=trainer)
    n_trained = tok.get_vocab_size(with_added_tokens=False)
    # A few-KB corpus runs out of pairs before big vocabularies: fill the gap with reserved specials
    for i in range(n_trained, n_bpe):
        id_to_special[i] = f"<|reserved_token_{i}|>"
    tok.add_special_tokens([AddedToken(id_to_special[i], special=True, normalized=False)
                            for i in sorted(id_to_special)])
    # add_special_tokens numbers tokens after the model's; check it put each where Kimi would
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size or any(
            tok.token_to_id(s) != i for i, s in id_to_special.items()):
        raise RuntimeError(f"tiny tokenizer ids came out wrong for vocab_size={vocab_size}")
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
    lines = [ln for ln in TINY_CORPUS.splitlines() if ln.strip()]
    return lines + [ln.upper() for ln in lines] + [ln.title() for ln in lines]


# Written for this project: plain prose, a little code and numbers, and a few other languages so that
# merges inside multi-byte characters exist and streaming has split characters to deal with.
TINY_CORPUS = """\
The lighthouse keeper climbed the stairs every evening at dusk. There were one hundred and twelve steps,
and she counted each of them out loud, because counting kept her mind from wandering back to the mainland.
At the top she wound the clockwork, trimmed the wick and polished the great lens until the brass shone.
Ships she would never meet passed in the dark, and each of them knew the rock was there because of her.

In the morning the fog rolled in from the west. The gulls were quiet, the sea was flat and grey, and the
only sound was the slow knock of a rowing boat against the jetty. She made tea, wrote two lines in the log,
and went down to the garden where the potatoes and the onions grew in neat rows behind a low stone wall.

A good loaf of bread needs only flour, water, salt and time. Mix four hundred grams of flour with three
hundred grams of warm water, leave it for half an hour, then add eight grams of salt and a little yeast.
Fold the dough every thirty minutes for two hours. Shape it, let it rise overnight in a cool place, and
bake it in a very hot oven for forty minutes. The crust should crackle when you take it out.

Large language models read text as tokens. A tokenizer splits the words into pieces that it has seen often
enough to remember, so common words become a single token while rare words are broken into several parts.
A mixture of experts sends each token to a few specialists out of many; the other experts stay idle, which
is why their weights can wait on a slower tier of memory until the router asks for them again.

The weather report said rain before noon, sunshine after lunch, and strong winds on the northern coast.
Nobody believed it. Children walked to school with their coats open, farmers looked at the sky and shrugged,
and the fishermen stayed in the harbour, mending nets and arguing about football and the price of diesel.

The old railway station had been closed for twenty years when a group of neighbours decided to open a
library in the waiting room. They painted the walls yellow, carried in shelves from an empty shop, and asked
everyone in town for books. Within a month there were novels, atlases, cookery books, a broken encyclopedia
and a surprising number of manuals for motorcycles. On Saturdays the children held a chess tournament on the
platform, and in winter somebody always brought soup in a large blue pot.

Measure twice and cut once, the carpenter told his apprentice, then he measured three times anyway. He liked
oak for tables, pine for shelves and walnut for anything that would be touched every day. Sharpen the chisel
before you need it, sweep the floor before you leave, and never trust a ruler you found on the ground.

An orchestra tunes to the oboe because its pitch is steady and easy to hear. The violins follow, then the
cellos and the double basses, while the brass players warm their instruments with quiet breaths. When the
conductor lifts the baton the hall becomes silent, and for a moment everybody is listening to the same thing.

Planning a journey across the mountains requires patience. Check the forecast, pack water and a warm jacket,
tell somebody where you are going, and turn back if the clouds gather early. The summit will still be there
next week; the path is narrow, the rocks are loose, and the view from the valley is beautiful as well.

def greet(name: str) -> str:
    return f"Hello, {name}! You have {len(name)} letters in your name."

for i in range(10):
    print(i, i * i, [x + 1 for x in (1, 2, 3)])

Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 2048 4096 65536 3.14159 2.71828 1,000,000 2025-01-31.
Symbols: ( ) [ ] { } < > = + - * / % & | ^ ~ ! ? @ # $ : ; , . ' " ` \\ _ ... -> => == != <= >=

Le gardien du phare montait l'escalier chaque soir. Il était une fois un café près de la mer, où l'on
mangeait des crêpes et buvait du thé. Élève, école, forêt, château, naïve, où, déjà, très, garçon.
Der Leuchtturmwärter stieg jeden Abend die Treppe hinauf. Über den Bäumen flogen Möwen; die Straße war
nass und grün. Größe, Übung, schön, müde, Fußball, Mädchen, Brötchen.
El farero subía la escalera cada noche. ¿Dónde está la estación? ¡Qué día tan bonito! Mañana, niño, año.
Смотритель маяка поднимался по лестнице каждый вечер. Море было спокойным, а небо серым.
灯塔看守人每天晚上都爬上楼梯。今天天气很好，我们去海边散步吧。中文、日本語、한국어。
東京は雨が降っています。今日はとても寒いです。ありがとうございます。
서울의 날씨는 맑습니다. 감사합니다.
Emoji: 🙂 😀 🚀 🌍 ❤️ 👍 🎉 🐍 ☕ 🌧️ — and a few more: 🦀 🔥 ✨ 🍞 🌊.
"""
