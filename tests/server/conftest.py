"""A live `moeswap serve` app on loopback: uvicorn on a free port of 127.0.0.1 in a background thread, over
the tiny K3 (tests/conftest.py), with the official `openai` client pointed at it.

`start_server(**ServeOptions fields)` -> a running server; each is stopped when its module ends;
`run_app(app)` serves any app the same way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest

import openai

from live_server import serve_in_thread
from moeswap.engine.tokenizer import load_tokenizer
from moeswap.models.loader import load_model
from moeswap.server.app import build_app
from moeswap.server.options import ServeOptions

MODEL = "tiny-k3"


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
    """start_server(**ServeOptions fields) -> a LiveServer over the tiny K3."""

    def start(**options) -> LiveServer:
        model, tok, store = tiny_model
        app = build_app(model, tok, ServeOptions(model_name=MODEL, **options), store)
        return LiveServer(run_app(app), app, model, tok)

    return start
