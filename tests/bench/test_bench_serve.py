"""`moeswap bench serve`: against servers it launches over the tiny K3 (with the batch-1 peer; llama-server
absent and skipped), and against a running one by --url with Poisson arrivals: the counts add up, the
percentiles are ordered, throughput is tokens over the measured time, greedy answers equal `generate`'s,
the JSON is strict. Also the pieces: lengths, percentiles (against numpy), the greedy check's negative
case, finding llama-server, flag errors."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from live_server import serve_in_thread
from moeswap.bench.peers import llamaserver
from moeswap.bench.serve import client, greedy, stats, workload
from moeswap.cli import main
from moeswap.options import LoadOptions

N, PROMPT, OUT = 6, (4, 12), 8


def _invariants(report: dict, name: str, row: dict, pool: list[int] | None) -> None:
    r = row["results"][name]
    ok = [q for q in r["requests"] if q["ok"]]
    assert r["sent"] == N and r["completed"] + r["failed"] == r["sent"] and r["failed"] == 0, r["first_errors"]
    # ignore_eos: every answer is max_tokens long; the totals are the sums of the requests'
    assert all(q["output_tokens"] == q["max_tokens"] == OUT for q in ok)
    assert r["total_output_tokens"] == sum(q["output_tokens"] for q in ok) == N * OUT
    assert r["total_prompt_tokens"] == sum(q["prompt_tokens"] for q in ok)
    if pool is not None:  # token-id prompts: the server counted exactly the ids the workload drew
        prompts = workload.Prompts(workload.Workload(workload.Lengths(*PROMPT), workload.Lengths(OUT, OUT), N, None, 0), pool)
        assert [q["prompt_tokens"] for q in r["requests"]] == [len(prompts.spec(q["index"]).ids) for q in r["requests"]]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        p = r[key]
        assert 0 <= p["p50"] <= p["p90"] <= p["p99"], (key, p)
    assert all(0 < q["ttft_ms"] <= q["e2e_ms"] for q in ok)
    # the measured time runs from the first send to the last answer
    assert r["duration_s"] * 1e3 >= max(q["start_ms"] + q["e2e_ms"] for q in ok) - 1e-6
    assert r["output_throughput"] == pytest.approx(r["total_output_tokens"] / r["duration_s"], rel=1e-12)
    assert r["request_throughput"] == pytest.approx(r["completed"] / r["duration_s"], rel=1e-12)
    assert 0 < r["client_cpu_s"] and r["load_average_end"] >= 0


@pytest.mark.slow
def test_launched_server_and_batch1_peer(tiny_k3_dir, tmp_path, capsys, strict_json):
    out = tmp_path / "r.json"
    code = main(["bench", "serve", "--launch", str(tiny_k3_dir), "--concurrency", "1,2", "--num-requests", str(N),
                 "--prompt-tokens", f"{PROMPT[0]}:{PROMPT[1]}", "--output-tokens", str(OUT), "--threads", "1",
                 "--max-batch", "2", "--llama-server", str(tmp_path / "absent"), "--check-greedy", "3",
                 "--out-dir", "", "--json", str(out), "--markdown", str(tmp_path / "r.md")])
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    report = strict_json(out.read_text())
    assert list(report["servers"]) == ["moeswap", "moeswap-batch1"]
    assert report["skipped"]["llama-server"].endswith("is not an executable file")
    assert "llama-server: SKIPPED" in (tmp_path / "r.md").read_text()
    pool = workload.vocabulary(str(tiny_k3_dir))
    assert [row["concurrency"] for row in report["rows"]] == [1, 2]
    for row in report["rows"]:
        for name in ("moeswap", "moeswap-batch1"):
            _invariants(report, name, row, pool)
        ours, peer = row["results"]["moeswap"], row["results"]["moeswap-batch1"]
        assert row["ratios"]["moeswap-batch1"]["output_throughput"] == pytest.approx(
            ours["output_throughput"] / peer["output_throughput"])
        assert row["ratios"]["moeswap-batch1"]["p99_ttft"] == pytest.approx(
            ours["ttft_ms"]["p99"] / peer["ttft_ms"]["p99"])
    assert "--max-batch 1" in report["servers"]["moeswap-batch1"]["command"]
    for name in ("moeswap", "moeswap-batch1"):
        rss = report["rss"][name]
        assert 0 < rss["loaded_bytes"] and 0 < rss["after_warmup_bytes"] <= rss["peak_after_warmup_bytes"]
        assert rss["end_bytes"] <= rss["peak_after_warmup_bytes"] <= rss["peak_bytes"]
        assert rss["growth_after_warmup_bytes"] == rss["end_bytes"] - rss["after_warmup_bytes"]
    g = report["greedy_check"]
    assert g == {"checked": 6, "equal": 6, "mismatches": [], "ok": True}
    assert (tmp_path / "r.png").stat().st_size > 0  # two concurrency levels: the latency-vs-throughput plot
    assert "greedy check: 6 of 6 greedy responses equal" in stdout


def _serve_in_thread(model_dir):
    """A moeswap server in this process (uvicorn in a thread, on a free loopback port); returns (url, stop)."""
    from moeswap.models.loader import load_model
    from moeswap.server.app import build_app
    from moeswap.server.options import ServeOptions
    from moeswap.text.tokenizer import load_tokenizer

    model, store = load_model(model_dir)
    app = build_app(model, load_tokenizer(model_dir), ServeOptions(model_name="tiny", max_batch=4), store)
    url, stop_server = serve_in_thread(app)

    def stop():
        stop_server()
        store.close()

    return url, stop


@pytest.mark.slow
def test_url_with_poisson_arrivals(tiny_k3_dir, tmp_path, capsys, strict_json):
    url, stop = _serve_in_thread(tiny_k3_dir)
    try:
        out = tmp_path / "r.json"
        code = main(["bench", "serve", "--url", url, "--model-dir", str(tiny_k3_dir), "--request-rate", "40",
                     "--num-requests", str(N), "--prompt-tokens", f"{PROMPT[0]}:{PROMPT[1]}", "--output-tokens",
                     str(OUT), "--check-greedy", "2", "--server-pid", str(os.getpid()), "--out-dir", "",
                     "--json", str(out)])
        assert code == 0, capsys.readouterr().out
    finally:
        stop()
    report = strict_json(out.read_text())
    assert report["servers"][url]["kind"] == "moeswap" and report["skipped"] == {}  # no peers by default with --url
    (row,) = report["rows"]
    assert row["request_rate"] == 40 and row["ratios"] == {}
    _invariants(report, url, row, workload.vocabulary(str(tiny_k3_dir)))
    assert report["rss"][url]["pid"] == os.getpid() and report["rss"][url]["end_bytes"] > 0
    assert report["greedy_check"]["ok"] and report["greedy_check"]["checked"] == 2


def test_greedy_check_finds_a_wrong_token(tiny_k3_dir):
    """The check is not a rubber stamp: the right tokens pass, one changed token is found where it is."""
    from moeswap.engine.generate import GenerationConfig, generate
    from moeswap.models.loader import load_model

    prompt = [5, 17, 33, 2, 99]
    model, store = load_model(tiny_k3_dir)
    try:
        right = generate(model, prompt, GenerationConfig(max_tokens=6, stop_ids=())).tokens
    finally:
        store.close()
    wrong = list(right)
    wrong[3] = (wrong[3] + 1) % 100
    good = client.Outcome(0, 6, ok=True, token_ids=right, prompt=prompt)
    bad = client.Outcome(1, 6, ok=True, token_ids=wrong, prompt=prompt)
    g = greedy.check_greedy(str(tiny_k3_dir), LoadOptions(), {"a": [[good]], "b": [[bad]]}, 4)
    assert g["checked"] == 2 and g["equal"] == 1 and not g["ok"]
    assert g["mismatches"] == [{"target": "b", "request": 1, "first_difference": 3, "server_tokens": 6,
                                "generate_tokens": 6}]


def test_percentiles_are_numpy_linear():
    xs = [0.3, 0.01, 0.2, 0.05, 0.7, 0.11, 0.02]
    p = stats.percentiles(xs)
    for k, q in (("p50", 50), ("p90", 90), ("p99", 99)):
        assert p[k] == pytest.approx(np.percentile(xs, q) * 1e3)
    assert p["mean"] == pytest.approx(np.mean(xs) * 1e3)
    assert stats.percentiles([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_summary_of_failures_and_an_empty_run():
    ok = client.Outcome(0, 4, start_s=0.0, end_s=0.5, ok=True, ttft_s=0.1, e2e_s=0.5, output_tokens=4)
    failed = [client.Outcome(i, 4, end_s=0.2, error="HTTP 429: busy") for i in (1, 2)]
    s = stats.summarize([ok, *failed], 0.5)
    assert (s["sent"], s["completed"], s["failed"], s["first_errors"]) == (3, 1, 2, ["HTTP 429: busy"])
    assert s["output_throughput"] == 8.0 and s["tpot_ms"]["p50"] == pytest.approx(400 / 3)
    empty = stats.summarize([], 0.0)
    assert empty["request_throughput"] is None and empty["ttft_ms"]["p99"] is None


def test_lengths_and_prompts_are_reproducible():
    assert workload.Lengths.parse("128", "--x") == workload.Lengths(128, 128)
    assert workload.Lengths.parse("4:9", "--x") == workload.Lengths(4, 9)
    for bad in ("0", "9:4", "a", "1:2:3"):
        with pytest.raises(ValueError, match="--x"):
            workload.Lengths.parse(bad, "--x")
    w = workload.Workload(workload.Lengths(4, 9), workload.Lengths(2, 3), 8, None, 2, seed=7)
    a, b = workload.Prompts(w, list(range(10, 50))), workload.Prompts(w, list(range(10, 50)))
    specs = [a.spec(i) for i in range(8)]
    assert specs == [b.spec(i) for i in range(8)]  # every target gets the same requests
    assert all(4 <= len(s.ids) <= 9 and 2 <= s.max_tokens <= 3 and set(s.ids) <= set(range(10, 50)) for s in specs)
    assert all(len(s.text.split()) == len(s.ids) for s in specs)
    assert a.spec(0, "warmup") != specs[0]


def test_llama_server_is_found_or_skipped_with_a_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    built = tmp_path / "bin" / "llama-server"
    monkeypatch.setattr(llamaserver, "peers_bin", lambda: built)
    path, why = llamaserver.find()
    assert path is None and "scripts/setup-peers.sh" in why
    built.parent.mkdir()
    built.write_text(f"#!{sys.executable}\nimport sys\nprint('version: 1 (abc)', file=sys.stderr)\n")
    built.chmod(0o755)
    assert llamaserver.find() == (str(built), "")
    assert llamaserver.version(str(built)) == "version: 1 (abc)"
    cmd = llamaserver.command(str(built), "m.gguf", 8080, 2, 8, 300)
    assert cmd[cmd.index("-np") + 1] == "8" and cmd[cmd.index("-c") + 1] == str(8 * 512)  # slots of 512 >= 300
    assert cmd[cmd.index("-t") + 1] == cmd[cmd.index("-tb") + 1] == "2"


@pytest.mark.parametrize("flags,message", [
    (["--launch", "M", "--concurrency", "0"], "--concurrency '0': expected positive integers"),
    (["--url", "http://x", "--request-rate", "0"], "--request-rate '0': expected positive rates"),
    (["--url", "http://x", "--prompt-tokens", "9:4"], "--prompt-tokens '9:4': expected 1 <= LO <= HI"),
    (["--url", "http://x", "--check-greedy"], "--check-greedy needs the checkpoint"),
    (["--url", "http://x", "--peers", "vllm"], "--peers: unknown peer 'vllm'"),
    (["--url", "x:80"], "--url 'x:80': expected http://HOST:PORT"),
    (["--url", "http://x", "--duration", "-1"], "--duration must be a positive number of seconds"),
    (["--launch", "no-such-dir"], "no-such-dir: no config.json"),
])
def test_bad_flags_are_one_line_errors(capsys, flags, message):
    assert main(["bench", "serve", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
