"""write_tiny_model (`moeswap init-tiny`): deterministic, in the published K3 / Kimi Linear layouts, atomic,
and the result loads and generates; the tiny tokenizers it ships are deterministic and round-trip their corpus."""

from __future__ import annotations

import hashlib
import json
import re
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from moeswap.config import load_config
from moeswap.engine.generate import GenerationConfig, generate
from moeswap.formats.checkpoint import INDEX_NAME
from moeswap.models.loader import load_model
from moeswap.text.tokenizer import load_tokenizer
from moeswap.tiny import write_tiny_model
from moeswap.tiny.tokenizer import build_tiny_tiktoken, build_tiny_tokenizer, corpus_text

EXPERT = re.compile(r"(?:language_model\.)?model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.(\w+)")


def files_bytes(model: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(model.iterdir())}


def read_shards(model: Path) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for f in sorted(model.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as s:
            out[f.name] = {name: s.get_tensor(name) for name in s.keys()}
    return out


# -- determinism -----------------------------------------------------------------------------------


# The same seed gives byte-identical files: the architecture contract, for every architecture
# (tests/archs/contract.py check_init_tiny_is_deterministic).


def test_different_seed_gives_different_weights(tiny_k3_dir, tmp_path):
    other = write_tiny_model(tmp_path / "seed1", "kimi_k3", "tiny", 1)
    a, b = files_bytes(tiny_k3_dir), files_bytes(other)
    shards = [n for n in a if n.endswith(".safetensors")]
    assert all(a[n] != b[n] for n in shards)
    ta = {k: v for s in read_shards(tiny_k3_dir).values() for k, v in s.items()}
    tb = {k: v for s in read_shards(other).values() for k, v in s.items()}
    assert ta.keys() == tb.keys()
    for name in ("language_model.model.embed_tokens.weight",
                 "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed"):
        assert not torch.equal(ta[name], tb[name]), name
    # the layout does not depend on the seed
    assert a["config.json"] == b["config.json"] and a["tokenizer.json"] == b["tokenizer.json"]


# -- layouts ---------------------------------------------------------------------------------------


def check_index(model: Path) -> dict[str, dict[str, torch.Tensor]]:
    """>= 2 shards, and an index whose weight_map covers exactly the tensors in the shards."""
    shards = read_shards(model)
    assert len(shards) >= 2
    index = json.loads((model / INDEX_NAME).read_text())
    expected = {name: shard for shard, tensors in shards.items() for name in tensors}
    assert index["weight_map"] == expected
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for tensors in shards.values() for t in tensors.values())
    assert all(tensors for tensors in shards.values())
    return shards


