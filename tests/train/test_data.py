"""train/data.py: JSONL lines to samples with loss masks (text + EOS; chat through the model's template with
the loss on assistant turns only, checked against masks written out by hand for Kimi K3's published
template and the built-in one), bad lines, long samples, packing, order and eval split."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from moeswap.text.tokenizer import load_tokenizer
from moeswap.train.config import TrainConfig
from moeswap.train.data import IGNORE, DataError, Encoder, RowStream, Sample, batch, load_data, pack, read_file

K3_TEMPLATE = (Path(__file__).parent.parent / "data" / "Kimi-K3.jinja").read_text(encoding="utf-8")
EFFORT = ("`thinking_effort` guides on how much to think in your thinking channel (not including the response "
          "channel), supported values include `low`, `medium`, `high`, and `max`.\nNow the system is invoked "
          "with `thinking_effort=max`.")


@pytest.fixture(scope="module")
def k3_chat_tok(tiny_k3_dir, tmp_path_factory):
    """The tiny model's tokenizer with Kimi K3's chat template."""
    d = tmp_path_factory.mktemp("k3chat")
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"):
        shutil.copy(tiny_k3_dir / name, d / name)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = K3_TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return load_tokenizer(d)


def expected(tok, pieces: list[tuple[str, bool]]) -> tuple[list[int], list[bool]]:
    """ids and mask of hand-written (text, trained) pieces; each piece starts and ends at a special token
    or the text's ends, so encoding the pieces one by one gives the whole text's ids."""
    ids, mask = [], []
    for text, trained in pieces:
        part = tok.encode(text, specials=True)
        ids += part
        mask += [trained] * len(part)
    return ids, mask


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_text_sample_is_its_tokens_then_eos_all_targets_but_the_first(k3_tok):
    kind, ids, mask = Encoder(k3_tok, 64, False).encode({"text": "the lamp is lit"})
    assert kind == "text"
    assert ids == k3_tok.encode("the lamp is lit") + [k3_tok.eos_ids[0]]
    assert k3_tok.eos_ids[0] == k3_tok.special_to_id["<|end_of_msg|>"]
    assert mask == [False] + [True] * (len(ids) - 1)


def test_chat_loss_is_on_assistant_turns_only_kimi_k3_template(k3_chat_tok):
    messages = [{"role": "user", "content": "Is the lamp lit?"},
                {"role": "assistant", "content": "Yes, since dusk."},
                {"role": "user", "content": "And the fog horn?"},
                {"role": "assistant", "content": "Silent.", "reasoning_content": "No fog tonight."}]
    ids, mask = Encoder(k3_chat_tok, 512, False).chat(messages)
    # K3's template, rendered by hand: the generation prompt (role header and the opened think channel) is
    # context; the rest of each assistant message, through <|end_of_msg|>, is trained
    want_ids, want_mask = expected(k3_chat_tok, [
        ('<|open|>message role="system" type="thinking-effort"<|sep|>' + EFFORT
         + "<|close|>message<|sep|><|end_of_msg|>"
         '<|open|>message role="user"<|sep|>Is the lamp lit?<|close|>message<|sep|><|end_of_msg|>'
         '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>', False),
        ("<|close|>think<|sep|><|open|>response<|sep|>Yes, since dusk.<|close|>response<|sep|>"
         "<|close|>message<|sep|><|end_of_msg|>", True),
        ('<|open|>message role="user"<|sep|>And the fog horn?<|close|>message<|sep|><|end_of_msg|>'
         '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>', False),
        ("No fog tonight.<|close|>think<|sep|><|open|>response<|sep|>Silent.<|close|>response<|sep|>"
         "<|close|>message<|sep|><|end_of_msg|>", True),
    ])
    assert ids == want_ids
    assert mask == want_mask
    assert ids == k3_chat_tok.encode_chat(messages, False)  # the ids inference would see


def test_chat_loss_with_the_built_in_template(k3_tok):
    assert k3_tok.chat_template is None  # the tiny model ships none: Kimi-style <|im_...|> turns
    messages = [{"role": "system", "content": "Terse."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}]
    ids, mask = Encoder(k3_tok, 512, False).chat(messages)
    want = expected(k3_tok, [
        ("<|im_user|>system<|im_middle|>Terse.<|im_end|><|im_user|>user<|im_middle|>Hi<|im_end|>"
         "<|im_assistant|>assistant<|im_middle|>", False),
        ("Hello<|im_end|>", True)])
    assert (ids, mask) == want


def test_malformed_lines_stop_with_file_and_line_or_are_skipped_and_counted(k3_tok, tmp_path):
    good = json.dumps({"text": "a b c"})
    path = write(tmp_path / "d.jsonl", [good, "", "{not json", '["a list"]', good,
                                        json.dumps({"text": "x", "messages": []}),
                                        json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
                                        json.dumps({"text": ""})])
    enc = Encoder(k3_tok, 64, False)
    with pytest.raises(DataError, match=rf"^{path}:3: not valid JSON .*--on-bad-line skip"):
        read_file(str(path), enc, "stop")
    samples, info = read_file(str(path), enc, "skip")
    assert len(samples) == 2 and info.samples == 2 and info.lines == 7
    assert [s.split(": ", 1)[0] for s in info.skipped] == [f"{path}:{n}" for n in (3, 4, 6, 7, 8)]
    assert "expected a JSON object" in info.skipped[1]
    assert "exactly one of" in info.skipped[2] and "no assistant message" in info.skipped[3]
    assert info.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert info.as_dict()["skipped"] == 5


def test_a_fifo_or_a_line_nested_too_deep_is_an_error_naming_it(k3_tok, tmp_path):
    """A FIFO as data would block forever (nothing writes it); a line nested 100k deep would overflow the
    parser's stack: both are one DataError naming the file (and line), never a hang or a RecursionError."""
    import os

    enc = Encoder(k3_tok, 64, False)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(DataError, match=r"fifo is not a regular file; expected a JSONL file"):
        read_file(str(tmp_path / "fifo"), enc, "stop")
    deep = write(tmp_path / "deep.jsonl", [json.dumps({"text": "a b"}), "[" * 100_000 + "]" * 100_000])
    with pytest.raises(DataError, match=rf"^{deep}:2: not a sample \(JSON nested too deeply\)"):
        read_file(str(deep), enc, "stop")
    samples, info = read_file(str(deep), enc, "skip")
    assert len(samples) == 1 and len(info.skipped) == 1


