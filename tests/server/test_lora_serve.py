"""`moeswap serve --lora NAME=PATH`: adapters listed by /v1/models with their parent, a request's `model` choosing
its adapter (greedy tokens equal to the model with only that adapter, load_adapter, run alone), requests with
different adapters at once, an unknown name a 404, and bad adapters refused at start (one line, exit 2)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from moeswap.cli import main
from moeswap.engine.generate import GenerationConfig, generate
from moeswap.lora import load_adapter
from moeswap.lora.serving import load_adapters, read_adapters
from moeswap.models.loader import load_model
from moeswap.server.app import build_app
from moeswap.server.options import ServeOptions
from moeswap.text.tokenizer import load_tokenizer

BASE = "tiny-k3"
PROMPT = [5, 17, 301, 44, 9, 120]
MESSAGES = [{"role": "user", "content": "Name a brown fox."}]


@pytest.fixture(scope="module")
def adapters(tiny_k3_dir, tmp_path_factory, make_lora_adapter):
    tmp = tmp_path_factory.mktemp("lora")
    dense = ("q_a_proj", "kv_b_proj", "o_proj", "down_proj")
    return {"style": make_lora_adapter(tiny_k3_dir, tmp / "style", dense, 0),
            "experts": make_lora_adapter(tiny_k3_dir, tmp / "experts", ("f_b_proj", "w1", "w2", "w3"), 5)}


@pytest.fixture(scope="module")
def server(tiny_k3_dir, adapters, run_app):
    model, store = load_model(tiny_k3_dir)
    served = load_adapters(model, read_adapters(list(adapters.items()), tiny_k3_dir))
    app = build_app(model, load_tokenizer(tiny_k3_dir), ServeOptions(model_name=BASE, max_batch=4), store,
                    adapters=served)
    yield openai.OpenAI(base_url=run_app(app) + "/v1", api_key="-", max_retries=0, timeout=60)
    store.close()


def oracle(base_dir, adapter_dir, prompt, n) -> list[int]:
    """Greedy tokens of a fresh model with only this adapter (none: the base), alone."""
    model, store = load_model(base_dir)
    if adapter_dir is not None:
        load_adapter(model, adapter_dir, base_dir=base_dir)
    tokens = generate(model, prompt, GenerationConfig(max_tokens=n, stop_ids=())).tokens
    store.close()
    return tokens


def complete(client, model: str, n: int = 8, stream: bool = False):
    extra = {"ignore_eos": True, "return_token_ids": True}
    if not stream:
        r = client.completions.create(model=model, prompt=PROMPT, max_tokens=n, temperature=0, extra_body=extra)
        return r.model, r.choices[0].token_ids
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=n, temperature=0, stream=True,
                                            extra_body=extra))
    assert {c.model for c in chunks} == {model}
    return model, next(c.choices[0].token_ids for c in chunks if c.choices and c.choices[0].finish_reason)


def test_models_lists_the_adapters(server):
    cards = server.models.list().data
    assert [(m.id, m.parent) for m in cards] == [(BASE, None), ("style", BASE), ("experts", BASE)]
    assert server.models.retrieve("experts").parent == BASE
    with pytest.raises(openai.NotFoundError, match="'nope' does not exist; this server serves 'tiny-k3', 'style'"):
        server.models.retrieve("nope")


def test_model_name_chooses_the_adapter(server, tiny_k3_dir, adapters):
    """Base, style and routed-expert requests sent at once (they share decode steps): each is the model with only
    its adapter, alone; the adapters change the answer."""
    names = [BASE, "style", "experts", BASE, "style"]
    with ThreadPoolExecutor(len(names)) as pool:
        got = list(pool.map(lambda i: complete(server, names[i], stream=i % 2 == 1), range(len(names))))
    want = {n: oracle(tiny_k3_dir, adapters.get(n), PROMPT, 8) for n in (BASE, "style", "experts")}
    assert got == [(n, want[n]) for n in names]
    assert want["style"] != want[BASE] != want["experts"]


def test_chat_with_an_adapter(server, tiny_k3_dir, adapters):
    tok = load_tokenizer(tiny_k3_dir)
    r = server.chat.completions.create(model="style", messages=MESSAGES, max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.model == "style"
    assert r.choices[0].token_ids == oracle(tiny_k3_dir, adapters["style"], tok.encode_chat(MESSAGES), 6)


def test_unknown_model_is_404(server):
    for create in (lambda: server.completions.create(model="styl", prompt="hi", max_tokens=2),
                   lambda: server.chat.completions.create(model="styl", messages=MESSAGES, max_tokens=2)):
        with pytest.raises(openai.NotFoundError) as err:
            create()
        assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"


def one_line_error(capsys, argv) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("moeswap: error: "), err
    return err


def test_bad_adapters_are_refused_at_start(capsys, tiny_k3_dir, tiny_linear_dir, adapters):
    err = one_line_error(capsys, ["serve", str(tiny_linear_dir), "--lora", f"style={adapters['style']}"])
    assert "adapter 'style'" in err and "was made for a different base model" in err
    err = one_line_error(capsys, ["serve", str(tiny_k3_dir), "--lora", str(adapters["style"])])
    assert "serve needs NAME=PATH" in err
    err = one_line_error(capsys, ["serve", str(tiny_k3_dir), "--served-model-name", "m",
                                  "--lora", f"m={adapters['style']}"])
    assert "is the served model's name" in err
    err = one_line_error(capsys, ["serve", str(tiny_k3_dir), "--lora", f"a={adapters['style']}", "--lora",
                                  f"a={adapters['experts']}"])
    assert "'a' is given twice" in err
