"""A request's generated tokens as the text a client may see: streamed detokenization, special tokens left
out (unless asked for), and stop strings found on the decoded text.

Text that could still turn out to be the start of a stop string is held back (up to the longest stop
string less one character), so a stream never shows a partial stop string that the next token completes.
With tools, `ToolCallOutput` puts server.tool_calls' parser in front: tool-call markup goes to the parser, the
content through the same TextOutput. Entry points: `TextOutput(tokenizer, stop, skip_specials)`,
`.push(token) -> (text, stopped)`, `.finish() -> text`; `ToolCallOutput`, which adds `.take_deltas()`.
"""

from __future__ import annotations

from collections.abc import Sequence

from moeswap.engine.tokenizer import StreamDecoder, Tokenizer
from moeswap.server.tool_calls import CallArgs, CallStart, Piece, ToolCallFormat, ToolCallParser, new_call_id


class TextOutput:
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


class ToolCallOutput:
    """A chat answer that may call tools: content as TextOutput gives it (stop strings apply to the content,
    not to the calls), tool calls as OpenAI's stream deltas (`take_deltas`) and, once the answer has ended,
    as `tool_calls`. `parallel=False` keeps only the first call. If the calls break their format, their text
    is content, as it would be without tools."""

    def __init__(self, tokenizer: Tokenizer, fmt: ToolCallFormat, stop: Sequence[str] = (), skip_specials: bool = True,
                 parallel: bool = True, new_id=new_call_id) -> None:
        self._text = TextOutput(tokenizer, stop, skip_specials)
        self._decoder = StreamDecoder(tokenizer)  # the one decoder: TextOutput gets text, not tokens
        self._specials = tokenizer.id_to_special
        self._skip = skip_specials
        self._limit = None if parallel else 1
        self.parser = ToolCallParser(fmt, new_id)
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
        return [c.openai() for c in self.parser.calls[:self._limit]]

    def push(self, token: int) -> tuple[str, bool]:
        special = self._specials.get(token)
        piece = Piece(special, True) if special is not None else Piece(self._decoder.push(token))
        return self._route(self.parser.feed(piece))

    def finish(self) -> str:
        text, stopped = self._route(self.parser.feed(Piece(self._decoder.flush())))
        if not stopped:
            text += self._route(self.parser.finish())[0]
        return text + self._text.finish()

    def take_deltas(self) -> list[dict]:
        """The tool-call deltas since the last take, one per call: the first of a call has its id and name."""
        out, self._deltas = self._deltas, []
        return out

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
