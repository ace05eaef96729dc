"""`serve --allow-runtime-lora`: POST /v1/load_lora_adapter and /v1/unload_lora_adapter. A loaded adapter is
listed by /v1/models and generates what the model with only that adapter generates alone (load_adapter, the
oracle), dense and routed-expert; the base model's answer stays its own; unloading takes it away (404 after);
bad loads are one-line 4xx and change nothing; an adapter in use is not unloaded (409); --max-loras holds;
without the flag the endpoints do not exist."""

from __future__ import annotations

import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from moeswap.engine.generate import GenerationConfig, generate
from moeswap.engine.scheduler import Scheduler
from moeswap.lora import CONFIG_NAME, load_adapter
from moeswap.lora.serving import load_adapters, read_adapters, serve_adapters
from moeswap.models.loader import load_model
from moeswap.server.app import build_app
from moeswap.server.options import ServeOptions
from moeswap.text.tokenizer import load_tokenizer

BASE = "tiny-k3"
PROMPT = [5, 17, 301, 44, 9, 120]


class GatedScheduler(Scheduler):
    """The engine's scheduler, whose steps wait while `gate` is clear: a request stays in flight for as long as
    a test needs."""

    gate = threading.Event()

    def step(self):
        assert self.gate.wait(timeout=30), "the test never opened the gate"
        return super().step()


@pytest.fixture(scope="module")
def adapters(tiny_k3_dir, tiny_linear_dir, tmp_path_factory, make_lora_adapter):
    tmp = tmp_path_factory.mktemp("lora")
    return {"style": make_lora_adapter(tiny_k3_dir, tmp / "style", ("q_a_proj", "kv_b_proj", "o_proj"), 0),
            "experts": make_lora_adapter(tiny_k3_dir, tmp / "experts", ("f_b_proj", "w1", "w2", "w3"), 5),
            "linear": make_lora_adapter(tiny_linear_dir, tmp / "linear", ("o_proj",), 0)}


@pytest.fixture(scope="module")
def oracle(tiny_k3_dir, adapters):
    """oracle(name) -> greedy tokens of a fresh model with only that adapter (None: the base), alone."""
    cache: dict = {}

    def tokens(name):
        if name not in cache:
            model, store = load_model(tiny_k3_dir)
            if name is not None:
                load_adapter(model, adapters[name], base_dir=tiny_k3_dir)
            cache[name] = generate(model, PROMPT, GenerationConfig(max_tokens=8, stop_ids=())).tokens
            store.close()
        return cache[name]

    return tokens


@pytest.fixture(scope="module")
def server(tiny_k3_dir, run_app):
    GatedScheduler.gate.set()
    model, store = load_model(tiny_k3_dir)
    app = build_app(model, load_tokenizer(tiny_k3_dir), ServeOptions(model_name=BASE, max_batch=4, max_loras=2,
                                                                    allow_runtime_lora=True),
                    store, scheduler=GatedScheduler, adapters=serve_adapters(model, tiny_k3_dir))
    url = run_app(app)
    yield url, app
    store.close()


def post(url: str, path: str, **body) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=30)


def error(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    message = r.json()["error"]["message"]
    assert "\n" not in message
    return message


def complete(url: str, model: str) -> list[int]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=30)
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    return r.choices[0].token_ids


def listed(url: str) -> list[tuple[str, str | None]]:
    return [(m["id"], m["parent"]) for m in httpx.get(url + "/v1/models", timeout=30).json()["data"]]


def test_load_use_unload(server, adapters, oracle):
    url, _ = server
    assert listed(url) == [(BASE, None)]
    r = post(url, "/v1/load_lora_adapter", lora_name="style", lora_path=str(adapters["style"]))
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'style' added successfully."
    assert post(url, "/v1/load_lora_adapter", lora_name="experts", lora_path=str(adapters["experts"])).status_code == 200
    assert listed(url) == [(BASE, None), ("style", BASE), ("experts", BASE)]
    names = [BASE, "style", "experts", BASE, "experts"]  # at once: the adapters' rows share decode steps
    with ThreadPoolExecutor(len(names)) as pool:
        got = list(pool.map(lambda n: complete(url, n), names))
    assert got == [oracle(n if n != BASE else None) for n in names]
    assert oracle("style") != oracle(None) != oracle("experts")

    message = error(post(url, "/v1/load_lora_adapter", lora_name="style", lora_path=str(adapters["experts"])), 400)
    assert message == "the LoRA adapter 'style' is loaded already; unload it first to load another under its name"
    message = error(post(url, "/v1/load_lora_adapter", lora_name="third", lora_path=str(adapters["style"])), 400)
    assert "--max-loras 2" in message

    r = post(url, "/v1/unload_lora_adapter", lora_name="style")
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'style' removed successfully."
    assert listed(url) == [(BASE, None), ("experts", BASE)]
    with pytest.raises(openai.NotFoundError):
        complete(url, "style")
    assert error(post(url, "/v1/unload_lora_adapter", lora_name="style"), 404) == \
        "the LoRA adapter 'style' is not loaded"
    assert complete(url, BASE) == oracle(None) and complete(url, "experts") == oracle("experts")
    # loaded again under another name: a new slot, the same answer
    assert post(url, "/v1/load_lora_adapter", lora_name="style-2", lora_path=str(adapters["style"])).status_code == 200
    assert complete(url, "style-2") == oracle("style")
    for name in ("style-2", "experts"):
        assert post(url, "/v1/unload_lora_adapter", lora_name=name).status_code == 200
    assert listed(url) == [(BASE, None)] and complete(url, BASE) == oracle(None)


