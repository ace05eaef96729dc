"""Reasoning and content (text/reasoning.py, text/output.py's ChatOutput) with Kimi K3's published chat
template as the oracle: an assistant turn with `reasoning_content` is rendered, the tokens after the
generation prompt are what the model says, and parsing them must give back that reasoning and content, with
no markup. Token by token, split at every character, or cut at any token, the parts are the text of their
own tokens; through the server (the openai client, the engine made to say the tokens) the same. With a
response_format, the scripted reasoning stays free and the random model's answer after it follows the schema."""

from __future__ import annotations

import json

import openai
import pytest

from moeswap.text.output import ChatOutput, prompt_tail
from moeswap.text.reasoning import KIMI_K3, REASONING, ChannelParser, find_layout, split, start_state
from moeswap.text.tokenizer import load_tokenizer
from moeswap.text.tool_calls import KIMI_K3 as K3_CALLS
from moeswap.text.tool_calls import Piece, pieces_of

USER = [{"role": "user", "content": "Weather in Paris?"}]
# the caller's strings that spell the layout's markup stay text, in the reasoning as in the content
REASONING_TEXT = 'The user asks about "<|close|>think<|sep|>" & weather;\n北京 🙂 next.'
CONTENT = "It is <|close|>response<|sep|> sunny. 🙂"
TOOLS = [{"type": "function",
          "function": {"name": "get_weather", "description": "w", "parameters": {"type": "object"}}}]
