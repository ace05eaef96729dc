"""Structured output: OpenAI's `response_format` (`{"type": "json_object"}`, `{"type": "json_schema",
"json_schema": {"name", "schema", "strict", "description"}}`) turned into a per-request token constraint
(engine.sampling.TokenConstraint) that the scheduler applies to the request's logits.

Owns: the shape of `response_format` and its checks (the server and the Python API both call
`response_schema`; a bad one is a `StructuredOutputError` naming the field), the JSON options every
grammar gets, and the adapter to llguidance (docs/decisions.md says why that library): a tokenizer's
token -> bytes table built once (`StructuredOutput`, on first use), a grammar compiled and checked per
schema, a matcher per request (`GrammarConstraint`), and the wait for a reasoning section to end before
the grammar applies (`AfterReasoning`). JSON is written compactly ("," and ":", no whitespace): with free
whitespace a model can pad an answer with blanks up to max_tokens. Entry points:
`response_schema(response_format)`, `compile_schema(schema)`, `read_schema(path)`,
`StructuredOutput(tokenizer, eos_ids, vocab_size)` with `.grammar(schema)` and `.constraint(grammar, layout,
state)`.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from moeswap.text.reasoning import ChannelParser, Layout, markup
from moeswap.text.tokenizer import StreamDecoder, Tokenizer
from moeswap.text.tool_calls import Piece

ANY_OBJECT: dict[str, Any] = {"type": "object"}  # json_object: any JSON object
FORMAT_TYPES = ("text", "json_object", "json_schema")
_SCHEMA_FIELDS: dict[str, type | tuple[type, ...]] = {"name": str, "description": str, "schema": (dict, bool),
                                                      "strict": bool}
# llguidance's words for a schema it reads but cannot follow (as opposed to one that is not valid)
_UNSUPPORTED = re.compile(r"Unimplemented|not supported|Unknown format|retriev", re.IGNORECASE)


class StructuredOutputError(ValueError):
    """A response_format that cannot be followed: `param` names the field, `code` says why
    ("invalid_value": not valid; "unsupported_schema": valid, but not something llguidance can follow)."""

    def __init__(self, message: str, param: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param, self.code = param, code


def response_schema(response_format: Mapping[str, Any] | None, where: str = "response_format"
                    ) -> dict[str, Any] | bool | None:
    """The JSON schema a response_format asks for: None for none or `{"type": "text"}`."""
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise StructuredOutputError(f"'{where}' must be an object, got {_short(response_format)}", where)
    kind = response_format.get("type")
    if kind not in FORMAT_TYPES:
        raise StructuredOutputError(f"'{where}.type' must be one of {', '.join(map(repr, FORMAT_TYPES))}, "
                                    f"got {_short(kind)}", f"{where}.type")
    allowed = {"type", "json_schema"} if kind == "json_schema" else {"type"}
    extra = sorted(set(response_format) - allowed)
    if extra:
        raise StructuredOutputError(f"'{where}.{extra[0]}' is not a field of a {kind!r} response_format",
                                    f"{where}.{extra[0]}")
    if kind == "text":
        return None
    if kind == "json_object":
        return dict(ANY_OBJECT)
    spec, at = response_format.get("json_schema"), f"{where}.json_schema"
    if not isinstance(spec, Mapping):
        raise StructuredOutputError(f"'{at}' must be an object with the schema, got {_short(spec)}", at)
    for name, value in spec.items():
        expected = _SCHEMA_FIELDS.get(name)
        if expected is None:
            raise StructuredOutputError(f"'{at}.{name}' is not a field of json_schema (fields: "
                                        f"{', '.join(_SCHEMA_FIELDS)})", f"{at}.{name}")
        if value is None and name != "schema":  # null: left out
            continue
        if not isinstance(value, expected):
            what = "an object (or true / false)" if name == "schema" else f"a {getattr(expected, '__name__', '')}"
            raise StructuredOutputError(f"'{at}.{name}' must be {what}, got {_short(value)}", f"{at}.{name}")
    if "schema" not in spec:
        raise StructuredOutputError(f"'{at}.schema' is missing: give the JSON schema the answer follows",
                                    f"{at}.schema")
    schema = spec["schema"]
    return dict(schema) if isinstance(schema, Mapping) else schema


SCHEMA_PARAM = "response_format.json_schema.schema"


def compile_schema(schema: dict[str, Any] | bool, where: str = SCHEMA_PARAM, vocabulary=None) -> str:
    """The checked llguidance grammar of a JSON schema (response_schema's); StructuredOutputError naming
    `where` otherwise. vocabulary: an llguidance tokenizer to check it against as well (None: the schema only,
    which needs no model)."""
    import llguidance

    try:
        # no whitespace but the separators' (over anything the schema's own "x-guidance" says)
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                                overrides={"whitespace_flexible": False})
    except ValueError as e:
        raise StructuredOutputError(f"'{where}' is not a JSON schema llguidance reads: {_line(e)}", where) from None
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, vocabulary)
    if failed:
        message = _line(messages[0])
        if _UNSUPPORTED.search(message):
            raise StructuredOutputError(f"'{where}': llguidance cannot follow this schema: {message}", where,
                                        "unsupported_schema")
        raise StructuredOutputError(f"'{where}' is not a valid JSON schema: {message}", where)
    return grammar


def read_schema(path: str, flag: str = "--json-schema") -> dict[str, Any] | bool:
    """A JSON schema from a file (`generate --json-schema FILE`), checked as a response_format's is; errors
    name the flag and the file."""
    where = f"{flag} {path}"
    try:
        with open(path, encoding="utf-8") as f:
            schema = json.loads(f.read())
    except OSError as e:
        raise StructuredOutputError(f"{where}: {e.strerror or e}", where) from None
    except ValueError as e:  # not UTF-8, not JSON
        raise StructuredOutputError(f"{where}: not a JSON file: {e}", where) from None
    if not isinstance(schema, (dict, bool)):
        raise StructuredOutputError(f"{where}: a JSON schema is an object (or true / false), found "
                                    f"{type(schema).__name__}", where)
    compile_schema(schema, where)
    return schema


class StructuredOutput:
    """A tokenizer's vocabulary as llguidance sees it (built on first use: ~0.5 s for 160k tokens, then
    kept), and the grammars and per-request constraints made with it. eos_ids: the ids that end an answer
    (Tokenizer.stop_ids), allowed where the grammar is complete; vocab_size: the model's logits' width."""

    def __init__(self, tokenizer: Tokenizer, eos_ids: Sequence[int], vocab_size: int) -> None:
        self.tokenizer, self.eos_ids, self.vocab_size = tokenizer, tuple(eos_ids), vocab_size

    @functools.cached_property
    def _vocabulary(self):
        import llguidance

        tok = self.tokenizer
        if not tok.byte_level:
            raise StructuredOutputError("response_format needs a byte-level tokenizer (each token's bytes), "
                                        "and this model's is not", "response_format", "unsupported_schema")
        if not self.eos_ids:
            raise StructuredOutputError("response_format needs an end-of-sequence token, and this model's "
                                        "tokenizer has none", "response_format", "unsupported_schema")
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocab(tok, self.eos_ids)),
                                      eos_token=list(self.eos_ids))

    def grammar(self, schema: dict[str, Any] | bool, where: str = SCHEMA_PARAM) -> str:
        """compile_schema, checked against this vocabulary too."""
        return compile_schema(schema, where, self._vocabulary)

    def constraint(self, grammar: str, layout: Layout | None = None, state: str | None = None
                   ) -> GrammarConstraint | AfterReasoning:
        """A fresh constraint for one request (grammar: from `grammar`). A chat answer whose generation prompt
        left the turn in a reasoning state of `layout` (text.reasoning.start_state) follows the grammar only
        once its reasoning has ended (AfterReasoning); any other, from its first token."""
        constraint = GrammarConstraint(self._vocabulary, grammar, self.vocab_size)
        if layout is None or state not in layout.reasoning:
            return constraint
        return AfterReasoning(constraint, self.tokenizer, layout, state)


class GrammarConstraint:
    """One request's llguidance matcher as an engine.sampling.TokenConstraint. A matcher that failed (it
    cannot, given only tokens it allowed) allows only the end-of-sequence tokens, and is done."""

    def __init__(self, vocabulary, grammar: str, vocab_size: int) -> None:
        import llguidance

        self._matcher = llguidance.LLMatcher(vocabulary, grammar, log_level=0)
        if self._matcher.is_error():
            raise StructuredOutputError(f"llguidance could not start the grammar: {_line(self._matcher.get_error())}",
                                        "response_format")
        self._vocab = vocab_size

    def allowed(self, mask_V) -> bool:
        bits = np.unpackbits(np.frombuffer(self._matcher.compute_bitmask(), np.uint8), bitorder="little")
        n = min(len(bits), self._vocab)
        mask_V.numpy()[:n] = bits[:n]
        return True

    def advance(self, token: int) -> None:
        self._matcher.consume_token(token)

    @property
    def done(self) -> bool:
        return self._matcher.is_stopped()


class AfterReasoning:
    """A grammar that applies once the answer's reasoning has ended, as vLLM's structured outputs with a
    reasoning parser: the reasoning is free, the answer's content is the JSON.

    While the turn is in a reasoning state of the layout, every token is allowed (`allowed` says so, and the
    scheduler applies no mask: the tokens are those of a request without a response_format). The layout's own
    parser follows the tokens; when they leave reasoning (K3: the model writes `<|close|>think<|sep|>`), the
    markup from that state into the layout's answer state is forced (K3: `<|open|>response<|sep|>`), so the
    answer goes on where the model's own turns put it, and from then the grammar governs every token, the end
    of the answer included: once the reasoning has ended, the answer cannot end before the JSON is complete
    (max_tokens still cuts it, as it may cut the reasoning)."""

    def __init__(self, grammar: GrammarConstraint, tokenizer: Tokenizer, layout: Layout, state: str) -> None:
        self._grammar, self._tok, self._layout = grammar, tokenizer, layout
        self._parser: ChannelParser | None = ChannelParser(layout, state)  # None: the reasoning has ended
        self._decoder = StreamDecoder(tokenizer)
        self._forced: list[int] = []  # the markup into the answer state still to come

    def allowed(self, mask_V) -> bool:
        if self._parser is not None:
            return False
        if self._forced:
            mask_V[self._forced[0]] = True
            return True
        return self._grammar.allowed(mask_V)

    def advance(self, token: int) -> None:
        if self._parser is None:
            if self._forced:
                self._forced.pop(0)
            else:
                self._grammar.advance(token)
            return
        special = self._tok.id_to_special.get(token)
        self._parser.feed(Piece(special, True) if special is not None else Piece(self._decoder.push(token)))
        state = self._parser.state
        if state not in self._layout.reasoning:
            # (a state with no move into the answer state: the grammar starts at once, in it)
            into = () if state == self._layout.answer else markup(self._layout, state, self._layout.answer) or ()
            self._forced = self._tok.encode("".join(p.text for p in into), specials=True)
            self._parser = None

    @property
    def done(self) -> bool:
        return self._parser is None and not self._forced and self._grammar.done


class _Vocab:
    """What llguidance.TokenizerWrapper reads: each id's bytes, the specials (never text), and a way to
    tokenize the text the grammar forces (llguidance uses it for forced pieces such as a key's name)."""

    def __init__(self, tok: Tokenizer, eos_ids: Sequence[int]) -> None:
        self._tok = tok
        self.eos_token_id, self.bos_token_id = eos_ids[0], tok.bos_id
        self.special_token_ids = sorted(tok.id_to_special)
        self.tokens = [tok.token_bytes(i) for i in range(tok.vocab_size)]

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # TokenizerWrapper probes with bytes; text it is
            raise TypeError("text, not bytes")
        return self._tok.encode(text)


def _line(message: object) -> str:
    """A library's (possibly multi-line) message as one line."""
    return " ".join(str(message).split())


def _short(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
