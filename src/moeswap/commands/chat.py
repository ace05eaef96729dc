"""`moeswap chat [MODEL]`: an interactive multi-turn chat in the terminal, through the Python API (moeswap.api).

Each turn renders the whole conversation (an optional --system message, every earlier turn, the new user
message) with the checkpoint's chat template and streams the answer. Commands: /reset forgets the
conversation, /exit (or end of input, Ctrl-D) leaves; Ctrl-C stops the answer being written (its request
is aborted; the part shown stays in the conversation) and not the session. A turn the model cannot take (the
conversation outgrew the context) is a one-line error, and the session goes on. After each answer, standard
error gets its token counts. A reasoning checkpoint's reasoning (Kimi K3's thinking) is left out, as the
server sets it apart from the content, and not kept in the conversation. Entry points: `add_parser`, `run`; `ChatSession` (the turn logic).
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from typing import Any

from moeswap.options import (
    LoadOptions,
    add_load_flags,
    add_model_argument,
    add_sampling_flags,
    load_flag_names,
)

COMMANDS = {"/exit": "leave (end of input, Ctrl-D, too)", "/reset": "forget the conversation"}


def add_parser(sub) -> None:
    p = sub.add_parser("chat", help="interactive multi-turn chat with a model (its chat template, streaming)")
    add_model_argument(p)
    p.add_argument("--system", metavar="TEXT", help="a system message that opens the conversation")
    add_sampling_flags(p, max_tokens=512, seed_help="sampling seed of the first answer (then + 1 a turn)")
    p.add_argument("--lora", default=None, metavar="PATH", help="answer with a LoRA adapter (PEFT format)")
    add_load_flags(p)


class ChatSession:
    """The conversation and its turns: `turn(text)` streams the answer to a user message and keeps both in
    the history; `command(line)` handles /reset and /exit. `prompt_tokens`: the last turn's prompt size."""

    def __init__(self, llm, system: str | None = None, **sampling: Any) -> None:
        self.llm, self.system, self.sampling = llm, system, sampling
        self.history: list[dict[str, str]] = []
        self.prompt_tokens = 0
        self.turns = 0
        self.last = None  # the last answer's Completion

    def messages(self, text: str) -> list[dict[str, str]]:
        opening = [{"role": "system", "content": self.system}] if self.system else []
        return [*opening, *self.history, {"role": "user", "content": text}]

    def command(self, line: str) -> str | None:
        """'exit', 'reset' or None (not a command); ValueError for an unknown /command."""
        word = line.strip()
        if word == "/exit":
            return "exit"
        if word == "/reset":
            self.history, self.turns = [], 0
            return "reset"
        if word.startswith("/") and " " not in word:
            raise ValueError(f"unknown command {word}; commands: {', '.join(COMMANDS)}")
        return None

    def turn(self, text: str, show: Callable[[str], None], stopped: Callable[[], bool] = lambda: False) -> str:
        """Streams the answer to `text` through `show`, piece by piece, until it ends or `stopped()` says so
        (then the request is aborted). The user message and the answer (as far as it went) join the history;
        an error (nothing answered) leaves the history as it was."""
        self.last = None
        seed = self.sampling.get("seed")
        sampling = {**self.sampling, "seed": None if seed is None else seed + self.turns}
        answer = ""
        # submits: a conversation that outgrew the context is refused here
        with self.llm.chat_stream(self.messages(text), **sampling) as stream:
            self.prompt_tokens = len(stream.prompt_token_ids)
            try:
                for piece in stream:
                    show(piece)
                    answer += piece
                    if stopped():
                        break
            finally:
                self.history += [{"role": "user", "content": text}, {"role": "assistant", "content": answer}]
                self.turns += 1
        self.last = stream.completion
        return answer


class _Interrupts:
    """Ctrl-C while an answer is written: the first asks the answer to stop at its next piece (the engine
    step in progress finishes, so nothing is left half-updated); a second one interrupts at once."""

    def __init__(self) -> None:
        self.hit = False
        self._before: Any = None

    def __enter__(self) -> _Interrupts:
        self.hit = False
        self._before = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.hit:
            raise KeyboardInterrupt
        self.hit = True

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self._before)


def run(args) -> int:
    from moeswap.api import load

    interactive = sys.stdin.isatty()
    if interactive:
        import readline  # noqa: F401 (line editing and history for input())
    from moeswap.engine.sampling import from_flags

    from_flags(args)  # every flag is checked before the model loads
    options = LoadOptions.from_args(args)
    llm = load(args.model, lora=args.lora, **{n: getattr(options, n) for n in load_flag_names()})
    sampling = {name: getattr(args, name) for name in ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop",
                                                       "presence_penalty", "frequency_penalty", "repetition_penalty")}
    session = ChatSession(llm, args.system, **sampling)
    print(f"moeswap chat: {args.model}; {', '.join(f'{c}: {w}' for c, w in COMMANDS.items())}; Ctrl-C stops an "
          f"answer", file=sys.stderr, flush=True)
    try:
        while True:
            try:
                line = input("> ")
            except EOFError:
                print()
                return 0
            except KeyboardInterrupt:  # at the prompt: a fresh line, as a shell does
                print()
                continue
            if not line.strip():
                continue
            try:
                what = session.command(line)
            except ValueError as err:
                print(f"moeswap: error: {err}", file=sys.stderr, flush=True)
                continue
            if what == "exit":
                return 0
            if what == "reset":
                print("[conversation cleared]", file=sys.stderr, flush=True)
                continue
            _answer(session, line)
    finally:
        llm.close()


def _answer(session: ChatSession, line: str) -> None:
    def show(piece: str) -> None:
        print(piece, end="", flush=True)

    with _Interrupts() as interrupts:
        try:
            session.turn(line, show, lambda: interrupts.hit)
        except KeyboardInterrupt:  # the second Ctrl-C: the engine step was cut short, and is made afresh
            interrupts.hit = True
        except ValueError as err:  # the conversation no longer fits, a template's own error
            print(f"moeswap: error: {err}", file=sys.stderr, flush=True)
            return
    print(flush=True)
    last = session.last
    if interrupts.hit or last is None:
        print("[stopped]", file=sys.stderr, flush=True)
        return
    print(f"[prompt {session.prompt_tokens} tokens, answer {len(last.token_ids)} tokens, finish: "
          f"{last.finish_reason}]", file=sys.stderr, flush=True)