@pytest.mark.parametrize("kind", ["fifo", "line-nested-100k-deep"])
def test_train_on_a_fifo_or_a_line_nested_too_deep_is_one_line_and_leaves_nothing(tiny_k3_dir, tmp_path, capsys,
                                                                                 kind):
    """`moeswap train` as a user runs it: exit 2 at once (an alarm fails a hang), no output directory left."""
    import os
    import signal

    from moeswap import cli

    data = tmp_path / "data.jsonl"
    if kind == "fifo":
        os.mkfifo(data)
        expected = f"{data} is not a regular file; expected a JSONL file"
    else:
        write(data, [json.dumps({"text": "a b"}), "[" * 100_000 + "]" * 100_000])
        expected = f"{data}:2: not a sample (JSON nested too deeply)"

    def hang(signum, frame):
        raise TimeoutError("moeswap train did not answer within 60 s")

    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(60)
    try:
        code = cli.main(["train", "--model", str(tiny_k3_dir), "--train-data", str(data), "--output",
                         str(tmp_path / "out"), "--max-steps", "1", "--seq-len", "32", "--no-progress"])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("moeswap: error: ") and expected in lines[0], lines
    assert not (tmp_path / "out").exists()


def test_a_sample_longer_than_seq_len_is_an_error_naming_it_or_truncated(k3_tok, tmp_path):
    path = write(tmp_path / "d.jsonl", [json.dumps({"text": "the"}), json.dumps({"text": " the" * 40})])
    with pytest.raises(DataError, match=rf"^{path}:2: the sample is 41 tokens, longer than --seq-len 16"):
        read_file(str(path), Encoder(k3_tok, 16, False), "stop")
    samples, info = read_file(str(path), Encoder(k3_tok, 16, True), "stop")
    assert info.truncated == 1 and len(samples[1].ids) == 16
    assert samples[1].ids == tuple(k3_tok.encode(" the" * 40)[:16])


