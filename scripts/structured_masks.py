"""What structured output costs on the CPU (docs/serve.md "Structured output", docs/decisions.md): schema compile
time and the time to compute one token mask, for llguidance (moeswap's dependency) and, where it is installed,
xgrammar, on the shipped model's vocabulary (models/stdlib-k3, 4096 ids) and on a synthetic 160k one (its
tokens plus seeded concatenations of two of them, so the trie is as deep and wide as a real large vocabulary's).

Each walk starts a matcher on a medium schema (nested object, array, enum, pattern) and takes up to STEPS
tokens, each drawn (seeded) from the tokens the mask allows; the time of every mask computation is kept.

    python scripts/structured_masks.py models/stdlib-k3
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time

import numpy as np

from moeswap.text.tokenizer import load_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                      "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["street", "city"]},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "role", "address"],
}
STEPS, WALKS, LARGE = 200, 5, 160_000


def vocabularies(model_dir: str) -> list[tuple[str, list[bytes], list[int], int]]:
    """(name, token bytes, special ids, eos) for the model's vocabulary and the synthetic large one."""
    tok = load_tokenizer(model_dir)
    specials = sorted(tok.id_to_special)
    regular = [tok.token_bytes(i) for i in range(tok.vocab_size) if i not in tok.id_to_special]
    eos = tok.eos_ids[0]
    small = [tok.token_bytes(i) for i in range(tok.vocab_size)]
    rng, seen = random.Random(0), set(regular)
    large = list(regular)
    while len(large) < LARGE:
        t = rng.choice(regular) + rng.choice(regular)
        if t not in seen:
            seen.add(t)
            large.append(t)
    names = [tok.token_bytes(i) for i in specials]
    return [(f"stdlib-k3 ({len(small)})", small, specials, eos),
            (f"synthetic ({len(large) + len(names)})", large + names,
             list(range(len(large), len(large) + len(names))), len(large) + specials.index(eos))]


def walk_times(first_mask, mask, consume, stopped, vocab: int) -> list[float]:
    times = []
    for seed in range(WALKS):
        rng = random.Random(seed)
        state = first_mask()
        for _ in range(STEPS):
            t0 = time.perf_counter()
            bits = mask(state)
            times.append(time.perf_counter() - t0)
            allowed = np.flatnonzero(np.unpackbits(np.frombuffer(bits, np.uint8), bitorder="little")[:vocab])
            consume(state, int(rng.choice(allowed)))
            if stopped(state):
                break
    return times


def bench_llguidance(tokens, specials, eos):
    import llguidance as llg

    ids = {t: i for i, t in enumerate(tokens) if i not in set(specials)}
    longest = max(map(len, ids))

    def greedy(data: bytes) -> list[int]:
        out, at = [], 0
        while at < len(data):
            n = next(n for n in range(min(longest, len(data) - at), 0, -1) if data[at:at + n] in ids)
            out.append(ids[data[at:at + n]])
            at += n
        return out

    class Vocab:
        eos_token_id, bos_token_id, special_token_ids = eos, None, specials

        def __init__(self):
            self.tokens = tokens

        def __call__(self, text):  # forced text (keys, punctuation): greedy longest match is close enough here
            return greedy(text.encode() if isinstance(text, str) else text)

    t0 = time.perf_counter()
    lt = llg.LLTokenizer(llg.TokenizerWrapper(Vocab()))
    setup = time.perf_counter() - t0
    options = json.dumps({"whitespace_flexible": False})
    t0 = time.perf_counter()
    grammar = llg.LLMatcher.grammar_from_json_schema(SCHEMA, overrides=json.loads(options))
    matcher = llg.LLMatcher(lt, grammar)
    assert not matcher.is_error(), matcher.get_error()
    compile_s = time.perf_counter() - t0
    times = walk_times(lambda: llg.LLMatcher(lt, grammar), lambda m: m.compute_bitmask(),
                       lambda m, t: m.consume_token(t), lambda m: m.is_stopped(), len(tokens))
    return setup, compile_s, times


def bench_xgrammar(tokens, specials, eos):
    import torch
    import xgrammar as xgr

    raw = [b"" if i in set(specials) else t for i, t in enumerate(tokens)]  # empty: never allowed
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(raw, xgr.VocabType.RAW, vocab_size=len(raw), stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    compile_s = time.perf_counter() - t0
    bitmask = xgr.allocate_token_bitmask(1, len(raw))

    def mask(m):
        m.fill_next_token_bitmask(bitmask)
        return bitmask.numpy().tobytes()

    times = walk_times(lambda: xgr.GrammarMatcher(compiled), mask, lambda m, t: m.accept_token(t),
                       lambda m: m.is_terminated(), len(raw))
    del torch
    return setup, compile_s, times


def main(model_dir: str) -> None:
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} load average {os.getloadavg()[0]:.2f}")
    print("| library | vocabulary | vocabulary setup | schema compile | mask per token: mean | median | p99 | masks |")
    print("|---|---|---|---|---|---|---|---|")
    for name, tokens, specials, eos in vocabularies(model_dir):
        for lib, bench in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
            try:
                setup, compile_s, times = bench(tokens, specials, eos)
            except ImportError:
                continue
            q = statistics.quantiles(times, n=100)
            print(f"| {lib} | {name} | {setup * 1e3:.1f} ms | {compile_s * 1e3:.2f} ms | "
                  f"{statistics.mean(times) * 1e6:.0f} µs | {statistics.median(times) * 1e6:.0f} µs | {q[98] * 1e6:.0f} µs | {len(times)} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "models/stdlib-k3")
