"""Text <-> token ids for the CLI and server; the engine itself only ever sees ids.

Owns: loading a checkpoint's tokenizer (HF `tokenizer.json`, or Kimi's `tiktoken.model` encoded as
tokenization_kimi.py encodes it), bos/eos discovery, encoding chat prompts (the checkpoint's template from
chat_template.py, else a built-in Kimi-style one) and streamed detokenization (`StreamDecoder`). The tiny
tokenizers `moeswap init-tiny` writes live in tiny/tokenizer.py. Entry point: `load_tokenizer(model_dir)`.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import functools
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from moeswap.formats.files import confined, read_json, show
from moeswap.text.chat_template import CHAT_TEMPLATE_FILE, ChatTemplate, find_chat_template, normalize_messages


class TokenizerError(ValueError):
    """A tokenizer directory or file moeswap cannot use."""


# A normalizer may drop characters before tokenizing (accents, controls): a prompt's lower bound in tokens
# allows for it dropping up to half of them
NORMALIZER_SLACK = 2


class PromptTooLong(TokenizerError):
    """A text that certainly needs more tokens than a context holds (Tokenizer.check_length)."""


TOKENIZER_FILES = ("tokenizer.json", "tiktoken.model")

# Kimi's pre-tokenization: `TikTokenTokenizer.pat_str` of the tokenization_kimi.py that moonshotai publishes
# with its tiktoken checkpoints (Kimi K2, Kimi-Linear, K3; read from the copy in github.com/troy12x/quasar-kimi,
# and the same branches llama.cpp's src/unicode.cpp transcribes as its "kimi-k2" pre-tokenizer). Han runs
# stand alone; other letters split where case changes (an upper-case run may lead a lower-case run, so
# "HelloWorld" is "Hello", "World"), with one leading non-letter and an English contraction tail; digits in
# threes; symbol runs; whitespace that leaves one space to lead the next word. A fact of the format: ids
# change if this does.
KIMI_PAT_STR = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])

# tokenization_kimi.py hands tiktoken at most this many characters at a time, and cuts any run of more than
# MAX_SAME_CLASS_RUN whitespace or non-whitespace characters (tiktoken is quadratic on such runs). The cuts
# are pre-tokenization boundaries, so they are part of the format too.
TIKTOKEN_MAX_ENCODE_CHARS = 400_000
MAX_SAME_CLASS_RUN = 25_000
_LONG_RUN = re.compile(rf"\s{{{MAX_SAME_CLASS_RUN + 1},}}|\S{{{MAX_SAME_CLASS_RUN + 1},}}")

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


def byte_level_token_bytes(token: str) -> bytes:
    """The raw bytes a byte-level BPE token string stands for."""
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

    def stop_ids(self, model_eos: Sequence[int]) -> tuple[int, ...]:
        """The ids that end a completion: the tokenizer's end-of-sequence ids (tokenizer_config.json,
        generation_config.json and config.json merged by load_tokenizer), else the model config's `model_eos`."""
        return self.eos_ids or tuple(model_eos)

    def chat_stop_ids(self, model_eos: Sequence[int]) -> tuple[int, ...]:
        """The ids that end a chat answer: `stop_ids`, and the chat template's end of turn (`turn_end_id`)
        where it is not one of them. A checkpoint may name one end-of-sequence token and close chat turns
        with another (the shipped stdlib-k3 did: <|end_of_msg|> and <|im_end|>); an adapter trained on its
        template's turns then ends its answers with the turn end, which must stop them."""
        stops = self.stop_ids(model_eos)
        end = self.turn_end_id
        return stops if end is None or end in stops else (*stops, end)

    @functools.cached_property
    def turn_end_id(self) -> int | None:
        """The special token that closes an assistant turn in this tokenizer's chat template (the checkpoint's,
        else the built-in one): the template renders a conversation that ends with an assistant's answer, and
        the last special token after the answer's text is it (K3's template closes the answer's channel with
        <|close|>, then the turn with <|end_of_msg|>). None where the template closes a turn with text only,
        or cannot render the probe."""
        probe = "moeswap turn-end probe"
        messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": probe}]
        try:
            text = self.apply_chat_template(messages, add_generation_prompt=False)
        except ValueError:  # ChatTemplateError included: a template that wants other messages
            return None
        at = text.rfind(probe)
        if at < 0 or not self.special_to_id:
            return None
        rest = text[at + len(probe):]
        found = re.findall("|".join(re.escape(s) for s in sorted(self.special_to_id, key=len, reverse=True)), rest)
        return self.special_to_id[found[-1]] if found else None

    def encode(self, text: str, add_bos: bool = False, *, specials: bool = False) -> list[int]:
        """Token ids of `text`. A special token's string in it is encoded as the text it spells, so what a
        user typed never becomes a control token; `specials=True` turns such strings into their special
        ids, for text the program itself wrote (a chat template's markers)."""
        ids = self._encode(text, specials)
        if add_bos:
            if self.bos_id is None:
                raise TokenizerError("add_bos=True but this tokenizer has no BOS token "
                                     "(no bos_token in tokenizer_config.json); encode without add_bos")
            ids.insert(0, self.bos_id)
        return ids

    def _encode(self, text: str, specials: bool) -> list[int]:
        raise NotImplementedError

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token stands for (a byte-level token's bytes: a character is at least
        one byte), so a text of N characters needs at least N / max_token_chars tokens."""
        pieces = (self.token_bytes(i) if self.byte_level else self.decode([i]) for i in range(self.vocab_size))
        return max([1, *(len(p) for p in pieces), *(len(s) for s in self.special_to_id)])

    def check_length(self, chars: int, max_tokens: int) -> None:
        """PromptTooLong when a text of `chars` characters needs more than `max_tokens` tokens for certain,
        decided without tokenizing it (a server must not spend its memory on a prompt it will refuse)."""
        at_least = chars // (self.max_token_chars * NORMALIZER_SLACK)
        if at_least > max_tokens:
            raise PromptTooLong(f"the prompt is {chars} characters, at least {at_least} tokens, more than the "
                                f"{max_tokens} this model's context holds")

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes of one token (byte-level tokenizers only)."""
        raise NotImplementedError(f"{type(self).__name__} is not byte-level")

    def token_to_id(self, token: str) -> int | None:
        return self.special_to_id.get(token)

    def _stream_step(self) -> Callable[[int], str | None] | None:
        """The library's incremental decoder as a fresh step function (the text a token completes, None
        while a character is unfinished); None when the library has none."""
        return None

    def _check_ids(self, ids: Sequence[int]) -> None:
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise TokenizerError(f"token id {i} is outside the vocabulary (0..{self.vocab_size - 1})")

    # The checkpoint's own template (chat_template.py), set by load_tokenizer; None: the built-in one
    chat_template: ChatTemplate | None = None

    def chat_segments(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *,
                      tools: list[dict[str, Any]] | None = None, **variables: Any) -> list[tuple[str, bool]]:
        """The chat prompt as (text, specials_allowed) pieces, in order: encode each with
        `encode(text, specials=specials_allowed)`. Only the template's own markup may hold special
        tokens; roles, contents, tool calls and tools written by the caller are text.

        With the checkpoint's template (`chat_template`): rendered as transformers renders it, `tools` and
        `variables` (the template's own switches) passed through; see ChatTemplate.segments. Without one,
        the built-in template: Kimi-style `<|im_user|>user<|im_middle|>...<|im_end|>` turns when the
        vocabulary has those specials, else plain `role: content` lines, and an open assistant turn at the
        end by default; it knows no tools and ignores `variables`."""
        if self.chat_template is not None:
            return self.chat_template.segments(messages, self.special_to_id, tools=tools, variables=variables,
                                               add_generation_prompt=add_generation_prompt)
        if tools is not None:
            raise ValueError("tools need the checkpoint's chat template, and this checkpoint has none "
                             f"(no {CHAT_TEMPLATE_FILE} or chat_template in tokenizer_config.json)")
        kimi = all(t in self.special_to_id for t in _CHAT_TOKENS)
        parts: list[tuple[str, bool]] = []
        for n, m in enumerate(normalize_messages(messages)):
            role, content = m["role"], _message_text(m, n)
            if kimi:
                # Kimi marks system and tool turns with <|im_system|>; tiny vocabularies lack it, use user's
                start = f"<|im_{role}|>"
                if start not in self.special_to_id:
                    start = "<|im_system|>" if "<|im_system|>" in self.special_to_id else "<|im_user|>"
                parts += [(start, True), (role, False), ("<|im_middle|>", True), (content, False), ("<|im_end|>", True)]
            else:
                parts += [(role, False), (": ", True), (content, False), ("\n", True)]
        if add_generation_prompt:
            parts += [("<|im_assistant|>assistant<|im_middle|>", True)] if kimi else [("assistant: ", True)]
        return [(text, markup) for text, markup in parts if text]

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *,
                            tools: list[dict[str, Any]] | None = None, **variables: Any) -> str:
        """The chat prompt as one string, for display (`encode_chat` keeps the caller's text from becoming
        special tokens)."""
        if self.chat_template is not None:
            return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                             variables=variables)
        return "".join(text for text, _ in self.chat_segments(messages, add_generation_prompt, tools=tools))

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *,
                    tools: list[dict[str, Any]] | None = None, **variables: Any) -> list[int]:
        """Token ids of the chat prompt: the template's markup with its special tokens, the rest as text."""
        return self.encode_segments(self.chat_segments(messages, add_generation_prompt, tools=tools, **variables))

    def encode_segments(self, segments: Sequence[tuple[str, bool]]) -> list[int]:
        """Token ids of `chat_segments`' pieces, each with specials where it allows them."""
        ids: list[int] = []
        for text, markup in segments:
            ids += self.encode(text, specials=markup)
        return ids


