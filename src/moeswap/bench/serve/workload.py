"""The workload of `bench serve`: request lengths, load levels, and the prompts (token ids, else words),
each drawn from (seed, index) alone so that every server gets the same requests. Knows no server or
client. Entry point: `Prompts(workload, vocabulary(model_dir)).spec(i)`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# Prompts of random words, for servers that refuse token ids: common English words, each one token (with its
# leading space) in most BPE vocabularies, so a prompt of n words is about n tokens; usage says how many.
WORDS = tuple("""the of and to in is was for on that with as by at from his her it an were are which this be or
has had not but one their first new two after who they its have also been time other more into up over year
city state world people work school house water place right part number group family system power line music
game small large long high early great local light name life river music point study story""".split())


@dataclass(frozen=True)
class Lengths:
    """A token count: fixed (lo == hi) or uniform over lo..hi inclusive."""

    lo: int
    hi: int

    @classmethod
    def parse(cls, text: str, flag: str) -> Lengths:
        try:
            lo, _, hi = text.partition(":")
            r = cls(int(lo), int(hi or lo))
        except ValueError:
            raise ValueError(f"{flag} {text!r}: expected a count N or a range LO:HI, e.g. 128 or 64:256") from None
        if r.lo < 1 or r.hi < r.lo:
            raise ValueError(f"{flag} {text!r}: expected 1 <= LO <= HI")
        return r

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.lo, self.hi)

    def __str__(self) -> str:
        return str(self.lo) if self.lo == self.hi else f"{self.lo}..{self.hi} (uniform)"


@dataclass(frozen=True)
class Workload:
    prompt: Lengths
    output: Lengths
    num_requests: int | None  # per load level; None: as many as --duration allows
    duration_s: float | None  # per load level: no request is sent after it
    warmup: int  # requests per target before the first level, not measured
    seed: int = 0
    timeout_s: float = 600.0  # per request


@dataclass(frozen=True)
class Level:
    """One load: `concurrency` requests always in flight, or Poisson arrivals at `rate` per second."""

    concurrency: int | None = None
    rate: float | None = None

    def __str__(self) -> str:
        return f"concurrency {self.concurrency}" if self.concurrency else f"{self.rate:g} req/s (Poisson)"

    def as_dict(self) -> dict:
        return {"concurrency": self.concurrency} if self.concurrency else {"request_rate": self.rate}


@dataclass(frozen=True)
class Spec:
    index: int
    max_tokens: int
    ids: list[int] | None  # token ids, when the vocabulary is known
    text: str  # the same length in words, for servers that take no ids


class Prompts:
    """Request i of a run, the same for every target: its lengths and content come from (seed, i) alone.
    Warm-up requests are drawn from a stream of their own, so the measured ones do not depend on --warmup."""

    def __init__(self, workload: Workload, pool: list[int] | None):
        self.w, self.pool = workload, pool

    def spec(self, i: int, stream: str = "run") -> Spec:
        rng = random.Random(f"{self.w.seed}/{stream}/{i}")
        n, m = self.w.prompt.draw(rng), self.w.output.draw(rng)
        ids = [rng.choice(self.pool) for _ in range(n)] if self.pool else None
        return Spec(i, m, ids, " ".join(rng.choice(WORDS) for _ in range(n)))


def vocabulary(model_dir: str) -> list[int]:
    """The ids a random prompt draws from: the tokenizer's ordinary tokens that the model's embedding has."""
    from moeswap.config import load_config
    from moeswap.text.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    n = min(tok.vocab_size, load_config(model_dir).vocab_size)
    return [i for i in range(n) if i not in tok.id_to_special]
