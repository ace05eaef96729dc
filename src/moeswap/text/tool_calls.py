"""Tool calls in a model's output: the call formats of the checkpoints moeswap serves (Kimi K3's markup, Kimi K2's
section tokens), which one a checkpoint uses, and an incremental parser that splits an answer into content and
OpenAI tool calls as the tokens arrive.

The parser reads pieces: a special token, or text (what ordinary tokens decode to). Markup is only ever a
special token, so text that merely spells `<|close|>` (a caller's string the model repeats) stays text.
Knows nothing of HTTP or the engine; text.output turns token ids into pieces and content into text.
Entry points: `find_format(tokenizer)`, `ToolCallParser(fmt).feed(piece) / .finish()`.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple


class Piece(NamedTuple):
    """A special token (its string) or text. As a parser event: content, to be shown as the answer's text."""

    text: str
    special: bool = False


@dataclass(frozen=True)
class CallStart:
    """A tool call begins: its position among the answer's calls (OpenAI's `index`), id and function name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArgs:
    """The next fragment of call `index`'s arguments (JSON text; the fragments of a call add up to an object)."""

    index: int
    text: str


Event = Piece | CallStart | CallArgs


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class Malformed(ValueError):
    """The model's tool-call markup does not follow its format: the answer is text after all."""


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"  # OpenAI's shape; unique is all a client needs of it


# ----------------------------------------------------------------------------------------------------
# Formats: what marks a section of tool calls, and how one section is read


class _Section:
    """One section of tool calls, after its opening: `feed(piece)` gives the events the piece completes and
    raises Malformed at the first piece the format does not allow; `done` once the section has closed.
    Each call is checked when it closes: its arguments must be one JSON object."""

    def __init__(self, new_id: Callable[[], str]) -> None:
        self.new_id = new_id
        self.done = False
        self.calls = 0  # started so far
        self._args = ""  # the open call's arguments so far

    def feed(self, piece: Piece) -> list[Event]:
        raise NotImplementedError

    def _start(self, call_id: str, name: str) -> CallStart:
        if not name:
            raise Malformed("a tool call without a function name")
        self._args = ""
        self.calls += 1
        return CallStart(self.calls - 1, call_id, name)

    def _arg(self, text: str) -> list[Event]:
        self._args += text
        return [CallArgs(self.calls - 1, text)] if text else []

    def _end_call(self) -> None:
        if not isinstance(_json(self._args), dict):
            raise Malformed(f"tool call arguments are not a JSON object: {self._args[:60]!r}")


def _json(text: str):
    try:
        return json.loads(text, parse_constant=_no_constant)
    except ValueError as e:
        raise Malformed(f"not JSON: {e}") from None


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


@dataclass(frozen=True)
class ToolCallFormat:
    """A checkpoint's way of writing tool calls: the special tokens it needs, the piece sequences that open a
    section of calls, and its section reader."""

    name: str
    specials: tuple[str, ...]
    openings: tuple[tuple[Piece, ...], ...]
    section: Callable[[Callable[[], str]], _Section] = field(compare=False)


# -- Kimi K3 ------------------------------------------------------------------------------------------
# The template (tests/data/Kimi-K3.jinja, render_assistant) writes an assistant turn as tags: `<|open|>NAME
# attr="v"<|sep|>` ... `<|close|>NAME<|sep|>`, attribute values escaped (& -> &amp;, " -> &quot;). Calls
# follow the response channel:
#   <|close|>response<|sep|><|open|>tools<|sep|>
#     <|open|>call tool="NAME" index="1"<|sep|>
#       <|open|>argument key="K" type="string|number|boolean|null|object|array"<|sep|>VALUE<|close|>argument<|sep|>
#       ... or one <|open|>json type="object"<|sep|>{...}<|close|>json<|sep|> ... or neither (no arguments)
#     <|close|>call<|sep|> ...
#   <|close|>tools<|sep|><|close|>message<|sep|>
# A string VALUE is the string itself; the other types are JSON (the template's tojson).