def test_an_adapter_in_use_is_not_unloaded(server, adapters, oracle):
    url, app = server
    assert post(url, "/v1/load_lora_adapter", lora_name="busy", lora_path=str(adapters["style"])).status_code == 200
    engine, slot = app.state.server.engine, app.state.server.adapters["busy"]
    GatedScheduler.gate.clear()
    try:
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(complete, url, "busy")
            deadline = time.monotonic() + 10
            while engine.in_flight_with(slot) == 0:
                assert time.monotonic() < deadline and not running.done()
                time.sleep(0.01)
            message = error(post(url, "/v1/unload_lora_adapter", lora_name="busy"), 409)
            assert message == "the LoRA adapter 'busy' is in use by 1 request; retry when they end"
            GatedScheduler.gate.set()
            assert running.result(timeout=30) == oracle("style")
    finally:
        GatedScheduler.gate.set()
    deadline = time.monotonic() + 10
    while engine.in_flight_with(slot):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert post(url, "/v1/unload_lora_adapter", lora_name="busy").status_code == 200


def test_bad_loads_are_one_line_and_change_nothing(server, adapters, tmp_path):
    url, _ = server
    linked = tmp_path / "linked"
    shutil.copytree(adapters["style"], linked)
    os.replace(linked / CONFIG_NAME, tmp_path / CONFIG_NAME)
    (linked / CONFIG_NAME).symlink_to(tmp_path / CONFIG_NAME)
    cases = [
        (dict(lora_name="x"), "'lora_path': field required"),
        (dict(lora_name="", lora_path=str(adapters["style"])), "'lora_name'"),
        (dict(lora_name="x", lora_path=str(adapters["style"]), lora_int_id=3), "'lora_int_id' is not a parameter"),
        (dict(lora_name=BASE, lora_path=str(adapters["style"])), f"'{BASE}' is the served model's name"),
        (dict(lora_name="x", lora_path=str(tmp_path / "nothing")), "expected an adapter directory"),
        (dict(lora_name="x", lora_path=str(linked)), f"'{CONFIG_NAME}' is a link that resolves outside"),
        (dict(lora_name="x", lora_path=str(adapters["linear"])), "was made for a different base model"),
    ]
    for body, fragment in cases:
        assert fragment in error(post(url, "/v1/load_lora_adapter", **body), 400), body
    assert error(post(url, "/v1/unload_lora_adapter"), 400) == "'lora_name': field required"
    assert listed(url) == [(BASE, None)]


def test_off_without_the_flag(tiny_k3_dir, adapters, run_app):
    """Without --allow-runtime-lora the endpoints are not there (404), whatever adapters serve from the start."""
    model, store = load_model(tiny_k3_dir)
    served = load_adapters(model, read_adapters([("style", adapters["style"])], tiny_k3_dir), tiny_k3_dir)
    url = run_app(build_app(model, load_tokenizer(tiny_k3_dir), ServeOptions(model_name=BASE), store, adapters=served))
    try:
        assert post(url, "/v1/load_lora_adapter", lora_name="x", lora_path=str(adapters["experts"])).status_code == 404
        assert post(url, "/v1/unload_lora_adapter", lora_name="style").status_code == 404
        assert listed(url) == [(BASE, None), ("style", BASE)]
    finally:
        store.close()


def test_max_loras_at_start_is_one_line(capsys, tiny_k3_dir, adapters):
    from moeswap.cli import main

    for argv, fragment in [
        (["--max-loras", "1", "--lora", f"a={adapters['style']}", "--lora", f"b={adapters['experts']}"],
         "--lora: 2 adapters, more than --max-loras 1"),
        (["--max-loras", "0"], "--max-loras must be an integer >= 1, got 0"),
    ]:
        code = main(["serve", str(tiny_k3_dir), *argv])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and fragment in err, err
