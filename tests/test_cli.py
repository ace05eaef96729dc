"""The `moeswap` command: init-tiny, generate, inspect, and user errors as one line without a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors import safe_open

from moeswap.cli import main
from moeswap.config import ConfigError
from moeswap.experts.trace import read_trace
from moeswap.formats.checkpoint import INDEX_NAME
from moeswap.models.loader import LoadOptions, load_model
from moeswap.text.tokenizer import load_tokenizer
from moeswap.units import parse_bytes

PROMPT = "the quick brown fox"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def generate_json(capsys, strict_json):
    """generate_json(model, *flags) -> the one object `generate --json` prints, parsed as strict JSON."""

    def generate(model: Path, *flags: str) -> dict:
        code, out, err = run(capsys, "generate", str(model), "--prompt", PROMPT, "--json", *flags)
        assert code == 0, err
        lines = out.strip().splitlines()
        assert len(lines) == 1, out  # --json prints one object and nothing else
        return strict_json(lines[0])

    return generate


def assert_one_line_error(code: int, err: str, *fragments: str) -> None:
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("moeswap: error: "), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"


# -- init-tiny + generate --------------------------------------------------------------------------


def test_init_tiny_then_generate(capsys, tmp_path, tiny_k3_dir, generate_json, greedy_oracle):
    out_dir = tmp_path / "m"
    code, out, _ = run(capsys, "init-tiny", str(out_dir), "--arch", "kimi_k3", "--size", "tiny", "--seed", "0")
    assert code == 0
    assert out.startswith(f"wrote kimi_k3 (tiny, seed 0) to {out_dir} in ")
    assert (out_dir / "model-00001-of-00003.safetensors").read_bytes() == \
        (tiny_k3_dir / "model-00001-of-00003.safetensors").read_bytes()

    t0 = time.perf_counter()
    first = generate_json(out_dir, "--max-tokens", "5", "--ignore-eos")
    wall = time.perf_counter() - t0
    assert len(first["tokens"]) == first["completion_tokens"] == 5 and first["finish_reason"] == "length"
    tok = load_tokenizer(out_dir)
    ids = tok.encode(PROMPT, add_bos=False)
    model, _ = load_model(out_dir, LoadOptions())
    assert first["prompt_tokens"] == len(ids)
    assert first["tokens"] == greedy_oracle(model, ids, 5) and first["text"] == tok.decode(first["tokens"])
    # the reported times lie inside the call: loading, the first token, then 4 decode steps
    assert 0 < first["load_s"] + first["ttft_ms"] / 1e3 + 4 / first["decode_tokens_per_s"] <= wall
    assert first["native_decode_steps"] == 4


def test_generate_json_counts_each_expert_use(generate_json, tiny_k3_dir, tmp_path, capsys):
    """The store's books against a routing trace of the same run (`moeswap trace`, same prompt and
    tokens): every expert use is a hit or a miss; with every expert fitting, each distinct expert is
    read from disk once (a miss) and then hits."""
    got = generate_json(tiny_k3_dir, "--max-tokens", "5", "--ignore-eos")["expert_store"]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(PROMPT + "\n")
    assert main(["trace", str(tiny_k3_dir), "--prompts", str(prompts), "-o", str(tmp_path / "t.bin"),
                 "--max-tokens", "5", "--ignore-eos"]) == 0
    capsys.readouterr()
    trace = read_trace(tmp_path / "t.bin")
    assert got["hits"] + got["misses"] == len(trace.experts)
    assert got["misses"] == got["disk_reads"] == len(set(trace.accesses()))
    assert got["bytes_read"] == got["disk_reads"] * trace.meta["expert_stored_bytes"]
    assert got["hit_rate"] == pytest.approx(got["hits"] / len(trace.experts))
    assert got["tiers"]["fast"]["evictions"] == 0
    assert got["prefetch"]["precision"] is None and got["prefetch"]["recall"] is None  # no prefetch: undefined


def test_init_tiny_refuses_a_non_empty_directory(capsys, tmp_path):
    (tmp_path / "keep.txt").write_text("x")
    code, _, err = run(capsys, "init-tiny", str(tmp_path))
    assert_one_line_error(code, err, str(tmp_path), "exists and is not empty")
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_sampling_is_seeded(generate_json, tiny_k3_dir):
    flags = ("--max-tokens", "6", "--ignore-eos", "--temperature", "1.5")
    a = generate_json(tiny_k3_dir, *flags, "--seed", "1")
    b = generate_json(tiny_k3_dir, *flags, "--seed", "1")
    c = generate_json(tiny_k3_dir, *flags, "--seed", "2")
    assert a["tokens"] == b["tokens"]
    assert c["tokens"] != a["tokens"]  # the seed is used (fixed model, fixed seeds: not flaky)


def test_penalty_flags_are_the_engines(generate_json, tiny_k3_dir, capsys):
    from moeswap.engine.generate import GenerationConfig, generate
    from moeswap.engine.sampling import SamplingParams
    from moeswap.models.loader import load_model

    flags = ("--max-tokens", "12", "--ignore-eos", "--presence-penalty", "0.5", "--frequency-penalty", "1.5",
             "--repetition-penalty", "1.3")
    got = generate_json(tiny_k3_dir, *flags)["tokens"]
    model, store = load_model(tiny_k3_dir)
    try:
        ids = load_tokenizer(tiny_k3_dir).encode(PROMPT)
        sampling = SamplingParams(presence_penalty=0.5, frequency_penalty=1.5, repetition_penalty=1.3)
        want = generate(model, ids, GenerationConfig(max_tokens=12, stop_ids=(), sampling=sampling)).tokens
        plain = generate(model, ids, GenerationConfig(max_tokens=12, stop_ids=())).tokens
    finally:
        store.close()
    assert got == want != plain
    code, _, err = run(capsys, "generate", str(tiny_k3_dir), "--prompt", PROMPT, "--frequency-penalty", "3")
    assert_one_line_error(code, err, "frequency_penalty", "[-2, 2]")


def test_ignore_eos(generate_json, tiny_k3_dir, copy_model):
    """Make the greedy continuation's 2nd token an eos id: generation stops there, unless --ignore-eos."""
    greedy = generate_json(tiny_k3_dir, "--max-tokens", "6", "--ignore-eos")["tokens"]
    assert len(greedy) == 6
    stop_at = greedy[1]
    model = copy_model(tiny_k3_dir)
    gen_cfg = json.loads((model / "generation_config.json").read_text())
    eos = gen_cfg["eos_token_id"]
    gen_cfg["eos_token_id"] = [*(eos if isinstance(eos, list) else [eos]), stop_at]
    (model / "generation_config.json").write_text(json.dumps(gen_cfg))

    stopped = generate_json(model, "--max-tokens", "6")
    assert stopped["tokens"] == greedy[: greedy.index(stop_at) + 1]
    assert stopped["finish_reason"] == "stop"
    ignored = generate_json(model, "--max-tokens", "6", "--ignore-eos")
    assert ignored["tokens"] == greedy and ignored["finish_reason"] == "length"
    assert ignored["completion_tokens"] == 6