K3_OPEN, K3_CLOSE, K3_SEP = "<|open|>", "<|close|>", "<|sep|>"
_K3_TAG = re.compile(r'([a-z_]+)((?: [a-z_]+="[^"]*")*)')
_K3_ATTR = re.compile(r' ([a-z_]+)="([^"]*)"')
_K3_TYPES = {"number": (int, float), "boolean": (bool,), "null": (type(None),), "object": (dict,), "array": (list,)}


def _k3_tag(text: str) -> tuple[str, dict[str, str]]:
    m = _K3_TAG.fullmatch(text)
    if m is None:
        raise Malformed(f"not a tag: {text[:60]!r}")
    attrs = {k: v.replace("&quot;", '"').replace("&amp;", "&") for k, v in _K3_ATTR.findall(m[2])}
    return m[1], attrs


class _K3Section(_Section):
    def __init__(self, new_id: Callable[[], str]) -> None:
        super().__init__(new_id)
        self._tag: tuple[str, str] | None = None  # ("open" | "close", its text so far) between <|open|> and <|sep|>
        self._in = "tools"  # the innermost open element: tools, call, argument or json
        self._type = ""  # the open argument's type
        self._value = ""  # the open argument's or json block's text
        self._n_args = 0  # arguments of the open call written so far (-1: a json block)

    def feed(self, piece: Piece) -> list[Event]:
        text, special = piece
        if self._tag is not None:
            kind, so_far = self._tag
            if not special:
                self._tag = kind, so_far + text
                return []
            if text != K3_SEP:
                raise Malformed(f"{text} inside a tag")
            self._tag = None
            return self._open(*_k3_tag(so_far)) if kind == "open" else self._close(so_far)
        if special:
            if text == K3_CLOSE or (text == K3_OPEN and self._in in ("tools", "call")):
                self._tag = "open" if text == K3_OPEN else "close", ""
                return []
            raise Malformed(f"{text} in a {self._in} element")
        if self._in == "argument":
            self._value += text
            return self._arg(json.dumps(text, ensure_ascii=False)[1:-1]) if self._type == "string" else []
        if self._in == "json":
            self._value += text
            return self._arg(text)
        if text.strip():
            raise Malformed(f"text {text[:60]!r} between the tags of a {self._in} element")
        return []

    def _open(self, name: str, attrs: dict[str, str]) -> list[Event]:
        if self._in == "tools" and name == "call":
            self._in = "call"
            self._n_args = 0
            return [self._start(self.new_id(), attrs.get("tool", ""))]
        if self._in == "call" and name == "argument" and self._n_args >= 0:
            self._type = attrs.get("type", "")
            if self._type != "string" and self._type not in _K3_TYPES:
                raise Malformed(f"argument type {self._type!r}")
            self._in, self._value = "argument", ""
            lead = "{" if self._n_args == 0 else ", "
            return self._arg(lead + json.dumps(attrs.get("key", ""), ensure_ascii=False) + ": "
                             + ('"' if self._type == "string" else ""))
        if self._in == "call" and name == "json" and self._n_args == 0 and attrs.get("type") == "object":
            self._in, self._value, self._n_args = "json", "", -1
            return []
        raise Malformed(f"<{name}> in a {self._in} element")

    def _close(self, name: str) -> list[Event]:
        if name != self._in:
            raise Malformed(f"</{name}> closes a {self._in} element")
        if name == "tools":
            self.done = True
            return []
        if name == "call":
            out = self._arg("}" if self._n_args > 0 else "{}" if self._n_args == 0 else "")
            self._end_call()
            self._in = "tools"
            return out
        self._in = "call"
        if name == "json":
            return []
        self._n_args += 1
        if self._type == "string":
            return self._arg('"')
        value = _json(self._value)
        if not isinstance(value, _K3_TYPES[self._type]) or (self._type == "number" and isinstance(value, bool)):
            raise Malformed(f"argument of type {self._type}: {self._value[:60]!r}")
        return self._arg(self._value)


KIMI_K3 = ToolCallFormat(
    "kimi_k3", (K3_OPEN, K3_CLOSE, K3_SEP),
    # the response channel's closing tag, right before the section, belongs to the call markup too
    ((Piece(K3_CLOSE, True), Piece("response"), Piece(K3_SEP, True),
      Piece(K3_OPEN, True), Piece("tools"), Piece(K3_SEP, True)),
     (Piece(K3_OPEN, True), Piece("tools"), Piece(K3_SEP, True))),
    _K3Section)