def test_k3_layout(tiny_k3_dir):
    raw = json.loads((tiny_k3_dir / "config.json").read_text())
    assert raw["model_type"] == "kimi_k3" and raw["architectures"] == ["KimiK3ForConditionalGeneration"]
    text = raw["text_config"]
    q = text["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "mxfp4-pack-quantized"
    assert q["config_groups"]["group_0"]["format"] == "mxfp4-pack-quantized"
    assert q["config_groups"]["group_0"]["weights"]["group_size"] == 32
    assert text["linear_attn_config"]["gate_lower_bound"] == -5.0
    assert text["linear_attn_config"]["use_full_rank_gate"] is True
    cfg = load_config(tiny_k3_dir)
    assert cfg.arch == "kimi_k3" and cfg.weight_prefix == "language_model."
    assert cfg.attn_kinds[-1] == "mla" and "kda" in cfg.attn_kinds and cfg.mlp_kinds[0] == "dense"

    shards = check_index(tiny_k3_dir)
    tensors = {name: t for s in shards.values() for name, t in s.items()}
    assert all(name.startswith("language_model.") for name in tensors)

    f, n_in = cfg.moe.expert_dim, cfg.moe.latent_dim
    shape = {"w1": (f, n_in), "w3": (f, n_in), "w2": (n_in, f)}
    experts = defaultdict(set)
    for name, t in tensors.items():
        m = EXPERT.fullmatch(name)
        if not m:
            assert t.dtype in (torch.bfloat16, torch.float32), name
            continue
        layer, e, proj, kind = int(m[1]), int(m[2]), m[3], m[4]
        experts[(layer, e)].add(f"{proj}.{kind}")
        out, inp = shape[proj]
        assert t.dtype == torch.uint8, name
        assert tuple(t.shape) == ((out, inp // 2) if kind == "weight_packed" else (out, inp // 32)), name
    moe_layers = [i for i, k in enumerate(cfg.mlp_kinds) if k == "moe"]
    assert set(experts) == {(layer, e) for layer in moe_layers for e in range(cfg.moe.num_experts)}
    six = {f"{p}.{k}" for p in ("w1", "w2", "w3") for k in ("weight_packed", "weight_scale")}
    assert all(kinds == six for kinds in experts.values())

    p = "language_model.model.layers"
    kda = cfg.attn_kinds.index("kda")
    assert f"{p}.{kda}.self_attn.g_proj.weight" in tensors  # K3's full-rank output gate
    assert f"{p}.{kda}.self_attn.g_a_proj.weight" not in tensors
    a_log = tensors[f"{p}.{kda}.self_attn.A_log"]
    assert a_log.dtype == torch.float32 and a_log.shape == (max(cfg.kda.num_heads, cfg.kda.head_dim),)
    assert torch.all(a_log[cfg.kda.num_heads:] == 0)  # zero-padded like the published [128]
    assert tensors[f"{p}.1.block_sparse_moe.gate.e_score_correction_bias"].dtype == torch.float32
    assert f"{p}.0.mlp.down_proj.weight" in tensors and f"{p}.0.self_attention_res_proj.weight" in tensors
    assert "language_model.lm_head.weight" in tensors
    assert "language_model.model.output_attn_res_proj.weight" in tensors


def test_experts_are_never_split_across_shards(tiny_k3_dir, tiny_linear_dir):
    for model in (tiny_k3_dir, tiny_linear_dir):
        wm = json.loads((model / INDEX_NAME).read_text())["weight_map"]
        where = defaultdict(set)
        for name, shard in wm.items():
            m = EXPERT.fullmatch(name)
            if m:
                where[(m[1], m[2])].add(shard)
        assert where and all(len(s) == 1 for s in where.values()), model.name


def test_kimi_linear_layout(tiny_linear_dir):
    raw = json.loads((tiny_linear_dir / "config.json").read_text())
    assert "text_config" not in raw and "quantization_config" not in raw
    assert raw["model_type"] == "kimi_linear" and raw["hidden_act"] == "silu"
    assert "gate_lower_bound" not in raw["linear_attn_config"]
    cfg = load_config(tiny_linear_dir)
    assert cfg.arch == "kimi_linear" and cfg.weight_prefix == "" and cfg.quant is None

    shards = check_index(tiny_linear_dir)
    tensors = {name: t for s in shards.values() for name, t in s.items()}
    assert not [n for n in tensors if n.startswith("language_model.")]
    d, f = cfg.hidden_size, cfg.moe.expert_dim
    shape = {"w1": (f, d), "w3": (f, d), "w2": (d, f)}
    n_experts = 0
    for name, t in tensors.items():
        m = EXPERT.fullmatch(name)
        if m:
            n_experts += 1
            assert m[4] == "weight" and t.dtype == torch.bfloat16 and tuple(t.shape) == shape[m[3]], name
    assert n_experts == 3 * cfg.moe.num_experts * cfg.mlp_kinds.count("moe")
    kda = cfg.attn_kinds.index("kda")
    assert f"model.layers.{kda}.self_attn.g_a_proj.weight" in tensors  # low-rank output gate
    assert f"model.layers.{kda}.self_attn.g_proj.weight" not in tensors
    assert tensors[f"model.layers.{kda}.self_attn.A_log"].shape == (1, 1, cfg.kda.num_heads, 1)
    assert not [n for n in tensors if "res_proj" in n or "routed_expert" in n]


@pytest.mark.parametrize("which", ["k3", "linear"])
def test_tokenizer_matches_config(which, tiny_k3_dir, tiny_linear_dir):
    model = tiny_k3_dir if which == "k3" else tiny_linear_dir
    assert (model / "tokenizer.json").is_file()
    tok = load_tokenizer(model)
    cfg = load_config(model)
    assert tok.vocab_size == cfg.vocab_size
    assert cfg.eos_token_ids == (tok.eos_ids[0],)
    assert tok.decode(tok.encode("hello world")) == "hello world"


# -- the tiny tokenizer ----------------------------------------------------------------------------

# Every tiny tokenizer (and so every tiny model's tokenizer.json) is trained on these bytes: an edit to
# corpus.txt, even a stripped trailing space or a final newline, changes them all. Update on purpose only.
CORPUS_SHA256 = "d03c4ba8e43ba6edb236cdaf9650647f2823d029e597324f115da0df0f9e2db7"


def test_corpus_is_the_one_the_tiny_tokenizers_are_trained_on():
    assert hashlib.sha256(corpus_text().encode()).hexdigest() == CORPUS_SHA256


@pytest.mark.parametrize("build", [build_tiny_tokenizer, build_tiny_tiktoken])
def test_tiny_tokenizer_is_deterministic(tmp_path, build):
    build(tmp_path / "a", 1000)
    build(tmp_path / "b", 1000)
    for f in (tmp_path / "a").iterdir():
        assert f.read_bytes() == (tmp_path / "b" / f.name).read_bytes(), f.name


@pytest.mark.parametrize("build", [build_tiny_tokenizer, build_tiny_tiktoken])
def test_tiny_tokenizer_round_trips_its_corpus(tmp_path, build):
    build(tmp_path, 2048)
    tok = load_tokenizer(tmp_path)
    text = corpus_text()
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert all(tok.decode(tok.encode(line)) == line for line in text.splitlines())
    assert len(ids) < len(text.encode()) / 2  # trained on it: the merges compress it


# -- writing ---------------------------------------------------------------------------------------


def test_refuses_a_non_empty_directory_and_leaves_it_untouched(tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(FileExistsError, match=rf"{out} exists and is not empty"):
        write_tiny_model(out, "kimi_k3", "tiny", 0)
    assert sorted(tmp_path.rglob("*")) == before  # no temporary directory left behind either
    assert (out / "notes.txt").read_text() == "mine"


def test_refuses_a_file(tmp_path):
    out = tmp_path / "a_file"
    out.write_text("x")
    with pytest.raises(FileExistsError, match="is not a directory"):
        write_tiny_model(out, "kimi_linear", "tiny", 0)
    assert out.read_text() == "x"


def test_writes_into_an_empty_directory(tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    write_tiny_model(out, "kimi_linear", "tiny", 0)
    assert (out / "config.json").is_file() and (out / INDEX_NAME).is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["empty"]


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    import moeswap.tiny.model as tiny_model

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(tiny_model, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        write_tiny_model(tmp_path / "out", "kimi_linear", "tiny", 0)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kw, message", [
    ({"arch": "llama"}, r"--arch 'llama': expected one of kimi_k3, kimi_linear"),
    ({"size": "huge"}, r"--size 'huge': expected one of tiny, small, stdlib, bench"),
])
def test_bad_arch_or_size(tmp_path, kw, message):
    with pytest.raises(ValueError, match=message):
        write_tiny_model(tmp_path / "out", **kw)
    assert not (tmp_path / "out").exists()


# -- it runs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["k3", "linear"])
def test_tiny_model_loads_and_generates(which, tiny_k3_dir, tiny_linear_dir):
    model_dir = tiny_k3_dir if which == "k3" else tiny_linear_dir
    model, store = load_model(model_dir)
    tok = load_tokenizer(model_dir)
    ids = tok.encode("hello world")
    cfg = GenerationConfig(max_tokens=4, stop_ids=())
    first = generate(model, ids, cfg)
    assert len(first.tokens) == 4 and first.finish_reason == "length"
    assert all(0 <= t < model.config.vocab_size for t in first.tokens)
    assert store.stats.misses > 0  # the experts came from the store
    assert generate(model, ids, cfg).tokens == first.tokens
    logits = model(torch.tensor([ids]))
    assert logits.shape == (1, len(ids), model.config.vocab_size) and torch.isfinite(logits).all()
