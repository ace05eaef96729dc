"""`moeswap serve` as a command (flags refused before the model loads, one-line errors, a real process on
loopback), and a model whose logits are not finite: the request fails with a server error, the server serves on."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from safetensors import safe_open
from safetensors.torch import save_file

from moeswap.cli import main
from moeswap.formats.checkpoint import INDEX_NAME
from moeswap.models.loader import load_model
from moeswap.server.app import build_app
from moeswap.server.options import ServeOptions
from moeswap.text.tokenizer import load_tokenizer


@pytest.mark.parametrize("flags,message", [
    (("--max-batch", "0"), "--max-batch must be an integer >= 1, got 0"),
    (("--max-queue", "-1"), "--max-queue must be an integer >= 0, got -1"),
    (("--max-context", "0"), "--max-context must be an integer >= 1, got 0"),
    (("--port", "70000"), "--port must be in 0..65535, got 70000"),
    (("--api-key", ""), "--api-key is empty"),
    (("--max-context", str(1 << 21)), f"--max-context {1 << 21} is more than the model's max_position_embeddings"),
])
def test_bad_flags_are_one_line_errors(capsys, tiny_k3_dir, flags, message):
    code = main(["serve", str(tiny_k3_dir), *flags])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("moeswap: error: ") and message in err, err


def test_non_finite_logits_are_a_server_error(tiny_k3_dir, tmp_path, run_app):
    model_dir = Path(shutil.copytree(tiny_k3_dir, tmp_path / "nan"))
    name = "language_model.model.layers.2.self_attn.o_proj.weight"
    shard = model_dir / json.loads((model_dir / INDEX_NAME).read_text())["weight_map"][name]
    with safe_open(str(shard), framework="pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    tensors[name][0, 0] = float("nan")
    save_file(tensors, str(shard), metadata=metadata)
    model, store = load_model(model_dir)
    app = build_app(model, load_tokenizer(model_dir), ServeOptions(model_name="nan"), store)
    url = run_app(app)
    client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
    for stream in (False, True):
        with pytest.raises(openai.APIError, match="NaN or infinite logits"):
            list(client.completions.create(model="nan", prompt="hello", max_tokens=4, stream=stream))
    assert httpx.get(url + "/health").status_code == 200 and app.state.server.engine.in_flight == 0
    store.close()


@pytest.mark.slow
def test_a_port_in_use_is_said_before_the_model_loads(capsys, tiny_k3_dir, monkeypatch):
    import socket

    import moeswap.models.loader as loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["serve", str(tiny_k3_dir), "--port", str(port)])
    err = capsys.readouterr().err
    assert code == 2 and err == (f"moeswap: error: --port {port}: 127.0.0.1:{port} is already in use (another "
                                 f"server?); choose another --port or stop what holds it\n"), err


def test_serve_process(tiny_k3_dir):
    """The command itself: loopback by default, the key required, Ctrl-C ends it cleanly."""
    proc = subprocess.Popen([sys.executable, "-m", "moeswap", "serve", str(tiny_k3_dir), "--port", "0",
                             "--api-key", "k", "--max-batch", "2"], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline, url, seen = time.monotonic() + 120, None, []
        while url is None:
            assert time.monotonic() < deadline and proc.poll() is None, "".join(seen)
            line = proc.stderr.readline()
            seen.append(line)
            m = re.search(r"^moeswap: serving .* on (http://127\.0\.0\.1:\d+)/v1", line)  # the bound port
            url = m and m.group(1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        r = client.completions.create(model=str(tiny_k3_dir), prompt="hello", max_tokens=3, temperature=0)
        assert r.usage.completion_tokens >= 1
        # served as the directory's name (the path as given is accepted too), as clients name models
        assert [m.id for m in client.models.list()] == [tiny_k3_dir.name] == [r.model]
        assert client.completions.create(model=tiny_k3_dir.name, prompt="hi", max_tokens=1).usage.completion_tokens
        assert httpx.get(url + "/v1/models").status_code == 401
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
