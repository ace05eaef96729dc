"""The llama.cpp peer of `bench decode` / `bench prefill` without llama-cpp-python: llama-server
(peers/llamaserver.LlamaServerRunner) against a stand-in server speaking its /health and /completion protocol,
the choice between the two engines, the converter's flags for block-FP8 checkpoints, and the decode bytes of
DeepSeek-V3 checkpoints with block-FP8 and INT4 experts. Nothing here needs llama.cpp."""

from __future__ import annotations

import json
import sys

import pytest

from moeswap.bench import sidebyside as sbs
from moeswap.bench.peers import llamacpp, llamaserver
from moeswap.tiny import SIZES, write_tiny_model

# A stand-in llama-server: its argv as llamaserver.command writes it; /completion answers each prompt of the one
# request with tokens (the prompt's last id + 1, + 2, ...) and timings that depend on the prompt's position.
FAKE = r'''
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

argv = sys.argv[1:]
if "--version" in argv:
    print("version: 7 (fake)", file=sys.stderr)
    sys.exit(0)
if os.environ.get("FAKE_NEEDS_NO_REPACK") and "--no-repack" not in argv:
    sys.exit(132)  # as the build that dies loading weights into AMX buffers
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps(argv) + "\n")

class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _send(self, obj):
        data = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send({"status": "ok"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with open(os.environ["FAKE_LOG"], "a") as f:
            f.write(json.dumps(body) + "\n")
        n = body["n_predict"]
        outs = [{"index": i, "tokens": [p[-1] + k + 1 for k in range(n)],
                 "timings": {"prompt_ms": 10.0 * len(p), "predicted_ms": 100.0 + i, "predicted_n": n}}
                for i, p in enumerate(body["prompt"])]
        self._send(outs if len(outs) > 1 else outs[0])

HTTPServer(("127.0.0.1", int(argv[argv.index("--port") + 1])), H).serve_forever()
'''


@pytest.fixture
def fake_server(tmp_path, monkeypatch):
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!{sys.executable}\n{FAKE}")
    binary.chmod(0o755)
    log = tmp_path / "log.jsonl"
    monkeypatch.setenv("FAKE_LOG", str(log))
    return binary, log


@pytest.mark.parametrize("needs_no_repack", [False, True])
def test_runner_speaks_the_server_protocol(fake_server, monkeypatch, needs_no_repack):
    binary, log = fake_server
    if needs_no_repack:
        monkeypatch.setenv("FAKE_NEEDS_NO_REPACK", "1")
    runner = llamaserver.LlamaServerRunner("m.gguf", threads=2, max_seqs=4, max_len=300, binary=str(binary),
                                           start_timeout_s=60)
    try:
        out = runner.generate([[5, 6, 7], [9] * 20, [1]], 6)
        with pytest.raises(ValueError, match="5 prompts but the server was started with 4 slots"):
            runner.generate([[1]] * 5, 2)
    finally:
        runner.close()
    assert runner.name == "llama.cpp (llama-server, version: 7 (fake)" + (", --no-repack)" if needs_no_repack else ")")
    # each sequence's own tokens in prompt order; the longest prompt and generation times; n - 1 decode steps
    assert out["tokens"] == [[8, 9, 10, 11, 12, 13], [10, 11, 12, 13, 14, 15], [2, 3, 4, 5, 6, 7]]
    assert out["ttft_s"] == pytest.approx(0.2) and out["decode_s"] == pytest.approx(0.102) and out["decoded"] == 5
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    argv, body = lines[0], lines[1]
    assert argv[argv.index("-m") + 1] == "m.gguf" and argv[argv.index("-np") + 1] == "4"
    assert ("--no-repack" in argv) == needs_no_repack
    # all prompts in one request (prefilled together, decoded in step), greedy, nothing cached, EOS ignored
    assert body == {"prompt": [[5, 6, 7], [9] * 20, [1]], "n_predict": 6, "temperature": 0, "ignore_eos": True,
                    "cache_prompt": False, "return_tokens": True, "stream": False}


def test_llama_cpp_peer_falls_back_to_llama_server(monkeypatch, tmp_path):
    setup = sbs.Setup("m", threads=1)
    monkeypatch.setattr(llamacpp, "available", lambda: (False, "llama-cpp-python is not installed"))
    monkeypatch.setattr(llamacpp, "converter_dir", lambda: tmp_path)
    monkeypatch.setattr(llamaserver, "find", lambda explicit=None: (str(tmp_path / "llama-server"), ""))
    kind, why = sbs.llama_engine(setup)
    assert kind is None and "converter is not in" in why
    (tmp_path / "convert_hf_to_gguf.py").write_text("")
    assert sbs.llama_engine(setup) == ("llama-server", "")
    monkeypatch.setattr(llamaserver, "find", lambda explicit=None: (None, "llama-server is not on PATH"))
    assert sbs.llama_engine(setup) == (None, "llama-cpp-python is not installed; llama-server is not on PATH")
    monkeypatch.setattr(llamacpp, "available", lambda: (True, ""))
    assert sbs.llama_engine(setup) == ("llama.cpp", "")


@pytest.fixture(scope="module")
def tiny_dsv3(tmp_path_factory):
    out = {}
    for quant in ("fp8", "int4"):
        path = tmp_path_factory.mktemp(f"dsv3-{quant}") / "m"
        write_tiny_model(path, arch="deepseek_v3", size="tiny", quant=quant)
        out[quant] = path
    return out


def test_block_fp8_checkpoints_convert_to_q8_0(tiny_dsv3, tiny_k3_dir):
    assert llamacpp.converter_flags(tiny_dsv3["fp8"]) == ["--fp8-as-q8"]
    assert llamacpp.converter_flags(tiny_dsv3["int4"]) == []  # dequantised by the converter (--outtype)
    assert llamacpp.converter_flags(tiny_k3_dir) == []  # MXFP4 experts stay MXFP4


@pytest.mark.parametrize("quant", ["fp8", "int4"])
def test_decode_bytes_of_deepseek_v3_experts(tiny_dsv3, quant):
    s = SIZES["tiny"]
    b = sbs.decode_bytes(str(tiny_dsv3[quant]))
    moe_layers, k, e = s["layers"] - 1, s["top_k"], s["experts"]  # the first layer is dense
    weights = 3 * s["hidden"] * s["expert_dim"]  # gate, up [F, D] and down [D, F]
    assert b["moe_layers"] == moe_layers and b["num_experts"] == e and b["top_k"] == k
    # fp8: a byte a weight and one fp32 scale per 128 x 128 block (one each here); int4: half a byte a weight,
    # a bf16 scale per 32, and each matrix's int32 [2] weight_shape
    per_expert = weights + 3 * 4 if quant == "fp8" else weights / 2 + 2 * weights / 32 + 3 * 8
    assert b["expert_bytes"] == pytest.approx(per_expert)
    assert b["active_params"] == pytest.approx(b["dense_params"] + k * moe_layers * weights)