def _message_text(m: dict[str, Any], n: int) -> str:
    """The built-in template's content of a message: a string, or the text of OpenAI-style parts."""
    content = m.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    # OpenAI-style list of parts: only text parts carry meaning for a text model
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
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
        # a second copy that reads special tokens' strings as text (the flag is per tokenizer object,
        # so toggling one copy would race between threads)
        self._as_text = tokenizers.Tokenizer.from_str(tok.to_str())
        self._as_text.encode_special_tokens = True

    def _encode(self, text: str, specials: bool) -> list[int]:
        # add_special_tokens=False: BOS is our explicit add_bos, not a post-processor's choice
        return list((self._tok if specials else self._as_text).encode(text, add_special_tokens=False).ids)

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
        return byte_level_token_bytes(token)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def _stream_step(self) -> Callable[[int], str | None]:
        stream = tokenizers.decoders.DecodeStream(skip_special_tokens=False)

        def step(token_id: int) -> str | None:
            self._check_ids([token_id])
            try:
                return stream.step(self._tok, token_id)
            except Exception as e:  # the Rust side raises a bare Exception
                raise TokenizerError(f"streaming decode failed at token {token_id}: {e}") from e
        return step


class TiktokenTokenizer(Tokenizer):
    """Kimi's format: tiktoken BPE ranks plus specials numbered right after them."""

    byte_level = True

    def __init__(self, enc: Any, ranks: dict[bytes, int], id_to_special: dict[int, str]) -> None:
        self._enc = enc
        self._ranks = ranks
        super().__init__(vocab_size=max([len(ranks) - 1, *id_to_special]) + 1, id_to_special=id_to_special)

    def _encode(self, text: str, specials: bool) -> list[int]:
        allowed = "all" if specials else set()
        ids: list[int] = []
        for piece in kimi_chunks(text):
            ids += self._enc.encode(piece, allowed_special=allowed, disallowed_special=())
        return ids

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