def _samples(lengths: list[int]) -> list[Sample]:
    out, next_id = [], 0
    for n in lengths:
        ids = tuple(range(next_id, next_id + n))
        next_id += n
        out.append(Sample(ids, (False,) + (True,) * (n - 1), f"s{len(out)}"))
    return out


def test_packing_fills_rows_whole_samples_and_masks_each_join():
    samples = _samples([5, 7, 3, 9, 2, 4])
    rows = pack(samples, 12)
    assert [len(ids) for ids, _ in rows] == [12, 12, 6]  # 5+7 | 3+9 | 2+4: no sample is split
    assert [i for ids, _ in rows for i in ids] == [i for s in samples for i in s.ids]
    starts = {s.ids[0] for s in samples}
    for ids, mask in rows:
        assert all(not m for i, m in zip(ids, mask) if i in starts)  # a sample's first token is never a target
        assert all(m for i, m in zip(ids, mask) if i not in starts)
    tokens, labels = batch(rows, pad_id=999)
    # the token before each join does not learn to predict the next sample's first token
    assert (labels[0, 4], labels[0, 5]) == (IGNORE, 6)
    assert labels[2, 5:].tolist() == [IGNORE] * 7 and tokens[2, 6:].tolist() == [999] * 6
    assert int((labels != IGNORE).sum()) == sum(s.targets for s in samples)


def test_row_stream_order_comes_from_the_seed_and_runs_across_epochs():
    samples = _samples([3] * 10)
    a, b, c = RowStream(samples, 7, 8, "off"), RowStream(samples, 7, 8, "off"), RowStream(samples, 8, 8, "off")
    assert a.rows(0, 25) == b.rows(0, 25)
    assert a.rows(0, 10) != c.rows(0, 10)
    first, second = a.epoch(0), a.epoch(1)
    assert sorted(first) == sorted(second) == sorted((s.ids, s.mask) for s in samples) and first != second
    assert a.rows(7, 6) == (first + second)[7:13]
    assert a.total_rows(2.5) == 25
    packed = RowStream(samples, 7, 8, "concat")
    assert packed.total_rows(1) == 5 and all(len(ids) == 6 for ids, _ in packed.epoch(0))


def test_eval_split_is_deterministic_disjoint_and_sized(tiny_k3_dir, k3_tok, tmp_path):
    path = write(tmp_path / "d.jsonl", [json.dumps({"text": f"line {i}"}) for i in range(20)])
    cfg = TrainConfig(model=str(tiny_k3_dir), train_data=str(path), eval_split=0.25, seed=3, output="x")
    one, two = load_data(cfg, k3_tok), load_data(cfg, k3_tok)
    assert [s.where for s in one.eval] == [s.where for s in two.eval]
    assert len(one.eval) == 5 and len(one.train) == 15
    assert {s.where for s in one.eval}.isdisjoint(s.where for s in one.train)
    other = load_data(cfg.replace(seed=4), k3_tok)
    assert [s.where for s in other.eval] != [s.where for s in one.eval]
    summary = one.summary()
    assert summary["train_samples"] == 15 and summary["eval_from"] == "split"
    assert summary["files"][0]["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    with pytest.raises(DataError, match="leaves none to train on"):
        load_data(cfg.replace(train_data=str(write(tmp_path / "one.jsonl", ['{"text": "a"}']))), k3_tok)
