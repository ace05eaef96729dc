"""`moeswap serve` under expert parallelism: 2 ranks started as torchrun would, rank 0 serving HTTP. In the
replicated mode rank 1 steps a copy of rank 0's scheduler in lockstep; in the data-parallel mode (the
default) rank 0 gives each request to one rank and gathers every rank's tokens each step. Completions
(greedy, seeded sampling, two at once) equal a single-process server's; SIGTERM to rank 0 stops both
cleanly; a rank that dies stops the server with an error naming it. The data-parallel schedulers are also
driven directly, without HTTP, so that which rank runs which request is known (test_data_parallel_serve)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from live_server import serve_in_thread
from moeswap.distributed.launch import free_port, rank_env
from moeswap.models.loader import LoadOptions, load_model
from moeswap.server.app import build_app
from moeswap.server.options import ServeOptions
from moeswap.text.tokenizer import load_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

SRC = Path(__file__).resolve().parents[2] / "src"
BODIES = [{"prompt": "hello world", "max_tokens": 8, "temperature": 0},
          {"prompt": "the quick brown fox", "max_tokens": 8, "temperature": 0.9, "seed": 7},
          {"prompt": "one two three", "max_tokens": 6, "temperature": 0}]


def post(url: str, body: dict, timeout: float = 60) -> dict:
    req = urllib.request.Request(url + "/v1/completions", json.dumps({"model": "m", **body}).encode(),
                                 {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return json.loads(err.read())


def completions(url: str) -> list:
    """BODIES[0] alone, then BODIES[1] and [2] at once (they share decode steps)."""
    out = [post(url, BODIES[0])]
    both: list = [None, None]
    threads = [threading.Thread(target=lambda i=i: both.__setitem__(i, post(url, BODIES[1 + i]))) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [c["choices"][0]["text"] for c in out + both]


def start_ranks(model_dir, port: int, mode: str = "data-parallel") -> list[subprocess.Popen]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC)}
    mport = free_port()
    return [subprocess.Popen([sys.executable, "-m", "moeswap", "serve", str(model_dir), "--port", str(port),
                              "--served-model-name", "m", "--log-level", "warning", "--ep-timeout", "30",
                              "--ep-mode", mode],
                             env={**env, **rank_env(r, 2, mport)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for r in range(2)]


def wait_ready(url: str, procs, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), [p.communicate()[1].decode()[-2000:] for p in procs]
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise AssertionError("the expert-parallel server did not start")


def finish(procs, timeout: float = 60) -> list:
    out = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        out.append((p.returncode, err.decode(errors="replace")))
    return out


@pytest.mark.parametrize("mode", ["replicated", "data-parallel"])
def test_two_rank_server_answers_as_one_process_and_stops_cleanly(tiny_k3_dir, mode):
    model, store = load_model(tiny_k3_dir, LoadOptions(dtype="float32"))
    app = build_app(model, load_tokenizer(tiny_k3_dir), ServeOptions(model_name="m"), store)
    url, stop = serve_in_thread(app)
    try:
        expected = completions(url)
    finally:
        stop()
        store.close()
    port = free_port()
    procs = start_ranks(tiny_k3_dir, port, mode)
    try:
        wait_ready(f"http://127.0.0.1:{port}", procs)
        assert completions(f"http://127.0.0.1:{port}") == expected
        procs[0].send_signal(signal.SIGTERM)  # uvicorn's graceful stop; rank 0 then tells rank 1 to leave
        (code0, err0), (code1, err1) = finish(procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert (code0, code1) == (0, 0), (err0[-2000:], err1[-2000:])


@pytest.mark.parametrize("mode", ["replicated", "data-parallel"])
def test_a_rank_lost_under_serve_stops_the_server_naming_it(tiny_k3_dir, mode):
    port = free_port()
    procs = start_ranks(tiny_k3_dir, port, mode)
    try:
        wait_ready(f"http://127.0.0.1:{port}", procs)
        procs[1].kill()
        procs[1].wait()
        try:
            answer = post(f"http://127.0.0.1:{port}", BODIES[0])
        except (urllib.error.URLError, ConnectionError) as err:  # rank 0 saw the loss first and had stopped
            answer = {"error": f"no server: {err}"}
        (code0, err0), _ = finish(procs[:1]) + [(None, "")]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert "error" in json.dumps(answer), answer
    lines = [l for l in err0.splitlines() if l.startswith("moeswap: error:")]
    assert code0 == 1 and lines and "rank 1 has stopped" in lines[-1], err0[-3000:]


def test_data_parallel_serve_spreads_requests_and_gathers_one_process_tokens(tiny_k3_dir, tmp_path):
    """Three requests submitted at once go to ranks 0, 1, 0 (each to the rank with the fewest unfinished);
    rank 0's step returns every rank's tokens and results, and they equal one Scheduler running all three
    in one process. Rank 1 ran its request's tokens through its own forward passes."""
    from distributed.ep_worker import SERVE_PROMPTS, serve_requests
    from distributed.test_expert_parallel import launch
    from moeswap.engine.scheduler import EngineConfig, Scheduler

    model, store = load_model(tiny_k3_dir, LoadOptions(dtype="float32"))
    try:
        want = {r.id: r.tokens for r in Scheduler(model, EngineConfig(max_batch=4, max_len=256)).run(serve_requests())}
    finally:
        store.close()
    results, codes, _ = launch({"model": str(tiny_k3_dir), "dp_serve": True}, tmp_path)
    assert codes == [0, 0], [r.get("error") for r in results]
    lead = results[0]
    assert lead["ranks"] == [0, 1, 0]
    assert lead["tokens"] == want
    assert {i: f[1] for i, f in lead["finish"].items()} == want
    assert all(f[0] == "length" for f in lead["finish"].values()) and len(want) == len(SERVE_PROMPTS)
    # rank 1's own tokens went through the exchanges (prefill and decode), and it served rank 0's
    d1 = results[1]["dispatch"]
    assert d1["tokens_through_moe_layers"] > 0 and d1["pairs_computed"] > 0
    assert results[0]["dispatch"]["exchanges"] == d1["exchanges"]
