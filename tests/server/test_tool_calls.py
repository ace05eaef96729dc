"""Tool-call parsing (text/tool_calls.py, text/output.py's ChatOutput) with the checkpoints' own chat
templates as the oracle: a conversation whose assistant calls tools is rendered (Kimi K3's and Kimi K2's
published templates), the tokens after the prompt are what the model says when it calls them, and parsing
them must give back the calls and the text before them. Streamed token by token, or split at every
character, the result is the same; cut short or broken anywhere, the answer is the text it would be
without tools."""

from __future__ import annotations

import itertools
import json
import shutil

import openai
import pytest

from moeswap.text.output import ChatOutput, prompt_tail
from moeswap.text.reasoning import find_layout, start_state
from moeswap.text.tokenizer import load_tokenizer
from moeswap.text.tool_calls import KIMI_K2, KIMI_K3, Piece, find_format, parse, pieces_of

TOOLS = [{"type": "function", "function": {"name": n, "description": f"{n}.", "parameters": {"type": "object"}}}
         for n in ("get_weather", "search", "now")]
QUERY = 'a "quoted" <|close|> and <|tool_call_end|>, \\ 北京 🙂\nnext line'  # specials' strings as text
CALLS = [
    {"id": "functions.get_weather:0", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}},
    {"id": "functions.search:1", "type": "function",
     "function": {"name": "search", "arguments": {"query": QUERY, "limit": 3, "ratio": 0.5, "exact": False,
                                                  "filters": {"lang": ["fr", "en"]}, "since": None}}},
    {"id": "functions.now:2", "type": "function", "function": {"name": "now", "arguments": {}}},
]
CONTENT = "Let me look."
FORMATS = {"k3": (KIMI_K3, {"thinking": False}, CONTENT), "k2": (KIMI_K2, {}, "<think></think>" + CONTENT)}
USER = [{"role": "user", "content": "Weather in Paris, and news?"}]


def counter_ids():
    n = itertools.count()
    return lambda: f"call_{next(n)}"


def answer_of(tok, fmt, calls, switches) -> list[int]:
    """What the model says when it makes `calls`: the template's rendering of the conversation with the
    assistant's turn, after the prompt it renders without (the caller's strings stay text, as in a prompt)."""
    messages = USER + [{"role": "assistant", "content": CONTENT, "tool_calls": calls}]
    prompt = tok.encode_chat(messages[:1], tools=TOOLS, **switches)
    whole = tok.encode_chat(messages, add_generation_prompt=False, tools=TOOLS, **switches)
    assert whole[:len(prompt)] == prompt
    return whole[len(prompt):]


