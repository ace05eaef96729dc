"""--dense-weights int8|int4 (weights.dense_quant's one rule, the loader's quantisation at load): in Kimi K3,
Kimi Linear and DeepSeek-V3 alike, exactly the bias-free Linears the rule names hold codes, each the format's
encoding of the checkpoint's weight bit for bit, the others as they were; off the kernel's conditions (a compute
dtype other than fp32) the same rounding is kept as decoded values."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moeswap import archs
from moeswap.formats.checkpoint import Checkpoint
from moeswap.models.loader import LoadOptions, load_model
from moeswap.weights import dense_quant, registry
from moeswap.weights.dense import WeightLinear, linear_method


@pytest.fixture(scope="module")
def dsv3_dir(tmp_path_factory):
    from moeswap.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("ds") / "bf16", "deepseek_v3", "tiny", seed=2)


@pytest.fixture(params=["k3", "linear", "dsv3"])
def arch_dir(request, tiny_k3_dir, tiny_linear_dir):
    return {"k3": tiny_k3_dir, "linear": tiny_linear_dir}.get(request.param) or request.getfixturevalue("dsv3_dir")


@pytest.mark.parametrize("dense", ["int8", "int4"])
def test_the_rule_picks_the_same_kinds_in_every_architecture(arch_dir, dense):
    fmt = registry.FORMATS[dense_quant.FORMATS[dense]]
    model, _ = load_model(arch_dir, LoadOptions(dense_weights=dense))
    plain, _ = load_model(arch_dir, LoadOptions(dense_weights="compute"))
    coded = {n: m for n, m in model.named_modules() if isinstance(m, WeightLinear) and m.method.codes is not None}
    linears = {n: m for n, m in plain.named_modules() if type(m) is nn.Linear}
    assert set(coded) == {n for n, m in linears.items()
                          if dense_quant.quantizable(n, (m.out_features, m.in_features))}
    kinds = {n.rpartition(".")[2] for n in coded}
    assert {"o_proj", "kv_b_proj", "lm_head"} <= kinds and not kinds & dense_quant.KEPT
    assert all(linear_method(m) is fmt.linear_method for m in coded.values())
    arch = archs.get(model.config.arch)
    with Checkpoint.open(arch_dir) as ckpt:
        for name in sorted(coded)[::5]:
            stored = ckpt.read(model.config.weight_prefix + arch.published_name(f"{name}.weight"))
            for suffix, t in fmt.encode(stored.float()).items():
                assert torch.equal(getattr(coded[name], suffix), t), (name, suffix)
    for name, m in model.named_modules():  # everything else as --dense-weights auto keeps it
        if name not in coded and isinstance(m, nn.Linear):
            assert torch.equal(linear_method(m).values(m).float(), linears[name].weight), name


def test_a_compute_dtype_the_kernels_do_not_take_gets_the_same_rounding_as_values(tiny_k3_dir):
    coded, _ = load_model(tiny_k3_dir, LoadOptions(dense_weights="int8"))
    f64, _ = load_model(tiny_k3_dir, LoadOptions(dense_weights="int8", dtype="float64"))
    name = "model.layers.1.self_attn.o_proj"
    m = coded.get_submodule(name)
    assert type(f64.get_submodule(name)) is nn.Linear
    assert torch.equal(f64.get_submodule(name).weight, linear_method(m).values(m).double())


def test_kimi_k3s_dense_trunk_bytes(tmp_path):
    """K3's dense trunk (its published config, the planner's preset; the model built on meta): 113.5 GB as bf16;
    stored by the rule, each quantised matrix's bytes as its format declares (stored_specs): int8 0.52 of that,
    int4 0.305 (the embedding, 2.3 GB, and the routers, 1.2 GB, stay bf16; docs/benchmarks.md)."""
    import shutil
    from pathlib import Path

    from moeswap.config import load_config
    from moeswap.models import build_model

    preset = Path(__file__).parents[2] / "src/moeswap/planner/presets/kimi_k3.json"
    shutil.copy(preset, tmp_path / "config.json")
    model = build_model(load_config(tmp_path), device="meta")
    linears = {n for n, m in model.named_modules() if type(m) is nn.Linear and m.bias is None}
    bf16, stored = 0, {"int8": 0, "int4": 0}
    for name, p in model.named_parameters():
        bf16 += 2 * p.numel()
        module = name.rpartition(".")[0]
        quantised = module in linears and dense_quant.quantizable(module, tuple(p.shape))
        for dense, fmt_name in dense_quant.FORMATS.items():
            specs = registry.FORMATS[fmt_name].stored_specs(tuple(p.shape)) if quantised else {}
            stored[dense] += (sum(d.itemsize * torch.Size(s).numel() for d, s in specs.values()) if quantised
                              else 2 * p.numel())
    assert round(bf16 / 1e9, 1) == 113.5
    assert round(stored["int8"] / bf16, 3) == 0.517 and round(stored["int4"] / bf16, 3) == 0.305


@pytest.mark.parametrize("dense", ["int8", "int4"])
def test_encoding_by_rows_is_the_whole_matrix_encoding(dense, monkeypatch):
    """The loader and quantize encode a slice of rows at a time (bounded memory for K3's 4.7 GB fp32 lm_head):
    the codes and scales are the whole matrix's, bit for bit, whatever the slice (here 3 rows, not dividing 10)."""
    fmt = registry.FORMATS[dense_quant.FORMATS[dense]]
    w = torch.randn(10, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    whole = fmt.encode(w.float())
    monkeypatch.setattr(dense_quant, "ENCODE_ROW_BYTES", 3 * 4 * 64)
    sliced = dense_quant.encode_by_rows(fmt, w)
    assert whole.keys() == sliced.keys()
    for suffix in whole:
        assert torch.equal(whole[suffix], sliced[suffix]), suffix


def test_the_embedding_stays_the_checkpoints_mapping_with_the_same_logits(tiny_k3_dir, monkeypatch):
    """--dense-weights int8 keeps the embedding table as the checkpoint's zero-copy mapping in its stored
    dtype (nothing resident but the rows read); its lookups are the compute-dtype copy's, bit for bit, through
    the forward and the native decode step alike."""
    from moeswap.engine.scheduler import EngineConfig, Request, Scheduler
    from moeswap.models import loader
    from moeswap.models.layers.basic import StoredEmbedding

    def run(model):
        tokens = torch.tensor([[3, 17, 5, 9]])
        logits = model(tokens)
        [res] = Scheduler(model, EngineConfig(max_batch=1, max_len=32)).run([Request([3, 17, 5, 9], 6, id=0)])
        return logits, res.tokens

    stored, _ = load_model(str(tiny_k3_dir), LoadOptions(dense_weights="int8"))
    emb = stored.model.embed_tokens
    assert isinstance(emb, StoredEmbedding) and emb.weight.dtype == torch.bfloat16
    with Checkpoint.open(str(tiny_k3_dir)) as ckpt:
        assert torch.equal(emb.weight, ckpt.read("language_model.model.embed_tokens.weight"))
    monkeypatch.setattr(loader, "_rows_stay_stored", lambda config, device: False)
    copied, _ = load_model(str(tiny_k3_dir), LoadOptions(dense_weights="int8"))
    assert not isinstance(copied.model.embed_tokens, StoredEmbedding)
    (a, ta), (b, tb) = run(stored), run(copied)
    assert torch.equal(a, b) and ta == tb
