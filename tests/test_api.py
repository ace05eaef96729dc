"""The Python API (moeswap.api) against its oracles: the engine's greedy tokens (what `moeswap generate` runs),
each prompt alone for a batch, generate's text for stream's pieces, the text before a stop string, the chat
template rendered directly with Jinja2, the tokenizer's end-of-sequence ids; README.md's example run as written
on a tiny model; `moeswap chat` driven through standard input."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest

import moeswap
from moeswap.api import load
from moeswap.commands.chat import ChatSession
from moeswap.engine.generate import GenerationConfig, generate
from moeswap.text.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["the quick brown fox", "jumps over", "a lazy dog, then naïve café owners cheer 北京"]
N = 12


@pytest.fixture(scope="module")
def llm(tiny_k3_dir):
    llm = load(tiny_k3_dir, tune=False)
    yield llm
    llm.close()


def engine_tokens(llm, ids, n=N) -> list[int]:
    """The tokens `moeswap generate` gets: engine.generate, greedy, without the API."""
    return generate(llm.model, ids, GenerationConfig(max_tokens=n, stop_ids=())).tokens


def test_generate_is_the_engines_greedy_run(llm, greedy_oracle):
    ids = llm.tokenizer.encode(PROMPTS[0])
    done = llm.generate(PROMPTS[0], max_tokens=N, ignore_eos=True)
    assert done.prompt_token_ids == ids
    assert done.token_ids == engine_tokens(llm, ids) == greedy_oracle(llm.model, ids, N)
    assert done.text == llm.tokenizer.decode(done.token_ids) and done.finish_reason == "length"
    assert done.usage == {"prompt_tokens": len(ids), "completion_tokens": N, "total_tokens": len(ids) + N}
    assert llm.generate(ids, max_tokens=N, ignore_eos=True).token_ids == done.token_ids  # token ids in


def test_penalties_are_the_engines(llm):
    from moeswap.engine.sampling import SamplingParams

    ids = llm.tokenizer.encode(PROMPTS[0])
    pen = dict(presence_penalty=0.5, frequency_penalty=1.5, repetition_penalty=1.3)
    done = llm.generate(PROMPTS[0], max_tokens=N, ignore_eos=True, **pen)
    want = generate(llm.model, ids, GenerationConfig(max_tokens=N, stop_ids=(), sampling=SamplingParams(**pen)))
    assert done.token_ids == want.tokens != engine_tokens(llm, ids)
    with pytest.raises(ValueError, match="repetition_penalty"):
        llm.generate("hi", repetition_penalty=0)


def test_a_batch_equals_each_prompt_alone(llm):
    alone = [llm.generate(p, max_tokens=N, ignore_eos=True) for p in PROMPTS]
    batch = llm.generate(PROMPTS, max_tokens=N, ignore_eos=True)
    assert [c.token_ids for c in batch] == [c.token_ids for c in alone]
    assert [c.text for c in batch] == [c.text for c in alone]
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    assert [c.token_ids for c in llm.generate(ids, max_tokens=N, ignore_eos=True)] == [c.token_ids for c in alone]
    # sampled: prompt i gets seed + i, so a sampled batch equals each alone too
    sampled = llm.generate(PROMPTS, max_tokens=N, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    assert [c.token_ids for c in sampled] == [
        llm.generate(p, max_tokens=N, temperature=0.8, top_p=0.9, seed=7 + i, ignore_eos=True).token_ids
        for i, p in enumerate(PROMPTS)]


def test_n_answers_are_each_their_seed_alone(llm):
    """n > 1: a list of n Completion per prompt, answer k of the call (prompt i, answer j: k = i·n + j)
    equal to one call with seed + k; chat too; streams refuse n > 1."""
    kw = dict(max_tokens=N, temperature=0.9, top_p=0.95, ignore_eos=True)
    got = llm.generate(PROMPTS[:2], n=3, seed=5, **kw)
    assert [len(answers) for answers in got] == [3, 3]
    assert [[c.token_ids for c in answers] for answers in got] == [
        [llm.generate(p, seed=5 + 3 * i + j, **kw).token_ids for j in range(3)] for i, p in enumerate(PROMPTS[:2])]
    assert len({tuple(c.token_ids) for c in got[0]}) > 1  # sampled: the answers differ
    one = llm.generate(PROMPTS[0], n=2, seed=5, **kw)
    assert [c.token_ids for c in one] == [c.token_ids for c in got[0][:2]]
    messages = [{"role": "user", "content": "hi"}]
    chats = llm.chat(messages, n=2, seed=3, max_tokens=N, temperature=0.9)
    assert [c.token_ids for c in chats] == [llm.chat(messages, seed=3 + j, max_tokens=N, temperature=0.9).token_ids
                                            for j in range(2)]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="n: expected a whole number of answers"):
            llm.generate("hi", n=bad)
    with pytest.raises(ValueError, match="n: a stream gives one answer"):
        llm.stream("hi", n=2)
    assert not llm.scheduler.busy


def test_stream_pieces_join_to_generates_text(llm):
    for prompt in PROMPTS:
        whole = llm.generate(prompt, max_tokens=24, ignore_eos=True)
        stream = llm.stream(prompt, max_tokens=24, ignore_eos=True)
        pieces = list(stream)
        assert "".join(pieces) == whole.text and all(pieces)
        assert stream.completion == whole


def test_open_streams_advance_together(llm):
    """Two streams read in turns share the scheduler's steps; each gives generate's text."""
    alone = [llm.generate(p, max_tokens=N, ignore_eos=True).text for p in PROMPTS[:2]]
    streams = [llm.stream(p, max_tokens=N, ignore_eos=True) for p in PROMPTS[:2]]
    texts = ["", ""]
    live = [0, 1]
    while live:
        for i in list(live):
            piece = next(streams[i], None)
            if piece is None:
                live.remove(i)
            else:
                texts[i] += piece
    assert texts == alone and not llm.scheduler.busy


def test_a_refused_prompt_leaves_nothing_running(llm):
    too_long = list(range(1, 10)) * 500  # 4,500 tokens: more than the engine's 4,096
    with pytest.raises(ValueError, match="exceeds the engine's max_len 4096"):
        llm.generate([PROMPTS[0], too_long])
    assert not llm.scheduler.busy and not llm._jobs


def test_stop_strings_end_the_text_before_them(llm):
    whole = llm.generate(PROMPTS[2], max_tokens=24, ignore_eos=True).text
    stop = next(whole[i:i + 2] for i in range(3, len(whole)) if whole[i:i + 2].isprintable()
                and whole[i:i + 2].strip())
    cut = whole[:whole.find(stop)]
    done = llm.generate(PROMPTS[2], max_tokens=24, ignore_eos=True, stop=[stop, "never in it \x00"])
    assert (done.text, done.finish_reason) == (cut, "stop")
    assert "".join(llm.stream(PROMPTS[2], max_tokens=24, ignore_eos=True, stop=stop)) == cut
    assert not llm.scheduler.busy  # the stopped sequence was freed


def test_closing_a_stream_aborts_it(llm):
    before = llm.generate(PROMPTS[1], max_tokens=N, ignore_eos=True)
    stream = llm.stream(PROMPTS[1], max_tokens=N, ignore_eos=True)
    first = next(stream)
    stream.close()
    assert before.text.startswith(first)
    assert stream.completion.finish_reason == "abort" and len(stream.completion.token_ids) < N
    assert not llm.scheduler.busy and not llm.scheduler.finished
    assert llm.generate(PROMPTS[1], max_tokens=N, ignore_eos=True) == before  # nothing left behind


def test_generation_stops_at_the_tokenizers_end_of_sequence(llm):
    free = llm.generate(PROMPTS[0], max_tokens=N, ignore_eos=True).token_ids
    k = next(i for i in range(2, N) if free[i] not in free[:i])  # a token first made at step k
    eos = llm.tokenizer.eos_ids
    llm.tokenizer.eos_ids = (free[k],)
    try:
        done = llm.generate(PROMPTS[0], max_tokens=N)
    finally:
        llm.tokenizer.eos_ids = eos
    assert (done.token_ids, done.finish_reason) == (free[:k + 1], "stop")
    assert done.text == llm.tokenizer.decode(free[:k])  # the end-of-sequence token is not text


TEMPLATE = ("{% for m in messages %}<|im_user|>{{ m.role }}<|im_middle|>{{ m.content }}<|im_end|>{% endfor %}"
            "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}")
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Name a brown fox."}]


def test_chat_renders_the_checkpoints_template(tiny_k3_dir, copy_model):
    d = copy_model(tiny_k3_dir)
    (d / "chat_template.jinja").write_text(TEMPLATE)
    with load(d, tune=False) as llm:
        rendered = jinja2.Template(TEMPLATE).render(messages=MESSAGES, add_generation_prompt=True)
        ids = llm.tokenizer.encode(rendered, specials=True)  # the template's markup as special tokens
        assert llm.tokenizer.id_to_special[ids[0]] == "<|im_user|>"
        done = llm.chat(MESSAGES, max_tokens=N, ignore_eos=True)
        assert done.prompt_token_ids == llm.chat_prompt(MESSAGES) == ids
        assert done.token_ids == engine_tokens(llm, ids)
        assert "".join(llm.chat_stream(MESSAGES, max_tokens=N, ignore_eos=True)) == done.text


def test_load_options_as_keywords(tiny_k3_dir):
    with pytest.raises(TypeError, match="unexpected keyword argument 'expert_memroy'"):
        load(tiny_k3_dir, tune=False, expert_memroy="1GiB")
    with pytest.raises(ValueError, match="expert_memory: 'lots' is not a size"):
        load(tiny_k3_dir, tune=False, expert_memory="lots")
    with pytest.raises(ValueError, match="--expert-policy 'fifo'"):
        load(tiny_k3_dir, tune=False, expert_policy="fifo")
    with load(tiny_k3_dir, tune=False, expert_memory="3MiB", expert_policy="lru") as llm:
        assert (llm.options.expert_memory, llm.options.expert_policy) == (3 << 20, "lru")


def test_bad_call_arguments(llm):
    with pytest.raises(ValueError, match="token id 99999 is outside the vocabulary"):
        llm.generate([1, 99999])
    with pytest.raises(ValueError, match="adapter 'x' is not loaded"):
        llm.generate("hi", adapter="x")
    with pytest.raises(ValueError, match="stop: expected non-empty strings"):
        llm.generate("hi", stop=[""])
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_new_tokens'"):
        llm.generate("hi", max_new_tokens=4)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        llm.generate("hi", temperature=-1)
    assert not llm.scheduler.busy


def test_lora_at_load_is_generate_lora(tiny_k3_dir, tmp_path, make_lora_adapter, llm):
    """load(lora=PATH) answers as the adapter in slot 1 does on the engine (`generate --lora`'s path); with
    {name: path}, each call picks the adapter or the base."""
    from moeswap.lora.serving import load_adapters, read_adapters
    from moeswap.models.loader import load_model

    adapter = make_lora_adapter(tiny_k3_dir, tmp_path / "style", ("q_a_proj", "kv_b_proj", "o_proj"), 0)
    ids = llm.tokenizer.encode(PROMPTS[0])
    model, store = load_model(tiny_k3_dir)
    load_adapters(model, read_adapters([("style", adapter)], tiny_k3_dir))
    expected = generate(model, ids, GenerationConfig(max_tokens=N, stop_ids=(), adapter=1)).tokens
    store.close()
    with load(tiny_k3_dir, tune=False, lora=adapter) as one:
        assert one.generate(ids, max_tokens=N, ignore_eos=True).token_ids == expected
    base = llm.generate(ids, max_tokens=N, ignore_eos=True).token_ids
    assert base != expected  # (the adapter changes the answer, or the comparison above would show nothing)
    with load(tiny_k3_dir, tune=False, lora={"style": adapter}) as served:
        assert served.generate(ids, max_tokens=N, ignore_eos=True).token_ids == base
        assert served.generate(ids, max_tokens=N, ignore_eos=True, adapter="style").token_ids == expected


def test_importing_moeswap_imports_no_torch():
    code = ("import sys, moeswap; assert 'torch' not in sys.modules and 'moeswap.api' not in sys.modules; "
            "moeswap.load; assert 'torch' not in sys.modules; print(moeswap.LLM.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert (out.returncode, out.stdout) == (0, "LLM\n"), out.stderr
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        moeswap.nothing  # noqa: B018


def readme_example() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    m = re.search(r"<!-- python-example[^>]*-->\n```python\n(.*?)```", text, re.S)
    assert m, "README.md has no <!-- python-example --> block"
    return m.group(1)


def test_the_readme_example_runs(tiny_k3_dir, capsys, monkeypatch):
    code = readme_example()
    assert '"models/stdlib-k3"' in code
    monkeypatch.setenv("MOESWAP_THREADS", "spin")  # the test process keeps its threads
    exec(compile(code.replace('"models/stdlib-k3"', repr(str(tiny_k3_dir))), "README.md", "exec"), {})
    with load(tiny_k3_dir, tune=False) as llm:
        done = llm.generate("import os\n", max_tokens=24)
    assert capsys.readouterr().out.startswith(f"{done.text} {done.finish_reason} {done.usage}\n")


def test_chat_session_carries_the_history(llm):
    session = ChatSession(llm, "be brief", max_tokens=6, temperature=0.0, top_k=0, top_p=1.0, seed=None)
    shown: list[str] = []
    first = session.turn("hello there", shown.append)
    system, hello = {"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}
    assert "".join(shown) == first == llm.chat([system, hello], max_tokens=6).text
    n1 = session.prompt_tokens
    second = session.turn("and more", lambda piece: None)
    talk = [system, hello, {"role": "assistant", "content": first}, {"role": "user", "content": "and more"}]
    assert session.prompt_tokens == len(llm.tokenizer.encode_chat(talk)) > n1
    assert session.history == talk[1:] + [{"role": "assistant", "content": second}]
    assert session.command("/reset") == "reset" and session.history == []
    session.turn("hello there", lambda piece: None)
    assert session.prompt_tokens == n1
    # stopped after the first piece: the request is aborted, the part shown kept
    session.sampling["max_tokens"] = 40
    pieces: list[str] = []
    partial = session.turn("more please", pieces.append, lambda: True)
    assert partial == pieces[0] and session.last.finish_reason == "abort" and not llm.scheduler.busy
    assert session.history[-1] == {"role": "assistant", "content": partial}
    assert session.command("/exit") == "exit" and session.command("hi") is None
    with pytest.raises(ValueError, match="unknown command /help"):
        session.command("/help")


@pytest.mark.slow
def test_the_chat_command_through_stdin(tiny_k3_dir, llm):
    """Two turns, /reset, a turn, end of input: the second prompt holds the first turn, the one after
    /reset does not; the answers are those of the API (one thread here and there: the same sums)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "moeswap", "chat", str(tiny_k3_dir), "--max-tokens", "5",
                          "--system", "be brief"], input="hello there\nand more\n/reset\nhello there\n",
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    counts = [int(n) for n in re.findall(r"\[prompt (\d+) tokens, answer 5 tokens, finish: length\]", out.stderr)]
    system = {"role": "system", "content": "be brief"}
    u1, u2 = {"role": "user", "content": "hello there"}, {"role": "user", "content": "and more"}
    a1 = llm.chat([system, u1], max_tokens=5).text
    a2 = llm.chat([system, u1, {"role": "assistant", "content": a1}, u2], max_tokens=5).text
    tok = load_tokenizer(tiny_k3_dir)
    n1 = len(tok.encode_chat([system, u1]))
    assert counts == [n1, len(tok.encode_chat([system, u1, {"role": "assistant", "content": a1}, u2])), n1]
    assert "[conversation cleared]" in out.stderr
    assert out.stdout == f"> {a1}\n> {a2}\n> > {a1}\n> \n"


