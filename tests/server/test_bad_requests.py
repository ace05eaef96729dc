"""What `moeswap serve` does with requests it cannot serve: OpenAI-style error JSON with a 4xx (never a 500)
and the server keeps serving; 429 when every slot and the queue are taken; 401 without the --api-key; a
client that leaves mid-answer frees its sequence at the next step."""

from __future__ import annotations

import json

import httpx
import openai
import pytest


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(max_batch=2, max_context=256)


@pytest.fixture(scope="module")
def http():
    with httpx.Client(timeout=30) as c:
        yield c


def post(http, server, path: str, body) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return http.post(server.url + path, content=content, headers={"content-type": "application/json"})


def error_of(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
TEXT = {"prompt": "hi", "max_tokens": 4}

# (endpoint, body, status, param): every one a request the server must refuse by name
BAD = [
    ("completions", b'{"prompt": "hi",', 400, None),  # malformed JSON
    ("completions", b'{"prompt": "hi", "max_tokens": NaN}', 400, None),  # not JSON either
    ("completions", b'["hi"]', 400, None),  # not an object
    ("completions", b'{"prompt": "\xc3\x28"}', 400, None),  # invalid UTF-8
    ("completions", {"prompt": "\ud800"}, 400, "prompt"),  # a lone surrogate, escaped
    ("completions", {**TEXT, "max_tokens": "4"}, 400, "max_tokens"),  # wrong types
    ("completions", {**TEXT, "temperature": "hot"}, 400, "temperature"),
    ("completions", {**TEXT, "stream": "yes"}, 400, "stream"),
    ("completions", {**TEXT, "stop": ["ok", 3]}, 400, "stop[1]"),
    ("completions", {"max_tokens": 4}, 400, "prompt"),  # missing
    ("chat/completions", {**CHAT, "messages": "hi"}, 400, "messages"),
    ("chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("chat/completions", {**CHAT, "messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content[0].type"),
    ("completions", {**TEXT, "model": "gpt-4o"}, 404, "model"),  # unknown model
    ("chat/completions", {**CHAT, "model": "gpt-4o"}, 404, "model"),
    ("completions", {**TEXT, "prompt": "hi " * 300}, 400, "prompt"),  # prompt over the context (256)
    ("completions", {**TEXT, "prompt": list(range(300))}, 400, "prompt"),
    ("completions", {**TEXT, "n": 0}, 400, "n"),
    ("chat/completions", {**CHAT, "n": 10 ** 6}, 400, "n"),  # more than the server holds at once
    ("completions", {**TEXT, "n": 2, "seed": 2 ** 64 - 1}, 400, "seed"),  # choice 1's seed is out of range
    ("completions", {**TEXT, "max_tokens": -1}, 400, "max_tokens"),  # negative max_tokens
    ("completions", {**TEXT, "max_tokens": 0}, 400, "max_tokens"),
    ("chat/completions", {**CHAT, "max_completion_tokens": -5}, 400, "max_completion_tokens"),
    ("completions", {**TEXT, "max_tokens": 10 ** 12}, 400, "max_tokens"),  # huge max_tokens
    ("completions", {**TEXT, "max_tokens": 10 ** 40}, 400, "max_tokens"),
    ("completions", {**TEXT, "temperature": -1}, 400, "temperature"),
    ("completions", {**TEXT, "top_p": 0}, 400, "top_p"),
    ("completions", {**TEXT, "top_k": -2}, 400, "top_k"),
    ("completions", {**TEXT, "seed": 2 ** 70}, 400, "seed"),
    ("completions", {**TEXT, "stop": ""}, 400, "stop"),
    ("completions", {**TEXT, "stop_token_ids": [10 ** 6]}, 400, "stop_token_ids"),
    ("completions", {**TEXT, "prompt": [5, -1]}, 400, "prompt"),
    ("completions", {**TEXT, "prompt": ""}, 400, "prompt"),
    ("completions", {**TEXT, "prompt": ["a", "b"]}, 400, "prompt"),
    ("completions", {**TEXT, "logprobs": 21}, 400, "logprobs"),
    ("chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs"),  # without logprobs
    ("completions", {**TEXT, "presence_penalty": 2.5}, 400, "presence_penalty"),  # out of [-2, 2]
    ("chat/completions", {**CHAT, "frequency_penalty": -3}, 400, "frequency_penalty"),
    ("completions", {**TEXT, "repetition_penalty": 0.0}, 400, "repetition_penalty"),  # must be > 0
    ("completions", {**TEXT, "logit_bias": {"5": 1.0}}, 400, "logit_bias"),  # not implemented: said so
    ("completions", {**TEXT, "echo": True}, 400, "echo"),
    ("chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("chat/completions", {**CHAT, "tool_choice": "required"}, 400, "tool_choice"),  # calls cannot be forced
    ("chat/completions", {**CHAT, "tool_choice": {"type": "function", "function": {"name": "f"}}}, 400,
     "tool_choice"),
    ("completions", {**TEXT, "min_tokens": 2}, 400, "min_tokens"),  # unknown parameter
    ("chat/completions", {**CHAT, "mirostat": 2}, 400, "mirostat"),
]


@pytest.mark.parametrize("endpoint,body,status,param", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_refused_by_name(http, server, endpoint, body, status, param):
    r = post(http, server, f"/v1/{endpoint}", body)
    assert r.status_code == status, r.text
    err = error_of(r)
    assert err["param"] == param and err["type"] == "invalid_request_error"


@pytest.mark.parametrize("endpoint,body", [("completions", {**TEXT, "min_tokens": 2}),
                                           ("chat/completions", {**CHAT, "stream_options": {"x": 1}})])
def test_an_unknown_parameter_is_unsupported_by_name(http, server, endpoint, body):
    err = error_of(post(http, server, f"/v1/{endpoint}", body))
    name = err["param"].rsplit(".", 1)[-1]
    assert err["code"] == "unsupported_parameter" and name in ("min_tokens", "x") and f"'{err['param']}'" in \
        err["message"]


def test_still_serving_after_bad_requests(http, server):
    statuses = [post(http, server, f"/v1/{endpoint}", body).status_code for endpoint, body, _, _ in BAD]
    assert all(400 <= s < 500 for s in statuses)
    assert post(http, server, "/v1/completions", TEXT).status_code == 200
    assert post(http, server, "/v1/chat/completions", CHAT).status_code == 200
    assert server.engine.alive and server.settle()


@pytest.mark.parametrize("endpoint,body", [
    ("completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),  # was a 500 (the parser's recursion)
    ("chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters":
                                            json.loads('{"a":' * 70 + "1" + "}" * 70)}}]}),
], ids=["prompt-100k-deep", "tools-70-deep"])
def test_a_body_nested_past_64_levels_is_a_400_and_the_server_serves_on(http, server, endpoint, body):
    r = post(http, server, f"/v1/{endpoint}", body)
    assert r.status_code == 400 and error_of(r)["type"] == "invalid_request_error", r.text[:500]
    assert error_of(r)["message"] == "the request body nests deeper than 64 levels", error_of(r)
    assert post(http, server, "/v1/completions", TEXT).status_code == 200


def test_a_prompt_past_the_context_is_refused_before_it_is_tokenized(http, server, monkeypatch):
    """An 8 MB prompt against a 256-token context used to be tokenized whole (1.4 GiB of peak RSS; 60 MB
    aborted the server in the Rust tokenizer): refused from its length alone, and the body limit follows
    from the context, far under the 64 MiB that holds whatever the context."""
    from moeswap.server.app import MAX_BODY_BYTES, body_limit

    tok = server.tokenizer
    limit = body_limit(256, tok.max_token_chars)
    assert server.app.state.server.body_limit == limit < MAX_BODY_BYTES
    encoded = []
    monkeypatch.setattr(type(tok), "_encode", lambda self, text, specials: encoded.append(len(text)) or [1])
    chars = 257 * tok.max_token_chars * 2  # over the bound, under the body limit
    for endpoint, body in (("completions", {**TEXT, "prompt": "a" * chars}),
                           ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": "a" * chars}]})):
        r = post(http, server, f"/v1/{endpoint}", body)
        assert r.status_code == 400 and error_of(r)["code"] == "context_length_exceeded", r.text
        assert "at least" in error_of(r)["message"]
    assert all(n < chars for n in encoded)  # the long text itself never reached the tokenizer
    r = post(http, server, "/v1/completions", {**TEXT, "prompt": "a" * limit})
    assert r.status_code == 413 and error_of(r)["code"] == "body_too_large"
    monkeypatch.undo()
    assert post(http, server, "/v1/completions", TEXT).status_code == 200


def test_context_and_routes(http, server):
    r = post(http, server, "/v1/completions", {**TEXT, "max_tokens": 257})
    assert "context" in error_of(r)["message"] and error_of(r)["code"] == "context_length_exceeded"
    r = http.get(server.url + "/v1/nowhere")
    assert r.status_code == 404 and error_of(r)
    r = http.get(server.url + "/v1/completions")
    assert r.status_code == 405 and error_of(r)


LONG = {"prompt": "tell me everything", "max_tokens": 4000, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def one_slot(start_server):
    """One sequence at a time, one waiting, the default context (4096): a 4000-token answer takes the tiny model
    over a second, so a client can leave long before it ends."""
    return start_server(max_batch=1, max_queue=1)


def test_disconnect_mid_stream_frees_sequence(one_slot):
    aborted, ran_out = one_slot.finished("abort"), one_slot.finished("length")
    with httpx.stream("POST", one_slot.url + "/v1/completions", json={**LONG, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        assert next(line for line in r.iter_lines() if line.startswith("data: "))  # it runs
    # the connection is closed: the sequence leaves at the next step, long before its 4000 tokens
    assert one_slot.settle(until=lambda: one_slot.finished("abort") == aborted + 1)
    assert one_slot.finished("length") == ran_out


def test_disconnect_before_answer_frees_sequence(one_slot):
    """A non-streamed request whose client gives up (here: a timeout) is aborted too."""
    aborted, ran_out = one_slot.finished("abort"), one_slot.finished("length")
    with pytest.raises(httpx.TimeoutException):
        httpx.post(one_slot.url + "/v1/completions", json=LONG, timeout=0.3)
    assert one_slot.settle(until=lambda: one_slot.finished("abort") == aborted + 1)
    assert one_slot.finished("length") == ran_out


def test_queue_full_is_429(one_slot):
    client = one_slot.client()
    long = dict(model=one_slot.name, prompt=LONG["prompt"], max_tokens=LONG["max_tokens"], temperature=0,
                stream=True, extra_body={"ignore_eos": True})
    running = client.completions.create(**long)  # takes the one slot
    queued = client.completions.create(**long)  # waits for it
    try:
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(**{**long, "stream": False, "max_tokens": 2})
        assert e.value.status_code == 429 and e.value.body["code"] == "rate_limit_exceeded"
    finally:
        running.close()
        queued.close()  # the waiting one leaves the queue
    assert one_slot.settle()
    assert client.completions.create(model=one_slot.name, prompt="go on", max_tokens=2).usage.completion_tokens >= 1


def test_api_key(start_server):
    locked = start_server(api_key="s3cret")
    r = httpx.post(locked.url + "/v1/completions", json=TEXT)
    assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        locked.client(api_key="wrong").completions.create(model=locked.name, prompt="hi", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        locked.client(api_key="wrong").models.list()
    ok = locked.client(api_key="s3cret").completions.create(model=locked.name, prompt="hi", max_tokens=2)
    assert ok.usage.completion_tokens >= 1
    assert httpx.get(locked.url + "/health").status_code == 200  # probes need no key


def test_a_failing_step_fails_its_requests_not_the_server(http, server):
    """A scheduler step that raises ends every request in flight with a server error naming it; the engine
    starts over with a fresh scheduler and serves the next request."""
    failing = server.engine.sched

    def broken():
        raise RuntimeError("simulated kernel failure")

    failing.step = broken
    r = post(http, server, "/v1/completions", TEXT)
    assert r.status_code == 500 and "simulated kernel failure" in error_of(r)["message"]
    assert server.engine.sched is not failing and server.settle()
    assert post(http, server, "/v1/completions", TEXT).status_code == 200


# A value that would change the answer, for each parameter docs/serve.md's table refuses or takes only neutral
CHANGING = {"tool_choice": "required", "logit_bias": {"1": 5.0}, "echo": True, "suffix": "x", "best_of": 2,
            "store": True, "metadata": {"k": "v"}, "service_tier": "flex", "modalities": ["text", "audio"],
            "audio": {"voice": "alloy", "format": "wav"}, "prediction": {"type": "content", "content": "hi"},
            "reasoning_effort": "low", "verbosity": "low", "web_search_options": {},
            "functions": [{"name": "f", "parameters": {}}], "function_call": "auto"}


def _table_rows():
    """(parameter, endpoints, verdict) of docs/serve.md's 'Every OpenAI parameter' table."""
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "serve.md").read_text(encoding="utf-8")
    table = doc.split("### Every OpenAI parameter", 1)[1].split("\n\n")[2]
    rows = []
    for line in table.splitlines()[2:]:
        names, endpoints, verdict = (cell.strip() for cell in line.strip("|").split("|"))
        for name in names.replace("`", "").replace("/", ",").split(","):
            rows.append((name.strip(), endpoints, verdict))
    return rows


@pytest.mark.parametrize("name,endpoints,verdict", [r for r in _table_rows()
                                                    if r[2].startswith(("refused", "neutral only"))])
def test_the_documented_refusals_are_unsupported_parameter(http, server, name, endpoints, verdict):
    """Every parameter docs/serve.md lists as refused or neutral only: a value that would change the answer is a
    400 `unsupported_parameter` naming it, on each endpoint the row names."""
    for endpoint in (("chat/completions", "completions") if endpoints.startswith("both") else
                     ("chat/completions",) if endpoints.startswith("chat") else ("completions",)):
        r = post(http, server, f"/v1/{endpoint}", {**(CHAT if endpoint.startswith("chat") else TEXT),
                                                   name: CHANGING[name]})
        assert r.status_code == 400, (endpoint, r.text)
        assert (error_of(r)["param"], error_of(r)["code"]) == (name, "unsupported_parameter"), (endpoint, r.text)


def test_the_neutral_values_are_taken(http, server):
    """What clients send by default at the neutral value: the request is served."""
    body = {**CHAT, "store": False, "metadata": {}, "service_tier": "auto", "modalities": ["text"],
            "safety_identifier": "u1", "prompt_cache_key": "k", "user": "u", "logit_bias": {}}
    assert post(http, server, "/v1/chat/completions", body).status_code == 200


@pytest.fixture(scope="module")
def server_512(start_server):
    return start_server(max_batch=1, max_context=512)


@pytest.mark.parametrize("megabytes", [8, 60], ids=["8MB", "60MB"])
def test_a_prompt_of_megabytes_at_a_512_token_context_is_refused_and_the_server_serves_on(server_512, http,
                                                                                       monkeypatch, megabytes):
    """The incidents as they came: an 8 MB prompt at --max-context 512 took 1.4 GiB (tokenized whole), a
    60 MB one aborted the server. Both are over the body limit that context implies: a 413, unread."""
    served = server_512
    encoded = []
    monkeypatch.setattr(type(served.tokenizer), "_encode", lambda self, text, specials: encoded.append(len(text)) or [1])
    prompt = "a" * (megabytes << 20)
    for endpoint, body in (("completions", {**TEXT, "prompt": prompt}),
                           ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": prompt}]})):
        r = post(http, served, f"/v1/{endpoint}", body)
        assert r.status_code == 413 and error_of(r)["code"] == "body_too_large", r.text[:500]
    assert encoded == []
    monkeypatch.undo()
    assert post(http, served, "/v1/completions", TEXT).status_code == 200
