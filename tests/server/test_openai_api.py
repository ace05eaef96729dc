"""`moeswap serve` driven by the official openai client on loopback: chat and completions, streamed and
not, against the engine's own `generate` (greedy and seeded tokens), the model's full forward
(log-probabilities), the token bytes (text), stop strings and ids, usage, /v1/models, /health, /metrics."""

from __future__ import annotations

import math
from pathlib import Path

import httpx
import openai
import pytest
import torch

from moeswap.engine.generate import GenerationConfig, generate
from moeswap.engine.sampling import SamplingParams
from moeswap.server.app import build_app
from moeswap.server.options import ServeOptions
from moeswap.text.tokenizer import load_tokenizer

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a brown fox."}]
PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(max_batch=4)


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def text_of(tok, ids) -> str:
    """What a client must see for `ids`: their bytes as UTF-8, special tokens left out."""
    return b"".join(tok.token_bytes(t) for t in ids if t not in tok.id_to_special).decode("utf-8", "replace")


def oracle(server, prompt_ids, n, **cfg) -> list[int]:
    return generate(server.model, prompt_ids, GenerationConfig(max_tokens=n, stop_ids=(), **cfg)).tokens


def test_models_health(server, client):
    assert [m.id for m in client.models.list().data] == [server.name]
    assert client.models.retrieve(server.name).id == server.name
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_chat_greedy_is_generate(server, client):
    tok = server.tokenizer
    prompt = tok.encode_chat(MESSAGES)
    r = client.chat.completions.create(model=server.name, messages=MESSAGES, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    want = oracle(server, prompt, 12)
    choice = r.choices[0]
    assert choice.token_ids == want and r.prompt_token_ids == prompt
    assert choice.message.role == "assistant" and choice.message.content == text_of(tok, want)
    assert choice.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(prompt), 12,
                                                                                        len(prompt) + 12)
    # max_completion_tokens is the newer name of the same limit
    r2 = client.chat.completions.create(model=server.name, messages=MESSAGES, max_completion_tokens=5, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert r2.choices[0].message.content == text_of(tok, want[:5]) and r2.usage.completion_tokens == 5


def test_chat_stream_matches(server, client):
    tok = server.tokenizer
    want = oracle(server, tok.encode_chat(MESSAGES), 10)
    chunks = list(client.chat.completions.create(model=server.name, messages=MESSAGES, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text_of(tok, want)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_greedy_stream_and_not(server, client):
    tok = server.tokenizer
    prompt = tok.encode(PROMPT)
    want = oracle(server, prompt, 16)
    r = client.completions.create(model=server.name, prompt=PROMPT, max_tokens=16, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.choices[0].token_ids == want and r.choices[0].prompt_token_ids == prompt
    assert r.choices[0].text == text_of(tok, want) and r.usage.prompt_tokens == len(prompt)
    chunks = list(client.completions.create(model=server.name, prompt=PROMPT, max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True, "return_token_ids": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert [c.choices[0].token_ids for c in chunks if c.choices and c.choices[0].finish_reason] == [want]
    assert chunks[-1].usage.completion_tokens == 16
    # token ids as the prompt: the same request
    r_ids = client.completions.create(model=server.name, prompt=prompt, max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert r_ids.choices[0].text == r.choices[0].text


def test_eos_ends_with_stop(server, tiny_k3_dir, run_app):
    """Without ignore_eos the tokenizer's eos ids end the answer, counted in usage but not shown as text. The
    eos here is a token the tiny model's greedy text is known to reach (its own eos it may never say)."""
    tok = server.tokenizer
    long = oracle(server, tok.encode(PROMPT), 30)
    eos = long[7]
    first = long.index(eos)
    eos_tok = load_tokenizer(tiny_k3_dir, eos_ids=[eos])
    url = run_app(build_app(server.model, eos_tok, ServeOptions(model_name="eos")))
    c = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
    r = c.completions.create(model="eos", prompt=PROMPT, max_tokens=30, temperature=0)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == first + 1
    assert r.choices[0].text == text_of(tok, long[:first])


def test_stop_strings(server, client):
    tok = server.tokenizer
    want = oracle(server, tok.encode(PROMPT), 24)
    full = text_of(tok, want)
    # a stop string of 3 characters from the middle of the text, where it first occurs
    at = next(k for k in range(4, len(full) - 3) if full.find(full[k:k + 3]) == k and "\ufffd" not in full[k:k + 3])
    stop = full[at:at + 3]
    kw = dict(model=server.name, prompt=PROMPT, max_tokens=24, temperature=0, stop=["\x00never", stop],
              extra_body={"ignore_eos": True})
    stopped, aborted = server.finished("stop"), server.finished("abort")
    r = client.completions.create(**kw)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (full[:at], "stop")
    # streamed, the text held back for a possible stop string never leaks: the deltas add up to exactly the text
    deltas = [c.choices[0].text for c in client.completions.create(**kw, stream=True)]
    assert "".join(deltas) == full[:at]
    assert not any(stop in d for d in deltas)
    # the engine dropped both sequences at once; the metrics count them as stopped, not as clients leaving
    assert server.settle() and (server.finished("stop"), server.finished("abort")) == (stopped + 2, aborted)


def test_stop_token_ids(server, client):
    tok = server.tokenizer
    want = oracle(server, tok.encode(PROMPT), 24)
    k = 6
    stop_id = want[k]
    first = want.index(stop_id)
    r = client.completions.create(model=server.name, prompt=PROMPT, max_tokens=24, temperature=0,
                                  extra_body={"ignore_eos": True, "stop_token_ids": [stop_id],
                                              "return_token_ids": True})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].token_ids == want[:first + 1]
    assert r.choices[0].text == text_of(tok, want[:first]) and r.usage.completion_tokens == first + 1


def test_seeded_sampling(server, client):
    tok = server.tokenizer
    prompt = tok.encode_chat(MESSAGES)

    def sampled(seed):
        r = client.chat.completions.create(model=server.name, messages=MESSAGES, max_tokens=16, temperature=0.9,
                                           top_p=0.95, seed=seed,
                                           extra_body={"top_k": 50, "ignore_eos": True, "return_token_ids": True})
        return r.choices[0].token_ids

    first = sampled(7)
    assert sampled(7) == first != sampled(8)
    assert first == oracle(server, prompt, 16, sampling=SamplingParams(0.9, 50, 0.95), seed=7)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_penalties_reach_the_engine(server, client, endpoint):
    """The three penalties are the engine's: greedy with them equals generate with the same SamplingParams."""
    tok = server.tokenizer
    penalties = dict(presence_penalty=0.5, frequency_penalty=1.5)
    extra = {"repetition_penalty": 1.3, "ignore_eos": True, "return_token_ids": True}
    if endpoint == "chat":
        prompt = tok.encode_chat(MESSAGES)
        r = client.chat.completions.create(model=server.name, messages=MESSAGES, max_tokens=16, temperature=0,
                                           extra_body=extra, **penalties)
    else:
        prompt = tok.encode(PROMPT)
        r = client.completions.create(model=server.name, prompt=PROMPT, max_tokens=16, temperature=0,
                                      extra_body=extra, **penalties)
    want = oracle(server, prompt, 16, sampling=SamplingParams(repetition_penalty=1.3, **penalties))
    assert r.choices[0].token_ids == want != oracle(server, prompt, 16)


def test_logprobs_are_the_models(server, client):
    """Log-probabilities of the chosen tokens and the top ones: log-softmax of the model's full forward."""
    tok = server.tokenizer
    prompt = tok.encode_chat(MESSAGES)
    r = client.chat.completions.create(model=server.name, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3, extra_body={"ignore_eos": True, "return_token_ids": True})
    ids = r.choices[0].token_ids
    with torch.no_grad():
        lp = server.model(torch.tensor([prompt + ids]))[0].float().log_softmax(-1)[len(prompt) - 1:-1]
    content = r.choices[0].logprobs.content
    shown = [t for t in ids if t not in tok.id_to_special]
    assert len(content) == len(shown)
    rows = [i for i, t in enumerate(ids) if t not in tok.id_to_special]
    for entry, i in zip(content, rows):
        assert entry.bytes == list(tok.token_bytes(ids[i]))
        assert math.isclose(entry.logprob, lp[i, ids[i]].item(), abs_tol=1e-4)
        top = lp[i].topk(3)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert entry.top_logprobs[0].logprob == entry.logprob  # greedy: the chosen one is the most likely
    # completions' legacy form
    r = client.completions.create(model=server.name, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lps = r.choices[0].logprobs
    assert len(lps.tokens) == len(lps.token_logprobs) == len(lps.top_logprobs) == len(lps.text_offset) > 0
    assert all(len(t) <= 2 for t in lps.top_logprobs) and lps.text_offset[0] == 0


def test_metrics(server, client):
    client.completions.create(model=server.name, prompt=PROMPT, max_tokens=3, temperature=0)
    httpx.post(server.url + "/v1/completions", content=b"{")
    text = httpx.get(server.url + "/metrics").text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    assert values['moeswap_http_requests_total{endpoint="/v1/completions",status="200"}'] >= 1
    assert values['moeswap_http_requests_total{endpoint="/v1/completions",status="400"}'] >= 1
    assert values["moeswap_time_to_first_token_seconds_count"] >= 1
    assert values["moeswap_e2e_request_latency_seconds_count"] >= 1
    assert values["moeswap_generation_tokens_total"] >= 3 and values["moeswap_prompt_tokens_total"] >= 1
    assert values['moeswap_expert_hits_total{tier="fast"}'] + values['moeswap_expert_misses_total{tier="fast"}'] > 0
    assert values['moeswap_expert_bytes_read_total{tier="disk"}'] > 0
    assert values["moeswap_requests_running"] == 0 and values["moeswap_requests_waiting"] == 0
    assert sum(v for k, v in values.items() if k.startswith("moeswap_requests_finished_total")) >= 1


def test_concurrent_requests_are_each_as_alone(server, client):
    """Requests that share the batch (joining it at different steps) each get the tokens they get alone."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = ["the quick brown fox", "Hello world, this is a test", "a b c", "Once upon a time there was"]
    lengths = [24, 9, 17, 30]

    def ask(i):
        r = client.completions.create(model=server.name, prompt=prompts[i], max_tokens=lengths[i], temperature=0,
                                      stream=i % 2 == 1, extra_body={"ignore_eos": True, "return_token_ids": True})
        if i % 2 == 0:
            return r.choices[0].token_ids
        return next(c.choices[0].token_ids for c in r if c.choices and c.choices[0].finish_reason)

    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(ask, range(len(prompts))))
    assert got == [oracle(server, server.tokenizer.encode(p), n) for p, n in zip(prompts, lengths)]


def test_checkpoint_template_with_tools(server, tiny_k3_dir, copy_model, run_app):
    """The checkpoint's own chat template (Kimi K3's, as published) renders the request: tools, tool calls
    and results, and the template's switches (chat_template_kwargs), exactly as encode_chat does."""
    model_dir = copy_model(tiny_k3_dir)
    (model_dir / "chat_template.jinja").write_text(
        (Path(__file__).parent.parent / "data" / "Kimi-K3.jinja").read_text(encoding="utf-8"), encoding="utf-8")
    tok = load_tokenizer(model_dir)
    assert tok.chat_template is not None
    url = run_app(build_app(server.model, tok, ServeOptions(model_name="k3t")))
    c = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    r = c.chat.completions.create(model="k3t", messages=messages, tools=tools, max_tokens=3, temperature=0,
                                  extra_body={"chat_template_kwargs": {"thinking": False}, "return_token_ids": True,
                                              "ignore_eos": True})
    assert r.prompt_token_ids == tok.encode_chat(messages, tools=tools, thinking=False)
    assert r.prompt_token_ids != tok.encode_chat(messages, tools=tools)  # the switch reached the template
    assert r.choices[0].token_ids == oracle(server, r.prompt_token_ids, 3)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_n_choices_are_each_its_seed_alone(server, client, endpoint, stream):
    """n choices: choice i is what the request alone gives with seed + i (the same tokens and text), streamed or
    not; usage counts the prompt once and every choice's tokens."""
    tok = server.tokenizer
    prompt = tok.encode_chat(MESSAGES) if endpoint == "chat" else tok.encode(PROMPT)
    sampling = dict(max_tokens=10, temperature=0.9, seed=40, n=3, stream=stream,
                    extra_body={"ignore_eos": True, "return_token_ids": True})
    if endpoint == "chat":
        r = client.chat.completions.create(model=server.name, messages=MESSAGES, **sampling)
    else:
        r = client.completions.create(model=server.name, prompt=PROMPT, **sampling)
    texts, ids = ["", "", ""], [None, None, None]
    chunks = list(r) if stream else [r]
    for c in chunks:
        for choice in c.choices:
            piece = (choice.delta.content if stream else choice.message.content) if endpoint == "chat" else choice.text
            texts[choice.index] += piece or ""
            if choice.finish_reason is not None:
                ids[choice.index] = choice.token_ids
    for i in range(3):
        want = oracle(server, prompt, 10, sampling=SamplingParams(0.9), seed=40 + i)
        assert ids[i] == want and texts[i] == text_of(tok, want)
    assert len({tuple(t) for t in ids}) == 3  # three samples, not one thrice
    if not stream:
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), 30)


def test_chat_stops_at_the_templates_turn_end(start_server, tiny_k3_dir, tmp_path):
    """A checkpoint whose end of sequence is not its chat template's end of turn (the shipped stdlib-k3 was
    one: <|end_of_msg|> and <|im_end|>): a chat answer stops at the turn end; a completion, which is not a
    chat turn, goes on past it. The answer is scripted: a model fine-tuned on chat turns ends them so."""
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        (tmp_path / name).write_bytes((tiny_k3_dir / name).read_bytes())
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": %d}' % load_tokenizer(tiny_k3_dir).eos_ids[0])
    tok = load_tokenizer(tmp_path)
    end = tok.special_to_id["<|im_end|>"]
    assert tok.turn_end_id == end and end not in tok.stop_ids(()) and end in tok.chat_stop_ids(())
    server = start_server(tokenizer=tok, scripted=True)
    answer = tok.encode("OK.")
    server.say([*answer, end, *tok.encode(" OKWAP")])
    r = server.client().chat.completions.create(model=server.name, messages=MESSAGES, max_tokens=16,
                                                extra_body={"return_token_ids": True})
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("OK.", "stop")
    assert r.choices[0].token_ids == [*answer, end]
    server.say([*answer, end, *tok.encode(" OKWAP")])
    r = server.client().completions.create(model=server.name, prompt=PROMPT, max_tokens=16)
    assert r.choices[0].finish_reason == "length" and r.choices[0].text.startswith("OK. OKWAP")
