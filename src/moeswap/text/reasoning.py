"""Reasoning in a model's output: the assistant-turn layouts of the checkpoints moeswap serves (Kimi K3's
`think` and `response` channels), which one a chat template writes, and an incremental parser that splits an
answer into reasoning (vLLM's `reasoning_content`) and content, dropping the markup. Knows no HTTP; tool calls
in the content are text.tool_calls' (pieces are its Piece). Entry points: `find_layout(tokenizer)`,
`start_state(layout, prompt_pieces)`, `ChannelParser(layout, state).feed(piece) / .finish()`, `markup(layout,
state, then)`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from moeswap.text.tool_calls import FULL, K3_CLOSE, K3_OPEN, K3_SEP, NO_MATCH, Piece, match_markup, pieces_of

REASONING, CONTENT = "reasoning", "content"


@dataclass(frozen=True)
class Layout:
    """A checkpoint's assistant turn: `moves` (state, markup, next state), `first` the state before any
    markup, `reasoning` the states whose text is reasoning (all others' is content), `answer` the state whose
    text is the answer proper (what a response_format shapes, text.structured).

    A small state machine: in each state some markup (a sequence of pieces, always begun by a special token)
    moves to another state. The generation prompt has already opened a state (K3's template opens `think`, or
    `response` with thinking off): `start_state` reads it off the prompt's end. A tools section is content
    here (text.tool_calls finds the calls in it). Markup is only ever a special token, so text that merely
    spells one stays text."""

    name: str
    specials: tuple[str, ...]
    first: str
    moves: tuple[tuple[str, tuple[Piece, ...], str], ...]
    reasoning: frozenset[str]
    answer: str


# -- Kimi K3 ------------------------------------------------------------------------------------------
# The template (tests/data/Kimi-K3.jinja) writes an assistant turn as
#   <|open|>message role="assistant"<|sep|>[<|open|>think<|sep|>REASONING<|close|>think<|sep|>]
#   <|open|>response<|sep|>CONTENT<|close|>response<|sep|>[tools section]<|close|>message<|sep|><|end_of_msg|>
# The think element is there when `thinking` (a template switch, on by default) is; the generation prompt
# ends after `<|open|>think<|sep|>` (or `<|open|>response<|sep|>` with thinking off).

K3_END_OF_MSG = "<|end_of_msg|>"


def _k3_tag(opens: bool, name: str) -> tuple[Piece, ...]:
    return Piece(K3_OPEN if opens else K3_CLOSE, True), Piece(name), Piece(K3_SEP, True)


KIMI_K3 = Layout(
    "kimi_k3", (K3_OPEN, K3_CLOSE, K3_SEP, K3_END_OF_MSG), "open",
    (("open", _k3_tag(True, "think"), "think"),
     ("open", _k3_tag(True, "response"), "response"),
     ("think", _k3_tag(False, "think"), "thought"),
     ("thought", _k3_tag(True, "response"), "response"),
     # after the response: the tools section (content here; tool_calls parses it) and the turn's end
     ("response", _k3_tag(False, "response"), "after"),
     ("after", _k3_tag(False, "message"), "after"),
     ("after", (Piece(K3_END_OF_MSG, True),), "after")),
    frozenset({"think"}), "response")

LAYOUTS = (KIMI_K3,)


# ----------------------------------------------------------------------------------------------------
# The parser


class ChannelParser:
    """Splits an answer, piece by piece, into (REASONING | CONTENT, piece) events; markup gives none.

    A piece that may begin markup of the current state is held until the markup completes (then it is
    dropped and the state moves on) or cannot (then the held pieces are the state's text, in order).
    Markup still unfinished when the answer ends (cut by max_tokens) is dropped: it is never text a
    client should see, and specials are only ever markup."""

    def __init__(self, layout: Layout, state: str | None = None) -> None:
        self.layout = layout
        self.state = layout.first if state is None else state
        self._held: list[Piece] = []

    @property
    def part(self) -> str:
        return REASONING if self.state in self.layout.reasoning else CONTENT

    def feed(self, piece: Piece) -> list[tuple[str, Piece]]:
        if not piece.text:
            return []
        if not self._held and not piece.special:
            return [(self.part, piece)]
        if self._held and not piece.special and not self._held[-1].special:
            self._held[-1] = Piece(self._held[-1].text + piece.text)
        else:
            self._held.append(piece)
        out: list[tuple[str, Piece]] = []
        while self._held:
            best = NO_MATCH
            for state, markup, then in self.layout.moves:
                if state == self.state:
                    match = match_markup(self._held, markup)
                    if match == FULL:
                        self.state, self._held = then, []
                        return out
                    best = max(best, match)
            if best != NO_MATCH:  # a prefix: wait for the next piece
                break
            out.append((self.part, self._held.pop(0)))
        return out

    def finish(self) -> list[tuple[str, Piece]]:
        """At the end of the answer: unfinished markup is dropped."""
        self._held = []
        return []


def start_state(layout: Layout, prompt: Sequence[Piece]) -> str:
    """The state the generation prompt leaves the answer in: the markup it ends with, read as the model's
    own would be (`prompt`: the prompt's last pieces, text merged)."""
    for state, markup, then in layout.moves:
        if state == layout.first and len(prompt) >= len(markup) and tuple(prompt[-len(markup):]) == markup:
            return then
    return layout.first


def markup(layout: Layout, state: str, then: str) -> tuple[Piece, ...] | None:
    """The markup that moves `state` to `then` (None: no move does)."""
    return next((m for s, m, t in layout.moves if s == state and t == then), None)


def split(pieces: Iterable[Piece], layout: Layout, state: str | None = None) -> tuple[str, str]:
    """A whole answer at once: (reasoning, content), special tokens included as their strings."""
    parser = ChannelParser(layout, state)
    got = {REASONING: "", CONTENT: ""}
    for part, piece in [ev for p in pieces for ev in parser.feed(p)] + parser.finish():
        got[part] += piece.text
    return got[REASONING], got[CONTENT]


_PROBE_REASONING, _PROBE_CONTENT = "probe thought", "probe answer"


def find_layout(tokenizer) -> Layout | None:
    """The layout of a checkpoint's assistant turns, if its chat template writes reasoning in one this
    server knows, with every special token of it in the vocabulary. The template is the oracle: an
    assistant message with `reasoning_content` is rendered (with the template's default switches) after the
    generation prompt it renders without it, and must split back into that reasoning and content. None: no
    template, or one whose turns this server does not read (the answer is then all content)."""
    template = getattr(tokenizer, "chat_template", None)
    if template is None:
        return None
    user = [{"role": "user", "content": "?"}]
    answer = {"role": "assistant", "content": _PROBE_CONTENT, "reasoning_content": _PROBE_REASONING}
    try:
        prompt = template.render(user, add_generation_prompt=True)
        whole = template.render(user + [answer], add_generation_prompt=False)
    except ValueError:  # a template that refuses these messages: nothing to learn from it
        return None
    if not whole.startswith(prompt):
        return None
    for layout in LAYOUTS:
        if all(s in tokenizer.special_to_id for s in layout.specials):
            state = start_state(layout, pieces_of(prompt, layout.specials))
            if split(pieces_of(whole[len(prompt):], layout.specials), layout, state) == (
                    _PROBE_REASONING, _PROBE_CONTENT):
                return layout
    return None