def test_chat_takes_generates_sampling_flags(tiny_k3_dir, llm, capsys):
    """chat and generate share one set of sampling flags (options.add_sampling_flags); chat's reach the answer:
    a penalty and a stop string give the API's answer with the same keywords."""
    from moeswap.cli import build_parser

    def flags(command: str) -> set[str]:
        parser = build_parser()._subparsers._group_actions[0].choices[command]  # noqa: SLF001 (argparse's own)
        return {s for a in parser._actions for s in a.option_strings}

    sampling = {"--max-tokens", "--temperature", "--top-k", "--top-p", "--presence-penalty", "--frequency-penalty",
                "--repetition-penalty", "--seed", "--stop"}
    assert sampling <= flags("generate") and sampling <= flags("chat")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    user = {"role": "user", "content": "hello there"}
    full = llm.chat([user], max_tokens=12, repetition_penalty=1.3).text
    stop = full[4:6]
    want = llm.chat([user], max_tokens=12, repetition_penalty=1.3, stop=stop)
    assert want.finish_reason == "stop" and want.text == full[:full.index(stop)]
    out = subprocess.run([sys.executable, "-m", "moeswap", "chat", str(tiny_k3_dir), "--max-tokens", "12",
                          "--repetition-penalty", "1.3", "--stop", stop], input="hello there\n",
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"> {want.text}\n> \n" and "finish: stop" in out.stderr


def test_response_format(llm, strict_json):
    """Structured output through the API (text/structured.py; the engine's part: tests/engine/test_constraints.py):
    a batch of sampled answers each parse and follow the schema; greedy beside them is as alone; a bad
    schema is a ValueError naming the field, before anything is submitted."""
    schema = {"type": "object", "required": ["n", "ok"], "additionalProperties": False,
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
    done = llm.generate(PROMPTS, max_tokens=200, temperature=1.0, seed=3, response_format=fmt)
    for c in done:
        value = strict_json(c.text)
        assert c.finish_reason == "stop" and set(value) == {"n", "ok"} and 0 <= value["n"] <= 99
        assert type(value["n"]) is int and type(value["ok"]) is bool
    answer = llm.chat([{"role": "user", "content": "hi"}], temperature=1.0, seed=1,
                      response_format={"type": "json_object"})
    assert isinstance(strict_json(answer.text), dict) and answer.finish_reason == "stop"
    with pytest.raises(ValueError, match=r"'response_format.json_schema.schema'.*Invalid type: strin"):
        llm.generate("hi", response_format={"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}})
    assert not llm.scheduler.busy