# -- Kimi K2 ------------------------------------------------------------------------------------------
# Section tokens (Kimi K2's templates, render_toolcalls):
#   <|tool_calls_section_begin|>
#     <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{JSON}<|tool_call_end|> ...
#   <|tool_calls_section_end|>
# The call's id is `functions.NAME:IDX` as written: the template writes a call's id back the same way.

K2_SECTION_BEGIN, K2_SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
K2_CALL_BEGIN, K2_ARGS_BEGIN, K2_CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
_K2_ID = re.compile(r"(?:functions\.)?(.+):\d+")


class _K2Section(_Section):
    def __init__(self, new_id: Callable[[], str]) -> None:
        super().__init__(new_id)
        self._at = "between"  # between calls, in a call's "id", in its "args"
        self._id = ""

    def feed(self, piece: Piece) -> list[Event]:
        text, special = piece
        if not special:
            if self._at == "id":
                self._id += text
            elif self._at == "args":
                return self._arg(text)
            elif text.strip():
                raise Malformed(f"text {text[:60]!r} between tool calls")
            return []
        if self._at == "between" and text == K2_CALL_BEGIN:
            self._at, self._id = "id", ""
            return []
        if self._at == "between" and text == K2_SECTION_END:
            self.done = True
            return []
        if self._at == "id" and text == K2_ARGS_BEGIN:
            call_id = self._id.strip()
            m = _K2_ID.fullmatch(call_id)
            if m is None:
                raise Malformed(f"tool call id {call_id[:60]!r} is not functions.NAME:INDEX")
            self._at = "args"
            return [self._start(call_id, m[1])]
        if self._at == "args" and text == K2_CALL_END:
            self._at = "between"
            out = self._arg("{}") if not self._args.strip() else []  # a call without arguments
            self._end_call()
            return out
        raise Malformed(f"{text} in a tool call's {self._at}")


KIMI_K2 = ToolCallFormat(
    "kimi_k2", (K2_SECTION_BEGIN, K2_SECTION_END, K2_CALL_BEGIN, K2_ARGS_BEGIN, K2_CALL_END),
    ((Piece(K2_SECTION_BEGIN, True),),), _K2Section)

FORMATS = (KIMI_K3, KIMI_K2)


# ----------------------------------------------------------------------------------------------------
# The parser


class ToolCallParser:
    """Splits an answer, piece by piece, into content (Piece events) and tool calls (CallStart, CallArgs).

    Content passes through at once, except pieces that may open a section of calls: those wait until they do
    (then they are markup, never content) or cannot (then they are content). After the section closes, the
    rest of the answer (the turn's closing markup) is dropped. If the section breaks its format, or the
    answer ends inside it, everything from its opening on is content after all (`finish` gives it), and
    `calls` stays empty: a client then gets the text, as without tools."""

    def __init__(self, fmt: ToolCallFormat, new_id: Callable[[], str] = new_call_id) -> None:
        self.fmt = fmt
        self._new_id = new_id
        self._held: list[Piece] = []  # a possible section opening
        self._seen: list[Piece] = []  # the section so far, opening included: the text if it fails
        self._section: _Section | None = None
        self._calls: list[list[str]] = []  # [id, name, arguments] of each call begun
        self.state = "content"  # content -> section -> done | failed
        self.error: str | None = None  # why the section failed

    @property
    def calls(self) -> list[ToolCall]:
        """The answer's tool calls, once its section has closed in good order (else none)."""
        return [ToolCall(*c) for c in self._calls] if self.state == "done" else []

    def feed(self, piece: Piece) -> list[Event]:
        if not piece.text:
            return []
        if self.state == "section":
            self._seen.append(piece)
            try:
                events = self._section.feed(piece)
            except Malformed as e:
                self.state, self.error = "failed", str(e)
                return list(self._seen)
            self._record(events)
            if self._section.done:
                self.state = "done"
            return events
        if self.state == "done":
            return []
        if self.state == "failed" or (not self._held and not piece.special):
            return [piece]
        if self._held and not piece.special and not self._held[-1].special:
            self._held[-1] = Piece(self._held[-1].text + piece.text)
        else:
            self._held.append(piece)
        out: list[Event] = []
        while self._held:
            match = max((match_markup(self._held, o) for o in self.fmt.openings), default=NO_MATCH)
            if match == FULL:
                self.state, self._seen, self._held = "section", self._held, []
                self._section = self.fmt.section(self._new_id)
                break
            if match == PREFIX:
                break
            out.append(self._held.pop(0))
        return out

    def finish(self) -> list[Event]:
        """At the end of the answer: what is still held, or the text of a section that never closed."""
        if self.state == "section":
            self.state, self.error = "failed", "the answer ended inside its tool calls"
            return list(self._seen)
        out, self._held = self._held, []
        return list(out)

    def _record(self, events: list[Event]) -> None:
        for ev in events:
            if isinstance(ev, CallStart):
                self._calls.append([ev.id, ev.name, ""])
            elif isinstance(ev, CallArgs):
                self._calls[ev.index][2] += ev.text