CALL = {"id": "functions.get_weather:0", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def turn(reasoning=REASONING_TEXT, content=CONTENT, calls=None) -> dict:
    m = {"role": "assistant", "content": content, "reasoning_content": reasoning}
    return m if calls is None else {**m, "tool_calls": calls}


def answer_of(tok, assistant: dict, tools=None, **switches) -> tuple[list[int], list[int]]:
    """(prompt, answer): the template's rendering of USER + `assistant`, cut after the generation prompt."""
    prompt = tok.encode_chat(USER, tools=tools, **switches)
    whole = tok.encode_chat(USER + [assistant], add_generation_prompt=False, tools=tools, **switches)
    assert whole[:len(prompt)] == prompt
    return prompt, whole[len(prompt):]


def output(tok, prompt, tools=None, **kw) -> ChatOutput:
    return ChatOutput(tok, KIMI_K3, start_state(KIMI_K3, prompt_tail(tok, prompt)), tools, **kw)


def run(tok, prompt, ids, tools=None, **kw):
    """(reasoning per push, content per push, the output) of a ChatOutput fed `ids` one token at a time."""
    out = output(tok, prompt, tools, **kw)
    reasoning, content = [], []
    for t in ids:
        content.append(out.push(t)[0])
        reasoning.append(out.take_reasoning())
        if out.stopped:
            break
    content.append(out.finish())
    reasoning.append(out.take_reasoning())
    return reasoning, content, out


def test_find_layout(k3_tokenizer, k2_tokenizer, k3_tokenizer_dir, tiny_k3_dir, copy_model):
    assert find_layout(k3_tokenizer) is KIMI_K3
    assert find_layout(k2_tokenizer) is None  # K2's <think> is text, not a layout of special tokens
    assert find_layout(load_tokenizer(tiny_k3_dir)) is None  # no chat template
    # K3's template with thinking off by default writes no reasoning: nothing to split by
    d = copy_model(k3_tokenizer_dir)
    source = (d / "chat_template.jinja").read_text()
    off = source.replace("{%- set thinking = true -%}", "{%- set thinking = false -%}")
    assert off != source
    (d / "chat_template.jinja").write_text(off)
    assert find_layout(load_tokenizer(d)) is None


@pytest.mark.parametrize("thinking", [True, False])
def test_template_round_trip(k3_tokenizer, thinking):
    """Token by token: the parts are the message's, and what was shown of each at any point is the start
    of it (no markup shown, nothing taken back). With thinking off the prompt opens the response."""
    tok = k3_tokenizer
    prompt, answer = answer_of(tok, turn(), thinking=thinking)
    assert start_state(KIMI_K3, prompt_tail(tok, prompt)) == ("think" if thinking else "response")
    reasoning, content, out = run(tok, prompt, answer)
    want = REASONING_TEXT if thinking else ""
    assert ("".join(reasoning), "".join(content), out.reasoning) == (want, CONTENT, want)
    for parts, whole in ((reasoning, want), (content, CONTENT)):
        shown = ""
        for p in parts:
            shown += p
            assert whole.startswith(shown)
    # split at every character of its text, a plain answer splits as it does whole
    state = start_state(KIMI_K3, prompt_tail(tok, prompt))
    pieces = pieces_of(tok.decode(answer_of(tok, turn("a b", "c d"), thinking=thinking)[1]), KIMI_K3.specials)
    for cut in (pieces, [q for p in pieces for q in ([p] if p.special else map(Piece, p.text))]):
        assert split(cut, KIMI_K3, state) == ("a b" if thinking else "", "c d")
    # as plain text, the caller's look-alikes would be markup: they need to be tokens to stay text
    assert split(pieces_of(tok.decode(answer), KIMI_K3.specials), KIMI_K3, state) != (want, CONTENT)


def spans(tok, answer) -> dict[str, tuple[int, int]]:
    """Where each tag of the answer lies, in tokens: name -> (start, end) of `<|close|>think<|sep|>` etc."""
    out, specials = {}, tok.id_to_special
    for i, t in enumerate(answer):
        if specials.get(t) in ("<|open|>", "<|close|>"):
            j = next(j for j in range(i + 1, len(answer)) if specials.get(answer[j]) == "<|sep|>")
            kind = "open" if specials[t] == "<|open|>" else "close"
            out.setdefault(f"{kind} {tok.decode(answer[i + 1:j])}", (i, j + 1))
    return out


def test_cut_anywhere(k3_tokenizer):
    """An answer that ends at any token (max_tokens): each part is the text of its own tokens so far, and
    markup, whole or begun, is never in either."""
    tok = k3_tokenizer
    prompt, answer = answer_of(tok, turn())
    at = spans(tok, answer)
    think_end, resp_start, resp_end = at["close think"], at["open response"], at["close response"]
    for k in range(len(answer) + 1):
        reasoning, content, out = run(tok, prompt, answer[:k])
        want_r = tok.decode(answer[:min(k, think_end[0])])
        want_c = tok.decode(answer[resp_start[1]:min(k, resp_end[0])]) if k > resp_start[1] else ""
        assert (out.reasoning, "".join(content)) == (want_r, want_c), k
        assert "".join(reasoning) == want_r


def test_tool_calls_after_the_response(k3_tokenizer):
    """Thinking on, with a call: reasoning, content and the call, as the template wrote them."""
    tok = k3_tokenizer
    prompt, answer = answer_of(tok, turn(calls=[CALL]), tools=TOOLS)
    reasoning, content, out = run(tok, prompt, answer, tools=K3_CALLS, new_id=lambda: "call_0")
    assert (out.reasoning, "".join(content)) == (REASONING_TEXT, CONTENT)
    assert out.tool_calls == [{**CALL, "id": "call_0"}]
    # cut inside the call: its text is content, as without tools
    cut = answer[:spans(tok, answer)["close call"][0]]
    _, content, out = run(tok, prompt, cut, tools=K3_CALLS)
    assert (out.tool_calls, out.reasoning, "".join(content)) == ([], REASONING_TEXT, "".join(run(tok, prompt, cut)[1]))
    assert "".join(content).startswith(CONTENT + "tools") and "get_weather" in "".join(content)


def test_stop_strings_skip_specials_and_unknown_markup(k3_tokenizer):
    tok = k3_tokenizer
    prompt, answer = answer_of(tok, turn())
    # stop strings are searched in the content only
    _, content, out = run(tok, prompt, answer, stop=["weather", "sunny"])
    assert (out.reasoning, "".join(content), out.stopped) == (REASONING_TEXT, CONTENT[:CONTENT.index("sunny")], True)
    # kept special tokens: the layout's markup still goes, other special tokens stay text
    _, content, out = run(tok, prompt, answer, skip_specials=False)
    assert (out.reasoning, "".join(content)) == (REASONING_TEXT, CONTENT)
    # a special token that begins no markup of the state is the state's text, in order
    parser = ChannelParser(KIMI_K3, "think")
    events = [ev for p in pieces_of("a<|close|>thinker<|sep|>b<|open|>response<|sep|>", KIMI_K3.specials)
              for ev in parser.feed(p)]
    assert [(part, p.text) for part, p in events] == [(REASONING, t) for t in
                                                      ("a", "<|close|>", "thinker", "<|sep|>", "b", "<|open|>",
                                                       "response", "<|sep|>")]


# ----------------------------------------------------------------------------------------------------
# The server, driven by the openai client


@pytest.fixture(scope="module")
def server(start_server, k3_tokenizer):
    return start_server(tokenizer=k3_tokenizer, scripted=True)


def request(server, **kw) -> dict:
    extra = {"return_token_ids": True, **kw.pop("extra_body", {})}
    return {"model": server.name, "messages": USER, "temperature": 0, "extra_body": extra, **kw}


def streamed(server, **kw) -> tuple[str, str, str, list]:
    chunks = [c for c in server.client().chat.completions.create(**request(server, **kw), stream=True) if c.choices]
    deltas = [c.choices[0].delta.model_dump() for c in chunks]
    for d in deltas:
        assert d.get("reasoning") == d.get("reasoning_content")
    return ("".join(d.get("reasoning_content") or "" for d in deltas), "".join(d["content"] or "" for d in deltas),
            chunks[-1].choices[0].finish_reason, deltas)


def test_api_reasoning(server):
    prompt, answer = answer_of(server.tokenizer, turn())
    server.say(answer)
    r = server.client().chat.completions.create(**request(server))
    m = r.choices[0].message.model_dump()
    assert (m["reasoning_content"], m["reasoning"], m["content"], r.choices[0].finish_reason) == (
        REASONING_TEXT, REASONING_TEXT, CONTENT, "stop")
    assert r.prompt_token_ids == prompt and r.choices[0].token_ids == answer
    server.say(answer)
    reasoning, content, finish, deltas = streamed(server)
    assert (reasoning, content, finish) == (REASONING_TEXT, CONTENT, "stop")
    first_content = next(i for i, d in enumerate(deltas) if d["content"])
    assert not any(d.get("reasoning_content") for d in deltas[first_content:])  # reasoning came first
    assert sum(1 for d in deltas if d.get("reasoning_content")) > 3  # as it was made, not at the end


def test_the_python_api_splits_the_same(tiny_model, k3_tokenizer, server):
    """moeswap.api's chat and chat_stream: the server's reasoning, content and finish, from the same tokens."""
    from moeswap.api import LLM
    from moeswap.engine.scheduler import EngineConfig

    model, _, store = tiny_model
    llm = LLM(model, k3_tokenizer, store, EngineConfig(max_batch=2, max_len=1024))
    llm._scheduler = type(server.engine.sched)(model, llm.engine)  # conftest's ScriptedScheduler: told the tokens
    prompt, answer = answer_of(k3_tokenizer, turn())
    llm._scheduler.scripts.append(answer)
    done = llm.chat(USER, temperature=0)
    assert (done.reasoning, done.text, done.finish_reason) == (REASONING_TEXT, CONTENT, "stop")
    assert (done.prompt_token_ids, done.token_ids, done.tool_calls) == (prompt, answer, [])
    llm._scheduler.scripts.append(answer)
    stream = llm.chat_stream(USER)
    assert ("".join(stream), stream.reasoning, stream.completion) == (CONTENT, REASONING_TEXT, done)


def test_api_thinking_off(server):
    """chat_template_kwargs reach the template: thinking off, the prompt opens the response."""
    prompt, answer = answer_of(server.tokenizer, turn(), thinking=False)
    server.say(answer)
    r = server.client().chat.completions.create(**request(server, extra_body={"chat_template_kwargs":
                                                                              {"thinking": False}}))
    m = r.choices[0].message.model_dump()
    assert r.prompt_token_ids == prompt and (m["content"], m.get("reasoning_content")) == (CONTENT, None)


def test_api_cut_in_the_reasoning(server):
    """max_tokens inside the reasoning: the reasoning so far, no content, finish_reason length."""
    prompt, answer = answer_of(server.tokenizer, turn())
    n = spans(server.tokenizer, answer)["close think"][0] // 2
    want = server.tokenizer.decode(answer[:n])
    server.say(answer)
    r = server.client().chat.completions.create(**request(server, max_tokens=n))
    m = r.choices[0].message.model_dump()
    assert (m["reasoning_content"], m["content"], r.choices[0].finish_reason) == (want, None, "length")
    server.say(answer)
    assert streamed(server, max_tokens=n)[:3] == (want, "", "length")


def test_api_reasoning_and_tool_calls(server):
    prompt, answer = answer_of(server.tokenizer, turn(calls=[CALL]), tools=TOOLS)
    server.say(answer)
    r = server.client().chat.completions.create(**request(server, tools=TOOLS))
    m = r.choices[0].message
    assert (m.reasoning_content, m.content, r.choices[0].finish_reason) == (REASONING_TEXT, CONTENT, "tool_calls")
    assert [(c.function.name, c.function.arguments) for c in m.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    server.say(answer)
    reasoning, content, finish, deltas = streamed(server, tools=TOOLS)
    assert (reasoning, content, finish) == (REASONING_TEXT, CONTENT, "tool_calls")


def test_api_conversation_goes_on(server):
    """The answer sent back, reasoning included, renders as the template renders it: K3 shows the model
    its earlier reasoning."""
    tok = server.tokenizer
    prompt, answer = answer_of(tok, turn())
    server.say(answer)
    r = server.client().chat.completions.create(**request(server))
    message = r.choices[0].message.model_dump(exclude_none=True)
    messages = USER + [message, {"role": "user", "content": "And tomorrow?"}]
    r2 = server.client().chat.completions.create(**request(server, messages=messages, max_tokens=1))
    assert r2.prompt_token_ids == tok.encode_chat(messages)
    assert tok.decode(r2.prompt_token_ids).count(REASONING_TEXT) == 1


def test_api_tool_choice_reaches_the_template(server):
    tok = server.tokenizer
    r = server.client().chat.completions.create(**request(server, tools=TOOLS, tool_choice="none", max_tokens=1))
    assert r.prompt_token_ids == tok.encode_chat(USER, tools=TOOLS, tool_choice="none")
    assert "You MUST NOT call any tools" in tok.decode(r.prompt_token_ids)
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(**request(server, tools=TOOLS, tool_choice="none", extra_body={
            "chat_template_kwargs": {"tool_choice": "auto"}}))
    assert e.value.body["param"] == "chat_template_kwargs"


# ----------------------------------------------------------------------------------------------------
# response_format after the reasoning (text.structured.AfterReasoning)

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "rain"],
          "properties": {"city": {"type": "string", "maxLength": 6}, "rain": {"type": "boolean"}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}


def _follows(text: str) -> bool:
    value = json.loads(text)
    return (isinstance(value, dict) and set(value) == {"city", "rain"} and isinstance(value["city"], str)
            and len(value["city"]) <= 6 and type(value["rain"]) is bool)


def reasoning_script(tok) -> list[int]:
    """The tokens of a reasoning section and its closing markup, as the template writes them (the reasoning
    spells the closing markup as text first: that must not end it)."""
    _, answer = answer_of(tok, turn())
    return answer[:spans(tok, answer)["close think"][1]]


def test_api_response_format_after_the_reasoning(server):
    """The reasoning is the scripted one; the model's own answer after it (the markup into the response
    forced, then the grammar) is content that follows the schema, ending where the JSON does."""
    tok = server.tokenizer
    script = reasoning_script(tok)
    _, answer = answer_of(tok, turn())
    opening = answer[slice(*spans(tok, answer)["open response"])]  # as the template writes it
    for seed in (1, 2):
        server.say(script)
        r = server.client().chat.completions.create(**request(server, response_format=FORMAT, temperature=1.0,
                                                              seed=seed, max_tokens=300))
        m, ids = r.choices[0].message.model_dump(), r.choices[0].token_ids
        assert (m["reasoning_content"], r.choices[0].finish_reason) == (REASONING_TEXT, "stop")
        assert _follows(m["content"]) and ids[:len(script) + len(opening)] == script + opening
        assert tok.decode(ids[len(script) + len(opening):]).startswith(m["content"])
        assert "response_format=json_schema" in tok.decode(r.prompt_token_ids)  # the template was told
    server.say(script)
    reasoning, content, finish, _ = streamed(server, response_format=FORMAT, temperature=1.0, seed=3,
                                             max_tokens=300)
    assert (reasoning, finish) == (REASONING_TEXT, "stop") and _follows(content)


def test_the_python_api_response_format_after_the_reasoning(tiny_model, k3_tokenizer, server):
    from moeswap.api import LLM
    from moeswap.engine.scheduler import EngineConfig

    model, _, store = tiny_model
    llm = LLM(model, k3_tokenizer, store, EngineConfig(max_batch=2, max_len=1024))
    llm._scheduler = type(server.engine.sched)(model, llm.engine)
    llm._scheduler.scripts.append(reasoning_script(k3_tokenizer))
    done = llm.chat(USER, temperature=1.0, seed=4, max_tokens=300, response_format=FORMAT)
    assert (done.reasoning, done.finish_reason) == (REASONING_TEXT, "stop") and _follows(done.text)
    # thinking off: the grammar from the first token, as before
    done = llm.chat(USER, temperature=1.0, seed=4, max_tokens=300, response_format=FORMAT,
                    chat_template_kwargs={"thinking": False})
    assert (done.reasoning, done.finish_reason) == ("", "stop") and _follows(done.text)