def _json_text(arguments) -> str:
    """The arguments as the parser writes them back: a string as given, an object as json.dumps writes it
    (the templates' tojson)."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def parsed(fmt, calls) -> list[dict]:
    """`calls` as the parser must give them back (ids from counter_ids where the format writes none)."""
    ids = counter_ids()
    return [{"id": c["id"] if fmt is KIMI_K2 else ids(), "type": "function",
             "function": {"name": c["function"]["name"], "arguments": _json_text(c["function"]["arguments"])}}
            for c in calls]


@pytest.fixture(params=["k3", "k2"])
def case(request, k3_tokenizer, k2_tokenizer):
    """(tokenizer, format, the model's answer as token ids, the content before its calls, the calls as the
    parser must give them)."""
    tok = k3_tokenizer if request.param == "k3" else k2_tokenizer
    fmt, switches, content = FORMATS[request.param]
    return tok, fmt, answer_of(tok, fmt, CALLS, switches), content, parsed(fmt, CALLS)


def chat_output(tok, fmt, tools=True, **kw) -> ChatOutput:
    """The server's output for an answer to USER: the turn's layout read as the server reads it (K3's: the
    generation prompt opened the response, thinking being off), calls parsed unless `tools` is False."""
    layout = find_layout(tok)
    switches = next(sw for f, sw, _ in FORMATS.values() if f is fmt)
    state = None if layout is None else start_state(layout, prompt_tail(tok, tok.encode_chat(USER, tools=TOOLS,
                                                                                             **switches)))
    return ChatOutput(tok, layout, state, fmt if tools else None, new_id=counter_ids(), **kw)


def run(tok, fmt, ids, **kw):
    """(content pieces, tool-call deltas per push, final tool_calls, content) of a ChatOutput fed `ids`."""
    out = chat_output(tok, fmt, **kw)
    texts, deltas = [], []
    for t in ids:
        texts.append(out.push(t)[0])
        deltas.append(out.take_deltas())
        if out.stopped:
            break
    texts.append(out.finish())
    deltas.append(out.take_deltas())
    return texts, deltas, out.tool_calls, "".join(texts)


def plain_text(tok, fmt, ids, **kw) -> str:
    """What the same tokens give without tools."""
    out = chat_output(tok, fmt, tools=False, **kw)
    text = "".join(out.push(t)[0] for t in ids if not out.stopped)
    return text + out.finish()


def assemble(deltas: list[dict]) -> list[dict]:
    """OpenAI's stream deltas put together as a client does; each call's first delta has its id and name."""
    calls: list[dict] = []
    for d in deltas:
        if d["index"] == len(calls):
            assert d["type"] == "function" and d["id"] and d["function"]["name"], d
            calls.append({"id": d["id"], "type": "function",
                          "function": {"name": d["function"]["name"], "arguments": ""}})
        else:
            assert d["index"] == len(calls) - 1 and set(d) == {"index", "function"}, d  # the open call only
        calls[-1]["function"]["arguments"] += d["function"]["arguments"]
    return calls


def test_template_round_trip(case):
    """The template's rendering of a call parses back to that call; the content is the text before it."""
    tok, fmt, answer, content, want = case
    texts, deltas, calls, text = run(tok, fmt, answer)
    assert calls == want and text == content
    # streamed token by token: the deltas add up to the same calls, and what was shown as content at any
    # point is the start of the final content (no markup shown and taken back)
    assert assemble([d for step in deltas for d in step]) == want
    shown = ""
    for t in texts:
        shown += t
        assert content.startswith(shown)


def by_char(pieces: list[Piece]) -> list[Piece]:
    return [q for p in pieces for q in ([p] if p.special else map(Piece, p.text))]


@pytest.mark.parametrize("name", ["k3", "k2"])
def test_split_anywhere(name, k3_tokenizer, k2_tokenizer):
    """The answer's text cut into pieces at every character parses as it does whole, and as its tokens."""
    tok = k3_tokenizer if name == "k3" else k2_tokenizer
    fmt, switches, content = FORMATS[name]
    calls = [c for c in CALLS if c["function"]["name"] != "search"] + [
        {"id": "functions.search:1", "type": "function",
         "function": {"name": "search", "arguments": {"query": "tools <sep> 北京", "n": [1, {"a": None}]}}}]
    answer = answer_of(tok, fmt, calls, switches)
    text = tok.decode(answer)  # special tokens as their strings
    pieces = pieces_of(text, fmt.specials)
    want = (content, parsed(fmt, calls))
    for split in (pieces, by_char(pieces)):
        got = parse(split, fmt, counter_ids())
        assert (got[0], [c.openai() for c in got[1]]) == want
    assert run(tok, fmt, answer)[2:] == (want[1], content)


def test_look_alike_specials_need_tokens(case):
    """As plain text, the caller's `<|close|>` / `<|tool_call_end|>` in QUERY would read as markup and break
    its call (the whole section is then text); as tokens they are text (test_template_round_trip)."""
    tok, fmt, answer, content, want = case
    text = tok.decode(answer)
    assert parse(pieces_of(text, fmt.specials), fmt) == (text, [])


def test_cut_anywhere(case):
    """An answer that ends (max_tokens, a stop id) at any token: before its section closes it is exactly
    the text the same tokens give without tools, with no calls; from the section's close on, the calls."""
    tok, fmt, answer, content, want = case
    end = {KIMI_K3: "<|close|>tools<|sep|>", KIMI_K2: "<|tool_calls_section_end|>"}[fmt]
    closed = next(k for k in range(len(answer) + 1) if tok.decode(answer[:k]).endswith(end))
    for k in range(len(answer) + 1):
        texts, deltas, calls, text = run(tok, fmt, answer[:k])
        if k >= closed:
            assert (text, calls) == (content, want), k
        else:
            assert (text, calls) == (plain_text(tok, fmt, answer[:k]), []), k