def kimi_chunks(text: str) -> Iterator[str]:
    """`text` cut where tokenization_kimi.py cuts it before tiktoken sees it: every
    TIKTOKEN_MAX_ENCODE_CHARS characters, and inside a run of whitespace or of non-whitespace (str.isspace,
    which re's \\s matches) every MAX_SAME_CLASS_RUN characters from the run's start."""
    for i in range(0, len(text), TIKTOKEN_MAX_ENCODE_CHARS):
        chunk, start = text[i:i + TIKTOKEN_MAX_ENCODE_CHARS], 0
        for m in _LONG_RUN.finditer(chunk):
            for cut in range(m.start() + MAX_SAME_CLASS_RUN, m.end(), MAX_SAME_CLASS_RUN):
                yield chunk[start:cut]
                start = cut
        yield chunk[start:]


# ----------------------------------------------------------------------------------------------------
# Streaming


class StreamDecoder:
    """Incremental detokenizer: `push(id)` returns only newly completed text, holding back a character
    split across tokens; the concatenation of pushes and `flush()` equals decode(all ids).

    A tokenizer.json tokenizer streams through its library's own incremental decoder (tokenizers'
    DecodeStream); tiktoken has none, so a byte-level tokenizer's token bytes go through an incremental
    UTF-8 decoder; any other tokenizer decodes a window of ids and emits what the newest token added,
    as DecodeStream does."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._step = tokenizer._stream_step()
        bytewise = self._step is None and tokenizer.byte_level
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace") if bytewise else None
        # The ids since the text emitted before the last one, and where the last one ended: DecodeStream's
        # own window, kept here so flush() can say what is held back
        self._ids: list[int] = []
        self._read = 0

    def push(self, token_id: int) -> str:
        if self._utf8 is not None:
            # The incremental decoder keeps an incomplete trailing UTF-8 sequence until it completes
            return self._utf8.decode(self._tok.token_bytes(token_id))
        self._ids.append(token_id)
        text = self._step(token_id) if self._step is not None else self._window_step()
        if text is None:  # the window ends mid-character: wait for the next token
            return ""
        self._ids, self._read = self._ids[self._read:], len(self._ids) - self._read
        return text

    def _window_step(self) -> str | None:
        before = self._tok.decode(self._ids[:self._read])
        now = self._tok.decode(self._ids)
        # A trailing U+FFFD means the last token ended mid-character
        return now[len(before):] if len(now) > len(before) and not now.endswith("\ufffd") else None

    def flush(self) -> str:
        """Whatever is still held back (an unfinished character decodes to U+FFFD, as decode() would),
        and a fresh start."""
        if self._utf8 is not None:
            out = self._utf8.decode(b"", final=True)
            self._utf8.reset()
            return out
        out = self._tok.decode(self._ids)[len(self._tok.decode(self._ids[:self._read])):]
        self._ids, self._read, self._step = [], 0, self._tok._stream_step()
        return out


# ----------------------------------------------------------------------------------------------------
# Loading


def load_tokenizer(model_dir: str | Path, *, eos_ids: Sequence[int] | None = None) -> Tokenizer:
    """Tokenizer of a model directory: tokenizer.json if present, else tiktoken.model (Kimi), with the
    directory's chat template if it has one. eos ids: the `eos_ids` override, else the union of
    generation_config.json, config.json and tokenizer_config.json's eos_token."""
    d = Path(model_dir)
    if not d.is_dir():
        raise TokenizerError(f"{d}: no such directory; expected a model directory with one of "
                             f"{', '.join(TOKENIZER_FILES)}")
    tok_cfg = _read_json(_in(d, "tokenizer_config.json"))
    if _in(d, "tokenizer.json").is_file():
        tok: Tokenizer = _load_hf(d / "tokenizer.json")
    elif _in(d, "tiktoken.model").is_file():
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
    tok.chat_template = find_chat_template(d, tok_cfg)
    return tok


