"""A request's generated tokens as the text a client may see: streamed detokenization, special tokens left
out (unless asked for), and stop strings found on the decoded text.

Text that could still turn out to be the start of a stop string is held back (up to the longest stop
string less one character), so a stream never shows a partial stop string that the next token completes.
Entry point: `TextOutput(tokenizer, stop, skip_specials)`, `.push(token) -> (text, stopped)`, `.finish() -> text`.
"""

from __future__ import annotations

from collections.abc import Sequence

from moeswap.engine.tokenizer import StreamDecoder, Tokenizer


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
        if token not in self._specials:
            self._pending += self._decoder.push(token)
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