def test_stop_strings_and_parallel(case):
    tok, fmt, answer, content, want = case
    # a stop string ends the content before the calls, as without tools
    texts, deltas, calls, text = run(tok, fmt, answer, stop=["look"])
    assert (text, calls) == (content[:content.index("look")], [])
    # stop strings are searched in the content only: one inside the arguments stops nothing, unless the
    # calls break off and their text is content after all
    assert run(tok, fmt, answer, stop=["Paris"])[2:] == (want, content)
    cut = answer[:len(answer) // 2]
    whole = plain_text(tok, fmt, cut)
    assert "Paris" in whole
    assert run(tok, fmt, cut, stop=["Paris"])[2:] == ([], whole[:whole.index("Paris")])
    # parallel_tool_calls false: the first call only, in the deltas too
    texts, deltas, calls, text = run(tok, fmt, answer, parallel=False)
    assert calls == want[:1] and assemble([d for step in deltas for d in step]) == want[:1]


def test_skip_special_tokens_false(case):
    """Special tokens kept as text: the content before the calls keeps them; broken calls are their text."""
    tok, fmt, answer, content, want = case
    assert run(tok, fmt, answer, skip_specials=False)[2:] == (want, content)
    cut = answer[:len(answer) // 2]  # inside the calls
    assert run(tok, fmt, cut, skip_specials=False)[2:] == ([], plain_text(tok, fmt, cut, skip_specials=False))


K3_CALL = '<|open|>call tool="f" index="1"<|sep|>'
K3_BAD = {
    "invalid json": K3_CALL + '<|open|>json type="object"<|sep|>{"a": }<|close|>json<|sep|><|close|>call<|sep|>',
    "json not an object": K3_CALL + '<|open|>json type="object"<|sep|>[1]<|close|>json<|sep|><|close|>call<|sep|>',
    "json NaN": K3_CALL + '<|open|>json type="object"<|sep|>{"a": NaN}<|close|>json<|sep|><|close|>call<|sep|>',
    "number that is not": K3_CALL + '<|open|>argument key="a" type="number"<|sep|>abc<|close|>argument<|sep|>'
                                    '<|close|>call<|sep|>',
    "number that is a boolean": K3_CALL + '<|open|>argument key="a" type="number"<|sep|>true<|close|>argument<|sep|>'
                                          '<|close|>call<|sep|>',
    "unknown type": K3_CALL + '<|open|>argument key="a" type="integer"<|sep|>1<|close|>argument<|sep|>'
                              '<|close|>call<|sep|>',
    "json after an argument": K3_CALL + '<|open|>argument key="a" type="string"<|sep|>x<|close|>argument<|sep|>'
                                        '<|open|>json type="object"<|sep|>{}<|close|>json<|sep|><|close|>call<|sep|>',
    "no function name": '<|open|>call index="1"<|sep|><|close|>call<|sep|>',
    "unquoted attribute": '<|open|>call tool=f<|sep|><|close|>call<|sep|>',
    "text between tags": K3_CALL + 'oops<|close|>call<|sep|>',
    "special in a value": K3_CALL + '<|open|>argument key="a" type="string"<|sep|>x<|open|>y<|close|>argument<|sep|>'
                                    '<|close|>call<|sep|>',
    "wrong close": K3_CALL + '<|close|>argument<|sep|>',
    "unknown element": '<|open|>note<|sep|>',
    "unterminated": K3_CALL + '<|open|>argument key="a" type="string"<|sep|>Par',
    "no section close": K3_CALL + '<|close|>call<|sep|>',
}
K2_CALL = "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
K2_BAD = {
    "invalid json": K2_CALL + '{"a": 1<|tool_call_end|>',
    "not an object": K2_CALL + '"a"<|tool_call_end|>',
    "bad id": "<|tool_call_begin|>f<|tool_call_argument_begin|>{}<|tool_call_end|>",
    "text between calls": K2_CALL + "{}<|tool_call_end|>and then",
    "call inside a call": K2_CALL + "{<|tool_call_begin|>}<|tool_call_end|>",
    "unterminated": K2_CALL + '{"a": ',
    "no section end": K2_CALL + "{}<|tool_call_end|>",
}
BAD = [(KIMI_K3, "<|close|>response<|sep|><|open|>tools<|sep|>" + body + ("<|close|>tools<|sep|>" if "no section"
                                                                            not in name and name != "unterminated"
                                                                            else ""), name)
       for name, body in K3_BAD.items()]
BAD += [(KIMI_K2, "<|tool_calls_section_begin|>" + body + ("<|tool_calls_section_end|>" if name not in (
    "unterminated", "no section end") else ""), name) for name, body in K2_BAD.items()]


@pytest.mark.parametrize("fmt,section,why", BAD, ids=[f"{f.name}-{w}" for f, _, w in BAD])
def test_malformed_is_text(fmt, section, why):
    """A section that breaks its format is the answer's text, every character of it, and no call."""
    text = "Before. " + section + " after"
    assert parse(pieces_of(text, fmt.specials), fmt) == (text, [])
    # the same section well formed parses, so each case is broken by exactly what its name says
    good = {KIMI_K3: "<|close|>response<|sep|><|open|>tools<|sep|>" + K3_CALL
                     + '<|open|>argument key="a" type="number"<|sep|>1<|close|>argument<|sep|><|close|>call<|sep|>'
                       "<|close|>tools<|sep|>",
            KIMI_K2: "<|tool_calls_section_begin|>" + K2_CALL + '{"a": 1}<|tool_call_end|><|tool_calls_section_end|>'}
    content, calls = parse(pieces_of("Before. " + good[fmt] + " after", fmt.specials), fmt)
    assert content == "Before. " and [(c.name, c.arguments) for c in calls] == [("f", '{"a": 1}')]


@pytest.mark.parametrize("text", [
    "<|open|>toolsy<|sep|>x", "<|open|>response<|sep|>hi<|close|>response<|sep|><|close|>message<|sep|>",
    "<|open|>to<|close|>tools<|sep|>", "<|close|>response<|sep|><|open|>tool", "tools<|sep|>",
])
def test_look_alikes_are_content(text):
    """Markup that begins like a section opening but is not one is content, all of it, in order."""
    pieces = pieces_of(text, KIMI_K3.specials)
    assert parse(pieces, KIMI_K3) == (text, [])
    assert parse(by_char(pieces), KIMI_K3) == (text, [])


def test_find_format(tiny_k3_dir, k3_tokenizer, k2_tokenizer, k2_tokenizer_dir, tmp_path):
    """Each checkpoint's template decides; a template without tool calls, or a vocabulary without the
    format's special tokens, gets none (calls then stay text)."""
    assert find_format(k3_tokenizer) is KIMI_K3 and find_format(k2_tokenizer) is KIMI_K2
    assert find_format(load_tokenizer(tiny_k3_dir)) is None  # no chat template
    # K2's template over a vocabulary that lacks K2's tool-call tokens
    d = tmp_path / "mixed"
    shutil.copytree(tiny_k3_dir, d)
    shutil.copy(k2_tokenizer_dir / "chat_template.jinja", d / "chat_template.jinja")
    assert find_format(load_tokenizer(d)) is None
    (d / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert find_format(load_tokenizer(d)) is None


# ----------------------------------------------------------------------------------------------------
# The server, driven by the openai client, over the tiny model made to say the template's calls


@pytest.fixture(scope="module")
def servers(start_server, k3_tokenizer, k2_tokenizer):
    """name -> LiveServer over the tiny K3 model with that tokenizer, its engine choosing scripted tokens."""
    return {name: start_server(tokenizer=tok, scripted=True, model_name=name)
            for name, tok in (("k3", k3_tokenizer), ("k2", k2_tokenizer))}


@pytest.fixture(params=["k3", "k2"])
def live(request, servers):
    """(server, client, format, the scripted answer, its content, its calls, request kwargs)."""
    server = servers[request.param]
    fmt, switches, content = FORMATS[request.param]
    answer = answer_of(server.tokenizer, fmt, CALLS, switches)
    kw = dict(model=request.param, messages=USER,
              tools=TOOLS, temperature=0, extra_body={"chat_template_kwargs": switches, "return_token_ids": True})
    return server, server.client(), fmt, answer, content, parsed(fmt, CALLS), kw


def same_calls(got: list[dict], want: list[dict], fmt) -> bool:
    """K2's ids are the model's; K3 writes none, so each call gets a fresh one of OpenAI's shape."""
    if fmt is KIMI_K3:
        ids = [c["id"] for c in got]
        assert all(i.startswith("call_") for i in ids) and len(set(ids)) == len(ids), ids
        got = [{**c, "id": w["id"]} for c, w in zip(got, want)]
    return got == want


def test_api_tool_calls(live):
    server, client, fmt, answer, content, want, kw = live
    called = server.finished("tool_calls")
    server.say(answer)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == content
    assert same_calls([c.model_dump() for c in choice.message.tool_calls], want, fmt)
    assert choice.token_ids == answer and r.usage.completion_tokens == len(answer)  # the eos ended it
    assert server.finished("tool_calls") == called + 1


def test_api_tool_calls_streamed(live):
    server, client, fmt, answer, content, want, kw = live
    server.say(answer)
    chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    deltas = [c.choices[0].delta for c in chunks]
    shown = "".join(d.content or "" for d in deltas)
    assert shown == content  # no markup before, between or after the calls
    calls = assemble([t.model_dump(exclude_none=True) for d in deltas for t in d.tool_calls or ()])
    assert same_calls(calls, want, fmt)
    assert [c.choices[0].finish_reason for c in chunks][-1] == "tool_calls"
    # the calls came as they were made: a chunk per step, arguments in fragments
    assert sum(1 for d in deltas for t in d.tool_calls or () if not t.id) > len(want)


def test_api_cut_inside_a_call_is_text(live):
    """max_tokens ends the answer inside its calls: the answer is its text, finish_reason "length", as
    without tools, streamed or not."""
    server, client, fmt, answer, content, want, kw = live
    n = len(answer) // 2
    text = plain_text(server.tokenizer, fmt, answer[:n])
    server.say(answer)
    r = client.chat.completions.create(**kw, max_tokens=n)
    assert (r.choices[0].message.content, r.choices[0].message.tool_calls, r.choices[0].finish_reason) == (
        text, None, "length")
    server.say(answer)
    chunks = [c for c in client.chat.completions.create(**kw, max_tokens=n, stream=True) if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"
    # a stop string in that text ends it there, as without tools
    server.say(answer)
    r = client.chat.completions.create(**kw, max_tokens=n, stop=["Paris"])
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (text[:text.index("Paris")], "stop")


def test_api_tool_choice_none_and_no_tools_is_text(live):
    server, client, fmt, answer, content, want, kw = live
    text = plain_text(server.tokenizer, fmt, answer[:-1])  # the last token is the eos
    for change in ({"tool_choice": "none"}, {"tools": openai.NOT_GIVEN}):
        server.say(answer)
        r = client.chat.completions.create(**{**kw, **change})
        assert (r.choices[0].message.content, r.choices[0].message.tool_calls, r.choices[0].finish_reason) == (
            text, None, "stop")


def test_api_conversation_goes_on(live):
    """The answer's calls, sent back with their results, render as the template renders them."""
    server, client, fmt, answer, content, want, kw = live
    server.say(answer)
    r = client.chat.completions.create(**kw)
    message = r.choices[0].message.model_dump(exclude_none=True)
    results = [{"role": "tool", "tool_call_id": c["id"], "content": f"result {i}"}
               for i, c in enumerate(message["tool_calls"])]
    messages = kw["messages"] + [message] + results
    r2 = client.chat.completions.create(**{**kw, "messages": messages}, max_tokens=2)
    tok = server.tokenizer
    assert r2.prompt_token_ids == tok.encode_chat(messages, tools=TOOLS, **kw["extra_body"]["chat_template_kwargs"])
    rendered = tok.decode(r2.prompt_token_ids)
    assert all(f"result {i}" in rendered for i in range(len(results)))