def _in(model_dir: Path, name: str) -> Path:
    """A tokenizer file of the model directory; one that links outside it is refused (a checkpoint is data
    and never reaches other files)."""
    return confined(model_dir, name, TokenizerError, str(model_dir))


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file, {} when absent."""
    if not path.exists():
        return {}
    data = read_json(path, TokenizerError)
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


MAX_SPECIALS = 1 << 16  # special ids past the BPE ranks a tokenizer_config may name when config.json gives no vocab_size


def _import_tiktoken(path: Path) -> Any:
    try:
        import tiktoken  # lazy: only Kimi-format checkpoints need it
    except ImportError as e:
        raise TokenizerError(f"{path} needs the tiktoken package, which is not installed: pip install tiktoken") from e
    return tiktoken


def _read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """The BPE ranks, one '<base64 token> <rank>' a line, as tokenization_kimi.py reads them, then checked.
    Read here, not by tiktoken's loader: that one copies the file into a cache outside the model directory
    (a shared temporary directory, keyed by the path), which a checkpoint must never write or be read from."""
    data = path.read_bytes()
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(data.splitlines(), 1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
        except (ValueError, binascii.Error) as e:
            raise TokenizerError(f"{path}: line {n}: expected '<base64 token> <rank>', found {line[:60]!r} ({e}); "
                                 "the file is corrupt, replace it") from None
    if sorted(ranks.values()) != list(range(len(ranks))):  # also catches a token listed twice
        raise TokenizerError(f"{path}: ranks must be 0..{len(ranks) - 1}, each once, one token each")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:  # without every single byte some text could not be encoded at all
        raise TokenizerError(f"{path}: {len(missing)} single-byte tokens are missing (first: {missing[0]:#04x})")
    return ranks


def _load_tiktoken(path: Path, tok_cfg: dict[str, Any]) -> TiktokenTokenizer:
    ranks = _read_tiktoken_ranks(path)
    cfg_path = path.parent / "tokenizer_config.json"
    # every id is checked before any is filled in: a hostile id of 10^8 would otherwise name 10^8 reserved tokens
    limit = _config_vocab_size(path.parent) or len(ranks) + MAX_SPECIALS
    decoder = tok_cfg.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        raise TokenizerError(f"{cfg_path}: added_tokens_decoder must be an object of id -> {{'content': ...}}, "
                             f"found {type(decoder).__name__}")
    specials: dict[int, str] = {}
    for key, entry in decoder.items():
        content = entry.get("content") if isinstance(entry, dict) else None
        if not (str(key).isdigit() and isinstance(content, str)):
            raise TokenizerError(f"{cfg_path}: added_tokens_decoder[{show(key)}] must map an id to {{'content': ...}}")
        if int(key) < len(ranks):
            raise TokenizerError(f"{cfg_path}: special token {show(content)} has id {key}, inside the "
                                 f"{len(ranks)} BPE ranks of {path.name}; specials must come after them")
        if int(key) >= limit:
            raise TokenizerError(f"{cfg_path}: special token {show(content)} has id {show(key)}, outside the "
                                 f"vocabulary (ids below {limit})")
        specials[int(key)] = content
    # Kimi numbers specials right after the ranks and names each id the config leaves out
    # <|reserved_token_ID|>, as here; it also reserves ids up to 258 past the ranks, where this stops at the
    # last id the config names (the model's vocabulary ends there)
    for i in range(len(ranks), max(specials, default=len(ranks) - 1)):
        specials.setdefault(i, f"<|reserved_token_{i}|>")
    enc = _import_tiktoken(path).Encoding(name=f"moeswap:{path.parent.name}", pat_str=KIMI_PAT_STR,
                                          mergeable_ranks=ranks, special_tokens={s: i for i, s in specials.items()})
    return TiktokenTokenizer(enc, ranks, specials)


def _config_vocab_size(d: Path) -> int | None:
    """config.json's vocab_size (K3 nests it in text_config), when it states a positive one."""
    cfg = _read_json(_in(d, "config.json"))
    value = cfg.get("vocab_size", (cfg.get("text_config") or {}).get("vocab_size")
                    if isinstance(cfg.get("text_config"), dict) else None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _token_content(value: Any) -> str | None:
    """tokenizer_config spells a token as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _config_ids(d: Path, key: str) -> list[tuple[str, int]]:
    """(file name, id) for `key` in generation_config.json and config.json (K3 nests it in text_config)."""
    found = []
    for name in ("generation_config.json", "config.json"):
        cfg = _read_json(_in(d, name))
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
