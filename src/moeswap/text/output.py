"""A completion's generated tokens as the text a caller may see, token by token: streamed detokenization
(tokenizer.StreamDecoder, which never splits a character), special tokens left out unless asked for, stop
strings found on the decoded text. Shared by the server (server/app.py, and server.output.ChatOutput around it)
and the Python API (moeswap.api). Entry point: `TextOutput(tokenizer, stop, skip_specials)`,
`.push(token) -> (text, stopped)`, `.finish() -> text`.
"""

from __future__ import annotations

from collections.abc import Sequence

from moeswap.text.tokenizer import StreamDecoder, Tokenizer


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
