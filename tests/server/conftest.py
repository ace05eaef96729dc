"""A live `moeswap serve` app on loopback: uvicorn on a free port of 127.0.0.1 in a background thread, over
the tiny K3 (tests/conftest.py), with the official `openai` client pointed at it.

`start_server(**ServeOptions fields)` -> a running server; each is stopped when its module ends;
`run_app(app)` serves any app the same way. For tool calls: `k3_tokenizer` and `k2_tokenizer` (the tiny
vocabulary with Kimi K3's and Kimi K2's published chat templates) and `ScriptedScheduler`, the engine's
scheduler told which tokens to choose.
"""

from __future__ import annotations

import shutil
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from live_server import serve_in_thread
from moeswap.config import load_config
from moeswap.engine.scheduler import Scheduler
from moeswap.models.loader import load_model
from moeswap.server.app import build_app
from moeswap.server.options import ServeOptions
from moeswap.text.tokenizer import load_tokenizer
from moeswap.text.tool_calls import KIMI_K2
from moeswap.tiny.tokenizer import build_tiny_tokenizer

MODEL = "tiny-k3"
DATA = Path(__file__).parent.parent / "data"


@dataclass
class LiveServer:
    url: str  # http://127.0.0.1:PORT
    app: object
    model: object
    tokenizer: object

    @property
    def name(self) -> str:
        return self.app.state.server.name

    @property
    def engine(self):
        return self.app.state.server.engine

    def finished(self, reason: str) -> float:
        """Requests that ended with `reason`, as /metrics counts them."""
        return self.app.state.server.metrics.requests_finished.labels(reason)._value.get()

    def settle(self, until=lambda: True, timeout: float = 10.0) -> bool:
        """Wait until no request runs or waits (an abort takes effect at the engine's next step) and `until()`."""
        deadline = time.monotonic() + timeout
        while self.engine.in_flight or self.engine.running or not until():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def say(self, tokens: list[int]) -> None:
        """The next request's answer is `tokens` (then the model's own): a server started with scripted=True."""
        self.engine.sched.scripts.append(list(tokens))

    def client(self, api_key: str = "unused", **kw) -> openai.OpenAI:
        # no retries: a 429 or 5xx must reach the test as it came
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=30, **kw)


@pytest.fixture(scope="module")
def tiny_model(tiny_k3_dir):
    model, store = load_model(tiny_k3_dir)
    yield model, load_tokenizer(tiny_k3_dir), store
    store.close()


@pytest.fixture(scope="module")
def run_app():
    """run_app(app) -> its URL: uvicorn serving `app` on a free port of 127.0.0.1 until the module ends."""
    stops = []

    def run(app) -> str:
        url, stop = serve_in_thread(app)
        stops.append(stop)
        return url

    yield run
    for stop in stops:
        stop()


@pytest.fixture(scope="module")
def start_server(tiny_model, run_app):
    """start_server(**ServeOptions fields) -> a LiveServer over the tiny K3; `tokenizer=` another tokenizer
    of its vocabulary, `scripted=True` a ScriptedScheduler (LiveServer.say)."""

    def start(tokenizer=None, scripted: bool = False, **options) -> LiveServer:
        model, tok, store = tiny_model
        options.setdefault("model_name", MODEL)
        app = build_app(model, tokenizer or tok, ServeOptions(**options), store,
                        scheduler=ScriptedScheduler if scripted else Scheduler)
        return LiveServer(run_app(app), app, model, tokenizer or tok)

    return start


class ScriptedScheduler(Scheduler):
    """The engine's scheduler with the model's choice of token replaced by a script, for answers a tiny
    random model would never give (tool calls). Everything else is the real engine: prefill, decode steps
    that read the scripted tokens as input, stop ids, max_tokens, aborts. `scripts`: token lists, one per
    request in the order they are submitted; past its script's end a request gets the model's own tokens."""

    def __init__(self, model, config) -> None:
        super().__init__(model, config)
        self.scripts: deque[list[int]] = deque()
        self._script: dict = {}

    def submit(self, req):
        rid = super().submit(req)
        if self.scripts:
            self._script[rid] = self.scripts.popleft()
        return rid

    def _sample(self, logits_BV, seqs, skip=frozenset()):
        tokens_B = super()._sample(logits_BV, seqs, skip)
        for i, seq in enumerate(seqs):
            script = self._script.get(seq.req.id, ())
            if len(seq.tokens) < len(script):
                tokens_B[i] = script[len(seq.tokens)]
        return tokens_B


@pytest.fixture(scope="session")
def k3_tokenizer_dir(tiny_k3_dir, tmp_path_factory) -> Path:
    """The tiny K3's tokenizer with Kimi K3's published chat template."""
    d = tmp_path_factory.mktemp("k3_tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(tiny_k3_dir / name, d / name)
    shutil.copy(DATA / "Kimi-K3.jinja", d / "chat_template.jinja")
    return d


@pytest.fixture(scope="session")
def k2_tokenizer_dir(tiny_k3_dir, tmp_path_factory) -> Path:
    """A tiny vocabulary of the tiny K3's size whose specials are Kimi K2's chat and tool-call tokens, with
    Kimi K2 Thinking's published chat template."""
    d = tmp_path_factory.mktemp("k2_tokenizer")
    vocab = load_config(tiny_k3_dir).vocab_size
    names = ("<|bos|>", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
             *KIMI_K2.specials)
    build_tiny_tokenizer(d, vocab, {s: vocab - len(names) + k for k, s in enumerate(names)})
    shutil.copy(DATA / "Kimi-K2-Thinking.jinja", d / "chat_template.jinja")
    return d


@pytest.fixture(scope="session")
def k3_tokenizer(k3_tokenizer_dir):
    return load_tokenizer(k3_tokenizer_dir)


@pytest.fixture(scope="session")
def k2_tokenizer(k2_tokenizer_dir):
    return load_tokenizer(k2_tokenizer_dir)