def test_stop_strings_end_the_text_and_the_sequence(generate_json, tiny_k3_dir, capsys):
    """--stop TEXT: the text ends before TEXT's first appearance, finish "stop", and no token is generated past
    the one that completed it; streamed text is the same; with several prompts each ends at its own."""
    full = generate_json(tiny_k3_dir, "--max-tokens", "24", "--ignore-eos")
    tok = load_tokenizer(tiny_k3_dir)
    text = full["text"]
    stop = next(text[i:i + 3] for i in range(4, len(text) - 3) if text[i:i + 3].strip() and "\ufffd" not in
                text[:i + 3])  # a piece from the middle whose text before it is whole characters
    cut = text.index(stop)
    stopped = generate_json(tiny_k3_dir, "--max-tokens", "24", "--ignore-eos", "--stop", stop, "--stop", "\x00never")
    assert (stopped["text"], stopped["finish_reason"]) == (text[:cut], "stop")
    # the sequence ended at the token whose text completed the stop string
    n = next(k for k in range(1, 25) if stop in tok.decode(full["tokens"][:k]))
    assert stopped["tokens"] == full["tokens"][:n]
    code, out, err = run(capsys, "generate", str(tiny_k3_dir), "--prompt", PROMPT, "--max-tokens", "24",
                         "--ignore-eos", "--stop", stop)
    assert code == 0 and out == PROMPT + text[:cut] + "\n" and "finish: stop" in err
    code, out, err = run(capsys, "generate", str(tiny_k3_dir), "--prompt", PROMPT, "--prompt", PROMPT, "--json",
                         "--max-tokens", "24", "--ignore-eos", "--stop", stop)
    many = json.loads(out)["outputs"]
    assert [(o["text"], o["finish_reason"], o["tokens"]) for o in many] == [(text[:cut], "stop", stopped["tokens"])] * 2
    code, _, err = run(capsys, "generate", str(tiny_k3_dir), "--prompt", PROMPT, "--stop", "")
    assert_one_line_error(code, err, "--stop")