NO_MATCH, PREFIX, FULL = 0, 1, 2


def match_markup(held: list[Piece], opening: tuple[Piece, ...]) -> int:
    """Whether `held` is `opening` (FULL), may still become it (PREFIX), or cannot (NO_MATCH). Text in
    `held` comes merged. Also text.reasoning's matcher of channel markup."""
    if len(held) > len(opening):
        return NO_MATCH
    for k, (h, o) in enumerate(zip(held, opening)):
        if h.special != o.special:
            return NO_MATCH
        if h.text != o.text:
            last = k == len(held) - 1
            return PREFIX if last and not h.special and o.text.startswith(h.text) else NO_MATCH
    return FULL if len(held) == len(opening) else PREFIX


# ----------------------------------------------------------------------------------------------------
# Text in, calls out (the template's own text; tests; choosing a checkpoint's format)


def pieces_of(text: str, specials: Collection[str]) -> list[Piece]:
    """A string cut into pieces, every occurrence of a special token's string taken as that token."""
    toks = sorted((s for s in specials if s), key=len, reverse=True)
    if not toks:
        return [Piece(text)] if text else []
    out, pos = [], 0
    for m in re.finditer("|".join(map(re.escape, toks)), text):
        if m.start() > pos:
            out.append(Piece(text[pos:m.start()]))
        out.append(Piece(m[0], True))
        pos = m.end()
    if pos < len(text):
        out.append(Piece(text[pos:]))
    return out


def parse(pieces: Iterable[Piece], fmt: ToolCallFormat, new_id: Callable[[], str] = new_call_id
          ) -> tuple[str, list[ToolCall]]:
    """A whole answer at once: its content (special tokens included as their strings) and its tool calls."""
    parser = ToolCallParser(fmt, new_id)
    events = [ev for p in pieces for ev in parser.feed(p)] + parser.finish()
    return "".join(ev.text for ev in events if isinstance(ev, Piece)), parser.calls


_PROBE = {"id": "functions.probe:0", "type": "function", "function": {"name": "probe", "arguments": '{"a": 1}'}}
_PROBE_TOOL = {"type": "function", "function": {"name": "probe", "description": "probe",
                                                "parameters": {"type": "object",
                                                               "properties": {"a": {"type": "integer"}}}}}


def find_format(tokenizer) -> ToolCallFormat | None:
    """The tool-call format of a checkpoint: the one its chat template writes an assistant's tool call in,
    with every special token of the format in the vocabulary. The template is the oracle: a conversation
    with one call is rendered and must parse back to that call. None: no template, or one whose calls this
    server does not know (their text then comes back as content)."""
    template = getattr(tokenizer, "chat_template", None)
    if template is None:
        return None
    messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "", "tool_calls": [_PROBE]}]
    try:
        text = template.render(messages, add_generation_prompt=False, tools=[_PROBE_TOOL])
    except ValueError:  # a template that refuses tool calls (or these): it has no format we could use
        return None
    want = [("probe", json.loads(_PROBE["function"]["arguments"]))]
    for fmt in FORMATS:
        if all(s in tokenizer.special_to_id for s in fmt.specials):
            _, calls = parse(pieces_of(text, fmt.specials), fmt)
            if [(c.name, json.loads(c.arguments)) for c in calls] == want:
                return fmt
    return None
