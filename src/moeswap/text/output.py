"""A completion's generated tokens as the text a caller may see, token by token: streamed detokenization
(tokenizer.StreamDecoder, which never splits a character), special tokens left out unless asked for, stop
strings found on the decoded text; for chat, reasoning and tool calls split off (text.reasoning,
text.tool_calls). Shared by the server (server/app.py) and the Python API (moeswap.api). Entry points:
`TextOutput(tokenizer, stop, skip_specials)`, `.push(token) -> (text, stopped)`, `.finish() -> text`;
`ChatOutput`, which adds `.take_reasoning()` and `.take_deltas()`; `prompt_tail(tokenizer, ids)`.
"""

from __future__ import annotations

from collections.abc import Sequence

from moeswap.text.reasoning import CONTENT, ChannelParser, Layout
from moeswap.text.tokenizer import StreamDecoder, Tokenizer
from moeswap.text.tool_calls import CallArgs, CallStart, Piece, ToolCallFormat, ToolCallParser, new_call_id


class TextOutput:
    """The text of a completion, token by token. Text that could still turn out to begin a stop string is held
    back (up to the longest stop string less one character), so a stream never shows a partial stop string
    that the next token completes."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), skip_specials: bool = True) -> None:
        self._decoder = StreamDecoder(tokenizer)
        # control tokens are not text, unless asked for (vLLM's skip_special_tokens)
        self._specials = tokenizer.id_to_special if skip_specials else {}
        self._stop = tuple(stop)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._pending = ""  # decoded, not yet given out
        self.stopped = False

    def push(self, token: int) -> tuple[str, bool]:
        """Text to give out now, and whether a stop string ended the text (nothing comes after it)."""
        if self.stopped:
            return "", True
        return self.push_text("" if token in self._specials else self._decoder.push(token))

    def push_text(self, text: str) -> tuple[str, bool]:
        """As `push`, for text already decoded."""
        if self.stopped:
            return "", True
        self._pending += text
        return self._release(final=False)

    def finish(self) -> str:
        """The rest of the text once generation has ended (an unfinished character decodes to U+FFFD)."""
        if self.stopped:
            return ""
        self._pending += self._decoder.flush()
        return self._release(final=True)[0]

    def _release(self, final: bool) -> tuple[str, bool]:
        hits = [i for i in (self._pending.find(s) for s in self._stop) if i >= 0]
        if hits:
            out, self._pending, self.stopped = self._pending[:min(hits)], "", True
            return out, True
        cut = len(self._pending) if final else max(0, len(self._pending) - self._hold)
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out, False


class ChatOutput:
    """A chat answer: reasoning (`take_reasoning`, and all of it in `reasoning`), content as TextOutput gives
    it (stop strings apply to the content only, not to the reasoning or the calls), tool calls as OpenAI's
    stream deltas (`take_deltas`) and, once the answer has ended, as `tool_calls`.

    `layout` (text.reasoning) and `state` (where the generation prompt left the turn): without a layout
    the whole answer is content. `tools`: the tool-call format, None when calls are not parsed;
    `parallel=False` keeps only the first call. Calls that break their format are content, as they would
    be without tools."""

    def __init__(self, tokenizer: Tokenizer, layout: Layout | None = None, state: str | None = None,
                 tools: ToolCallFormat | None = None, stop: Sequence[str] = (), skip_specials: bool = True,
                 parallel: bool = True, new_id=new_call_id) -> None:
        self._text = TextOutput(tokenizer, stop, skip_specials)
        self._decoder = StreamDecoder(tokenizer)  # the one decoder: TextOutput gets text, not tokens
        self._specials = tokenizer.id_to_special
        self._skip = skip_specials
        self._limit = None if parallel else 1
        self.channels = None if layout is None else ChannelParser(layout, state)
        self.parser = None if tools is None else ToolCallParser(tools, new_id)
        self.reasoning = ""  # all of it so far
        self._new_reasoning = ""
        self._deltas: list[dict] = []

    @property
    def stopped(self) -> bool:
        return self._text.stopped

    @property
    def called(self) -> bool:
        """Whether the answer called tools (finish_reason "tool_calls")."""
        return bool(self.tool_calls)

    @property
    def tool_calls(self) -> list[dict]:
        return [] if self.parser is None else [c.openai() for c in self.parser.calls[:self._limit]]

    def push(self, token: int) -> tuple[str, bool]:
        """Content to give out now, and whether a stop string ended it (nothing comes after it)."""
        if self.stopped:
            return "", True
        special = self._specials.get(token)
        return self._split(Piece(special, True) if special is not None else Piece(self._decoder.push(token)))

    def finish(self) -> str:
        if self.stopped:
            return ""
        text, stopped = self._split(Piece(self._decoder.flush()))
        if not stopped and self.channels is not None:
            more, stopped = self._content(self.channels.finish())
            text += more
        if not stopped and self.parser is not None:
            more, stopped = self._route(self.parser.finish())
            text += more
        return text + self._text.finish()

    def take_reasoning(self) -> str:
        """The reasoning since the last take."""
        out, self._new_reasoning = self._new_reasoning, ""
        return out

    def take_deltas(self) -> list[dict]:
        """The tool-call deltas since the last take, one per call: the first of a call has its id and name."""
        out, self._deltas = self._deltas, []
        return out

    def _split(self, piece: Piece) -> tuple[str, bool]:
        return self._content(self.channels.feed(piece) if self.channels is not None else [(CONTENT, piece)])

    def _content(self, parts: list[tuple[str, Piece]]) -> tuple[str, bool]:
        text = ""
        for part, piece in parts:
            if part != CONTENT:
                if not (piece.special and self._skip):
                    self.reasoning += piece.text
                    self._new_reasoning += piece.text
                continue
            got, stopped = self._route(self.parser.feed(piece) if self.parser is not None else [piece])
            text += got
            if stopped:
                return text, True
        return text, False

    def _route(self, events) -> tuple[str, bool]:
        text = ""
        for ev in events:
            if isinstance(ev, Piece):
                if ev.special and self._skip:
                    continue
                got, stopped = self._text.push_text(ev.text)
                text += got
                if stopped:
                    return text, True
            elif self._limit is None or ev.index < self._limit:
                self._delta(ev)
        return text, False

    def _delta(self, ev: CallStart | CallArgs) -> None:
        last = self._deltas[-1] if self._deltas else None
        if isinstance(ev, CallStart):
            self._deltas.append({"index": ev.index, "id": ev.id, "type": "function",
                                 "function": {"name": ev.name, "arguments": ""}})
        elif last is not None and last["index"] == ev.index:
            last["function"]["arguments"] += ev.text
        else:
            self._deltas.append({"index": ev.index, "function": {"arguments": ev.text}})


def prompt_tail(tokenizer: Tokenizer, ids: Sequence[int], n: int = 64) -> list[Piece]:
    """The last `n` tokens of a prompt as pieces (text runs decoded whole), for text.reasoning's
    start_state. Read from the ids, not the rendered text: a caller's string that spells markup is text."""
    pieces: list[Piece] = []
    run: list[int] = []
    for t in list(ids)[-n:] + [None]:
        special = tokenizer.id_to_special.get(t) if t is not None else None
        if t is not None and special is None:
            run.append(t)
            continue
        if run:
            pieces.append(Piece(tokenizer.decode(run)))
            run = []
        if special is not None:
            pieces.append(Piece(special, True))
    return pieces