def test_generate_streams_text(capsys, tiny_k3_dir):
    code, out, err = run(capsys, "generate", str(tiny_k3_dir), "--prompt", PROMPT, "--max-tokens", "3",
                         "--ignore-eos", "--stats")
    assert code == 0
    assert out.startswith(PROMPT)
    assert "[3 tokens, finish: length" in err and "misses" in err


def test_generate_reads_the_prompt_from_stdin_with_a_dash(tiny_k3_dir, tmp_path):
    """`--prompt -` is the prompt piped in (it was the text "-"), the same tokens as the prompt given inline."""
    import json
    import subprocess
    import sys

    def tokens(prompt: str, stdin: bytes | None) -> list[int]:
        done = subprocess.run([sys.executable, "-m", "moeswap", "generate", str(tiny_k3_dir), "--prompt", prompt,
                               "--max-tokens", "3", "--ignore-eos", "--json"], input=stdin, capture_output=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr.decode()[-2000:]
        return json.loads(done.stdout)["tokens"]

    assert tokens("-", PROMPT.encode()) == tokens(PROMPT, None)
    done = subprocess.run([sys.executable, "-m", "moeswap", "generate", str(tiny_k3_dir), "--prompt", "-"],
                          input=b"caf\xe9", capture_output=True, timeout=120)
    assert done.returncode == 2 and done.stderr.decode().strip() == (
        "moeswap: error: --prompt -: standard input is not UTF-8 text (byte 0xe9 at offset 3)")


def test_generate_reference_step_gives_the_native_steps_tokens(generate_json, tiny_k3_dir):
    native = generate_json(tiny_k3_dir, "--max-tokens", "6", "--ignore-eos")
    reference = generate_json(tiny_k3_dir, "--max-tokens", "6", "--ignore-eos", "--reference-step")
    assert native["tokens"] == reference["tokens"]
    assert native["native_decode_steps"] == 5 and reference["native_decode_steps"] == 0


# -- inspect ---------------------------------------------------------------------------------------


def test_inspect_text(capsys, tiny_k3_dir):
    code, out, _ = run(capsys, "inspect", str(tiny_k3_dir))
    assert code == 0
    assert out.startswith(f"{tiny_k3_dir}: kimi_k3, hidden 64, 6 layers")
    for component in ("routed experts", "shared experts", "KDA attention", "MLA attention", "embedding",
                      "lm_head", "router", "latent projections", "dense MLP", "norms and residual scores"):
        assert component in out, component
    assert "quantization: mxfp4-pack-quantized" in out and "mxfp4 (packed)" in out and "in 3 files" in out


def test_inspect_json_numbers_add_up(capsys, tiny_k3_dir, strict_json):
    code, out, _ = run(capsys, "inspect", str(tiny_k3_dir), "--json")
    assert code == 0
    s = strict_json(out)
    assert s["arch"] == "kimi_k3" and s["layers"] == 6 and s["quantization"] == "mxfp4-pack-quantized"
    assert sum(s["params_by_component"].values()) == s["total_params"]
    assert sum(s["bytes_by_component"].values()) == s["total_bytes"]
    assert sum(s["bytes_by_precision"].values()) == s["total_bytes"]
    assert set(s["params_by_component"]) == set(s["bytes_by_component"])

    # recount from the shard headers: MXFP4 packed bytes hold 2 parameters, scales none
    total = routed = embed = nbytes = 0
    shards = sorted(tiny_k3_dir.glob("*.safetensors"))
    assert s["files"] == len(shards)
    for f in shards:
        with safe_open(str(f), framework="pt") as h:
            for name in h.keys():
                t = h.get_tensor(name)
                nbytes += t.numel() * t.element_size()
                n = 0 if name.endswith("weight_scale") else t.numel() * (2 if name.endswith("weight_packed") else 1)
                total += n
                routed += n if ".experts." in name else 0
                embed += n if name.endswith("embed_tokens.weight") else 0
    assert s["total_params"] == total and s["total_bytes"] == nbytes
    e = s["experts"]
    moe_layers = s["layers_by_kind"]["kda+moe"] + s["layers_by_kind"]["mla+moe"]
    assert routed == s["params_by_component"]["routed experts"] == moe_layers * e["routed"] * 3 * 64 * 32
    assert s["params_by_component"]["embedding"] == embed == 512 * 64
    assert s["active_params"] == total - embed - routed + routed * e["top_k"] // e["routed"]


def test_inspect_kimi_linear(capsys, tiny_linear_dir, strict_json):
    code, out, _ = run(capsys, "inspect", str(tiny_linear_dir), "--json")
    s = strict_json(out)
    assert code == 0 and s["arch"] == "kimi_linear" and s["quantization"] is None
    assert sum(s["params_by_component"].values()) == s["total_params"]
    assert "mxfp4 (packed)" not in s["bytes_by_precision"]


# -- errors ----------------------------------------------------------------------------------------


def test_a_gguf_file_is_refused_saying_what_moeswap_reads(capsys, tmp_path):
    """llama.cpp's format, named as the model: one line that says it is GGUF and what moeswap reads instead
    (it was a JSON error about the file's bytes)."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + bytes(64))
    for argv in (("generate", str(gguf), "--prompt", "hi"), ("inspect", str(gguf))):
        code, out, err = run(capsys, *argv)
        assert_one_line_error(code, err, str(gguf), "a GGUF file (llama.cpp's format)")
        assert "safetensors checkpoint, a directory with config.json" in err and out == ""


def test_nonexistent_model_dir(capsys, tmp_path):
    missing = tmp_path / "no-such-model"
    for argv in (("generate", str(missing), "--prompt", "hi"), ("inspect", str(missing))):
        code, out, err = run(capsys, *argv)
        assert_one_line_error(code, err, str(missing), "no config.json found")
        assert out == ""


@pytest.mark.parametrize("command", ["generate", "inspect"])
def test_truncated_shard(capsys, tiny_k3_dir, copy_model, command):
    model = copy_model(tiny_k3_dir)
    shard = model / "model-00002-of-00003.safetensors"
    os.truncate(shard, shard.stat().st_size // 2)
    argv = (command, str(model)) + (("--prompt", "hi") if command == "generate" else ())
    code, _, err = run(capsys, *argv)
    assert_one_line_error(code, err, str(shard), "file truncated")


def test_missing_tensor(capsys, tiny_k3_dir, copy_model):
    model = copy_model(tiny_k3_dir)
    index = json.loads((model / INDEX_NAME).read_text())
    index["weight_map"].pop("language_model.model.norm.weight")
    (model / INDEX_NAME).write_text(json.dumps(index))
    code, _, err = run(capsys, "generate", str(model), "--prompt", "hi")
    assert_one_line_error(code, err, "missing tensors", "language_model.model.norm.weight")


@pytest.mark.parametrize("value", ["lots", "-1GiB", "1e999", "12 parsecs"])
def test_bad_expert_memory(capsys, tiny_k3_dir, value):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", str(tiny_k3_dir), "--prompt", "hi", f"--expert-memory={value}"])
    _, err = capsys.readouterr()
    assert_one_line_error(exit_info.value.code, err, "argument --expert-memory", f"{value!r} is not a size")


def test_parse_bytes():
    assert parse_bytes("512MiB") == 512 << 20 and parse_bytes("2GB") == 2_000_000_000
    assert parse_bytes("1e9") == 10**9 and parse_bytes("0") == 0 and parse_bytes(" 1.5 kib ") == 1536


@pytest.mark.parametrize("flags, fragments", [
    (("--max-tokens", "0"), ("--max-tokens must be at least 1, got 0",)),
    (("--max-tokens", "-3"), ("--max-tokens must be at least 1, got -3",)),
    (("--dtype", "int8"), ("--dtype 'int8' is not a floating-point torch dtype",)),
    (("--device", "floppy"), ("--device 'floppy' is not a torch device",)),
    (("--temperature", "-1"), ("temperature must be >= 0, got -1.0",)),
    (("--top-p", "0"), ("top_p must be in (0, 1], got 0.0",)),
    (("--stop", "</s>", "--stop", ""), ("--stop: an empty string would stop before any text",)),
])
def test_bad_generate_flags(capsys, tiny_k3_dir, flags, fragments):
    code, _, err = run(capsys, "generate", str(tiny_k3_dir), "--prompt", "hi", *flags)
    assert_one_line_error(code, err, *fragments)


def test_prompt_longer_than_the_context(capsys, tiny_k3_dir, copy_model):
    model = copy_model(tiny_k3_dir)
    raw = json.loads((model / "config.json").read_text())
    raw["text_config"]["max_position_embeddings"] = 16
    (model / "config.json").write_text(json.dumps(raw))
    code, _, err = run(capsys, "generate", str(model), "--prompt", "word " * 40, "--max-tokens", "4")
    assert_one_line_error(code, err, "tokens + max_tokens 4 exceeds the limit of 16")


def test_max_tokens_past_the_context(capsys, tiny_k3_dir):
    code, _, err = run(capsys, "generate", str(tiny_k3_dir), "--prompt", "hi", "--max-tokens", "1048576")
    assert_one_line_error(code, err, "+ max_tokens 1048576 exceeds the limit of 1048576")


def test_empty_prompt(capsys, tiny_k3_dir):
    code, _, err = run(capsys, "generate", str(tiny_k3_dir), "--prompt", "")
    assert_one_line_error(code, err, "the prompt is empty")


def test_debug_raises_instead(capsys, tmp_path):
    with pytest.raises(ConfigError, match="no config.json found"):
        main(["--debug", "inspect", str(tmp_path / "nothing")])


# -- as a process ----------------------------------------------------------------------------------


def moeswap(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "moeswap", *argv], capture_output=True, text=True, timeout=120,
                          env=env)


@pytest.mark.slow
def test_process_exit_codes(tmp_path, tiny_k3_dir):
    ok = moeswap("inspect", str(tiny_k3_dir), "--json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["arch"] == "kimi_k3"

    bad = moeswap("generate", str(tmp_path / "missing"), "--prompt", "hi")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().splitlines() == [bad.stderr.strip()]
    assert bad.stderr.startswith(f"moeswap: error: {tmp_path / 'missing'}: no config.json found")

    flag = moeswap("generate", str(tiny_k3_dir), "--prompt", "hi", "--expert-memory", "lots")
    assert flag.returncode == 2 and len(flag.stderr.strip().splitlines()) == 1
    assert flag.stderr.startswith("moeswap: error: argument --expert-memory")


def test_process_debug_shows_the_traceback(tmp_path):
    res = moeswap("--debug", "generate", str(tmp_path / "missing"), "--prompt", "hi")
    assert res.returncode != 0
    assert "Traceback (most recent call last)" in res.stderr
    assert "ConfigError" in res.stderr and "no config.json found" in res.stderr


def test_dense_weights_flag(capsys, tiny_k3_dir, generate_json):
    converted = generate_json(tiny_k3_dir, "--max-tokens", "4", "--dense-weights", "compute")
    kept = generate_json(tiny_k3_dir, "--max-tokens", "4")
    assert converted["tokens"] == kept["tokens"]  # same values, bf16 weights kept or widened
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", str(tiny_k3_dir), "--prompt", PROMPT, "--dense-weights", "half"])
    _, err = capsys.readouterr()
    assert_one_line_error(exit_info.value.code, err, "argument --dense-weights", "invalid choice: 'half'")


def test_a_prompt_spelling_a_special_token_is_text_unless_asked(capsys, tiny_k3_dir):
    from moeswap.text.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_k3_dir)
    end = tok.special_to_id["<|im_end|>"]
    for flags, expect_special in (([], False), (["--special-tokens"], True)):
        assert main(["generate", str(tiny_k3_dir), "--prompt", "a<|im_end|>b", "--max-tokens", "1", "--json",
                     *flags]) == 0
        out = json.loads(capsys.readouterr().out)
        ids = tok.encode("a<|im_end|>b", specials=expect_special)
        assert out["prompt_tokens"] == len(ids) and (end in ids) == expect_special


def test_warnings_are_one_line(tiny_linear_dir, copy_model):
    import subprocess
    import sys

    model = copy_model(tiny_linear_dir)
    config = json.loads((model / "config.json").read_text())
    config["frobnicate_level"] = 3
    (model / "config.json").write_text(json.dumps(config))
    out = subprocess.run([sys.executable, "-m", "moeswap.cli", "inspect", str(model)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    warning_lines = [line for line in out.stderr.splitlines() if "frobnicate_level" in line]
    assert len(warning_lines) == 1 and warning_lines[0].startswith("moeswap: warning: ")
    assert warning_lines[0].endswith("config.json: ignoring unknown config keys: frobnicate_level")
    assert len(out.stderr.strip().splitlines()) == 1


def test_generate_json_schema_and_json_object(generate_json, tiny_k3_dir, tmp_path, capsys, strict_json):
    """--json-schema / --json-object: the server's response_format (text/structured.py) for generate; one
    prompt and several; a bad schema file is a one-line error naming flag and file, before the model loads."""
    schema = {"type": "object", "required": ["n"], "additionalProperties": False,
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    flags = ("--max-tokens", "60", "--temperature", "1", "--seed", "2")
    done = generate_json(tiny_k3_dir, "--json-schema", str(path), *flags)
    value = strict_json(done["text"])
    assert done["finish_reason"] == "stop" and set(value) == {"n"} and 0 <= value["n"] <= 9
    assert isinstance(strict_json(generate_json(tiny_k3_dir, "--json-object", *flags)["text"]), dict)
    code, out, err = run(capsys, "generate", str(tiny_k3_dir), "--prompt", "a", "--prompt", "b", "--json",
                         "--json-schema", str(path), *flags)
    assert code == 0, err
    for o in strict_json(out)["outputs"]:
        assert o["finish_reason"] == "stop" and set(strict_json(o["text"])) == {"n"}
    for content, says in (('{"type": "strin"}', "is not a valid JSON schema: Invalid type: strin"),
                          ('{"not": {}}', "llguidance cannot follow this schema"), ("[1", "not a JSON file"),
                          ("[1]", "a JSON schema is an object")):
        path.write_text(content)
        code, _, err = run(capsys, "generate", str(tiny_k3_dir), "--prompt", "hi", "--json-schema", str(path))
        assert_one_line_error(code, err, f"--json-schema {path}", says)
    code, _, err = run(capsys, "generate", str(tiny_k3_dir), "--prompt", "hi", "--json-schema", str(tmp_path / "no"))
    assert_one_line_error(code, err, f"--json-schema {tmp_path / 'no'}: No such file")
