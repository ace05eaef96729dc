"""`moeswap serve` over a tiny DeepSeek-V3 (RoPE MLA, group-limited routing, block-FP8 weights as published):
concurrent completions sharing the batch, each the tokens the engine's `generate` gives it alone."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from moeswap.engine.generate import GenerationConfig, generate
from moeswap.engine.scheduler import Scheduler
from moeswap.models.loader import load_model
from moeswap.server.app import build_app
from moeswap.server.options import ServeOptions
from moeswap.text.tokenizer import load_tokenizer
from moeswap.tiny import write_tiny_model


@pytest.fixture(scope="module")
def served(tmp_path_factory, run_app):
    path = write_tiny_model(tmp_path_factory.mktemp("ds") / "ds", "deepseek_v3", "tiny", seed=1, quant="fp8")
    model, store = load_model(path)
    tok = load_tokenizer(path)
    app = build_app(model, tok, ServeOptions(model_name="tiny-ds", max_batch=4), store, scheduler=Scheduler)
    yield run_app(app), model, tok
    store.close()


def test_concurrent_completions_are_each_as_alone(served):
    url, model, tok = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
    prompts = ["the quick brown fox", "Hello world, this is a test", "a b c", "Once upon a time there was"]
    lengths = [20, 9, 14, 24]

    def ask(i):
        r = client.completions.create(model="tiny-ds", prompt=prompts[i], max_tokens=lengths[i], temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
        return r.choices[0].token_ids

    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(ask, range(len(prompts))))
    want = [generate(model, tok.encode(p), GenerationConfig(max_tokens=n, stop_ids=())).tokens
            for p, n in zip(prompts, lengths)]
    assert got == want
    assert len({t for w in want for t in w}) > 8  # not one repeated token
