"""compressed-tensors MX configs and module tensors: parsing with clear errors, configs that
compressed-tensors and transformers accept, compact ignore lists, and per-module encode/decode."""

from __future__ import annotations

import pytest
import torch

from moeswap.formats import compressed_tensors as ct
from moeswap.formats import mxfp4, mxfp8


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_config_round_trips_and_is_accepted_by_compressed_tensors(fmt):
    from compressed_tensors.quantization import QuantizationConfig

    q = ct.quantization_config(fmt, ["lm_head", r"re:^model\.layers\.\d+\.mlp\.down_proj$"])
    scheme = ct.parse_quantization_config(q)
    assert (scheme.format, scheme.group_size, scheme.short_name) == (ct.FORMATS[fmt], 32, fmt)
    assert scheme.ignore == ("lm_head", r"re:^model\.layers\.\d+\.mlp\.down_proj$")
    theirs = QuantizationConfig.model_validate(q)
    assert theirs.format == ct.FORMATS[fmt] and theirs.config_groups["group_0"].weights.group_size == 32
    assert theirs.config_groups["group_0"].weights.num_bits == {"mxfp4": 4, "mxfp8": 8}[fmt]


def test_config_accepted_by_transformers():
    transformers_config = pytest.importorskip("transformers.utils.quantization_config")
    config = transformers_config.CompressedTensorsConfig.from_dict(ct.quantization_config("mxfp8", ["lm_head"]))
    assert config.quantization_config.format == "mxfp8-quantized"


def _with(**changes):
    q = ct.quantization_config("mxfp4", [])
    group = q["config_groups"]["group_0"]
    for key, value in changes.items():
        if key == "group_size":
            group["weights"]["group_size"] = value
        elif key == "num_bits":
            group["weights"]["num_bits"] = value
        elif key == "format":
            q["format"] = group["format"] = value
        else:
            q[key] = value
    return q


@pytest.mark.parametrize("q,message", [
    (_with(quant_method="fp8"), r"quant_method='fp8' is not supported.*convert it with `moeswap quantize`"),
    (_with(format="nvfp4-pack-quantized"),
     r"'nvfp4-pack-quantized' is not supported \(expected mxfp4-pack-quantized or"),
    (_with(group_size=16), "MXFP4 group_size must be 32, got 16"),
    (_with(num_bits=8), "format mxfp4-pack-quantized stores 4-bit weights, but weights.num_bits is 8"),
    (_with(config_groups={}), "config_groups must name at least one scheme"),
    (_with(ignore="lm_head"), "ignore must be a list"),
])
def test_config_errors(q, message):
    with pytest.raises(ValueError, match=message):
        ct.parse_quantization_config(q, "m/config.json")


def test_mixed_formats_are_refused():
    """Two groups both targeting the class Linear: which one the experts are in is not said."""
    q = ct.quantization_config("mxfp4", [])
    q["config_groups"]["group_1"] = {**q["config_groups"]["group_0"], "format": "mxfp8-quantized"}
    q["config_groups"]["group_1"]["weights"] = {**q["config_groups"]["group_0"]["weights"], "num_bits": 8}
    with pytest.raises(ValueError, match=r"holds 2 schemes \(formats \['mxfp4-pack-quantized', 'mxfp8-quantized'\]\)"):
        ct.parse_quantization_config(q)


@pytest.mark.parametrize("dense", ["int8", "int4"])
def test_a_dense_group_beside_the_experts(dense):
    """quantize --dense's config: the experts' group targets Linear, the dense group names its modules; the dense
    format is declared for them (config.QuantScheme.dense), the experts' for the rest."""
    targets = ct.ignore_patterns(["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj", "lm_head"])
    q = ct.quantization_config("mxfp4", ["model.embed_tokens"], dense=(dense, targets))
    scheme = ct.parse_quantization_config(q)
    assert scheme.format == ct.FORMATS["mxfp4"] and scheme.dense_format == ct.FORMATS[dense]
    assert scheme.dense_targets == tuple(targets) and scheme.targets == ("Linear",)
    weights = q["config_groups"]["group_1"]["weights"]
    if dense == "int8":  # one fp32 scale per output row: no group size
        assert (weights["strategy"], weights["group_size"], weights["num_bits"]) == ("channel", None, 8)
        weights["group_size"] = 32
        with pytest.raises(ValueError, match="strategy channel, group_size null"):
            ct.parse_quantization_config(q)
    else:
        assert (weights["strategy"], weights["group_size"], q["format"]) == ("group", 32, "mixed-precision")


def test_unknown_format_name():
    with pytest.raises(ValueError, match=r"unknown compressed-tensors format 'fp4'; expected one of mxfp4, mxfp8, "
                                         r"int4"):
        ct.short_name("fp4")


def test_ignore_patterns_are_compact_and_exact():
    dense = ["lm_head", "model.embed_tokens"] + [
        f"model.layers.{i}.{m}" for i in range(12) for m in ("self_attn.q_proj", "block_sparse_moe.gate",
                                                             "block_sparse_moe.shared_experts.up_proj")]
    patterns = ct.ignore_patterns(dense)
    assert len(patterns) == 5 and "lm_head" in patterns
    assert all(ct.matches(m, patterns) for m in dense)
    for expert in ("model.layers.3.block_sparse_moe.experts.7.w1", "model.layers.3.block_sparse_moe.experts",
                   "model.layers.3.block_sparse_moe.gate_proj", "model.layers.3.self_attn.q_proj_extra"):
        assert not ct.matches(expert, patterns), expert


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_encode_and_decode_weight(fmt):
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
    stored = ct.encode_weight(fmt, w, "floor")
    specs = ct.stored_specs(fmt, (64, 96))
    assert {k: (v.dtype, tuple(v.shape)) for k, v in stored.items()} == specs
    codec = mxfp4 if fmt == "mxfp4" else mxfp8
    expected = codec.decode(*codec.encode(w, "floor"), torch.float32)
    assert torch.equal(ct.decode_weight(fmt, stored, torch.float32), expected)
    with pytest.raises(ValueError, match="missing weight_scale"):
        ct.decode_weight(fmt, {k: v for k, v in stored.items() if k != "weight_scale"})


@pytest.mark.parametrize("shape,message", [((64, 48), "multiple of 32, got shape \\[64, 48\\]"),
                                           ((64, 31), "multiple of 32"), ((4, 4, 32), "2-D")])
def test_encode_weight_shape_errors(shape, message):
    with pytest.raises(ValueError, match=message):
        ct.encode_weight("mxfp4", torch.zeros(shape))
