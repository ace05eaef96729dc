"""TextOutput: streamed text with stop strings held back, against the whole text decoded at once."""

from __future__ import annotations

import pytest

from moeswap.text.output import TextOutput
from moeswap.text.tokenizer import load_tokenizer

TEXT = "the quick brown fox jumps over the lazy dog, then naïve café owners cheer 北京"


@pytest.fixture(scope="module")
def tok(tiny_k3_dir):
    return load_tokenizer(tiny_k3_dir)


def run(tok, ids, stop):
    out, released = TextOutput(tok, stop), []
    for t in ids:
        text, stopped = out.push(t)
        released.append(text)
        if stopped:
            return released, True
    released.append(out.finish())
    return released, False


@pytest.mark.parametrize("stop", [["brown f"], ["zzz", "lazy"], ["ïve c"], ["京"], ["fox jumps over the"]])
def test_stop_string(tok, stop):
    ids = tok.encode(TEXT)
    released, stopped = run(tok, ids, stop)
    cut = min(TEXT.find(s) for s in stop if s in TEXT)
    assert stopped and "".join(released) == TEXT[:cut]
    # at every step what was given out is a prefix of the answer: nothing of the stop string leaked early
    for n in range(len(released)):
        assert TEXT[:cut].startswith("".join(released[:n + 1]))


def test_no_stop_is_the_whole_text(tok):
    ids = tok.encode(TEXT)
    released, stopped = run(tok, ids, ["never there"])
    assert not stopped and "".join(released) == TEXT == tok.decode(ids)
    released, _ = run(tok, ids, [])
    assert released[0] == tok.decode(ids[:1])  # with no stop string nothing waits for one
    assert "".join(released) == TEXT


def test_special_tokens_are_not_text_unless_asked_for(tok):
    end = tok.special_to_id["<|im_end|>"]
    ids = tok.encode("hello") + [end] + tok.encode(" world")
    assert "".join(run(tok, ids, [])[0]) == "hello world"
    out = TextOutput(tok, skip_specials=False)
    assert "".join(out.push(t)[0] for t in ids) + out.finish() == "hello<|im_end|> world"
