"""`moeswap quantize --dense int8|int4`: the dense weights weights.dense_quant picks are written as compressed-tensors
INT8 (int-quantized, channel) or INT4 (pack-quantized) in a second config group, the rest as they were; the
checkpoint loads to exactly the codes and scales `--dense-weights int8|int4` makes at load from the source (bit
for bit), compressed-tensors reads the config and decompresses the dense tensors to the values moeswap decodes,
and the report holds each tensor's error."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from moeswap.cli import main
from moeswap.config import load_config
from moeswap.formats import compressed_tensors as ct
from moeswap.formats.checkpoint import Checkpoint
from moeswap.models.loader import LoadOptions, load_model
from moeswap.quantize import REPORT_NAME, QuantizeOptions, quantize
from moeswap.weights import dense_quant
from moeswap.weights.dense import WeightLinear, linear_method


def _kept(model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """Every Linear kept as codes: its parameters by name."""
    return {n: dict(m.named_parameters()) for n, m in model.named_modules()
            if isinstance(m, WeightLinear) and m.method.codes is not None}


@pytest.fixture(scope="module", params=["int8", "int4"])
def dense_out(request, tiny_k3_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("dense") / request.param
    return request.param, quantize(tiny_k3_dir, out, QuantizeOptions("mxfp4", dense=request.param)), out


def test_the_written_checkpoint_loads_to_the_on_the_fly_codes_bit_for_bit(dense_out, tiny_k3_dir):
    dense, report, out = dense_out
    on_the_fly, _ = load_model(tiny_k3_dir, LoadOptions(dense_weights=dense))
    written, _ = load_model(out, LoadOptions())  # auto: kept as stored
    want, got = _kept(on_the_fly), _kept(written)
    assert want and set(got) == set(want)
    for name, params in want.items():
        assert linear_method(written.get_submodule(name)) is linear_method(on_the_fly.get_submodule(name))
        assert set(got[name]) == set(params)
        for p, t in params.items():
            assert t.dtype == got[name][p].dtype and torch.equal(t, got[name][p]), (name, p)
    # the rule's choice, and nothing else: every other Linear bf16 as in the source
    linears = {n: m for n, m in written.named_modules() if isinstance(m, nn.Linear)}
    assert set(want) == {n for n, m in linears.items() if dense_quant.quantizable(n, (m.out_features, m.in_features))}
    rows = report["dense"]["tensors"]
    assert report["dense"]["summary"]["encoded"] == len(rows) == len(want)
    assert all(0 < r["rel_error"] < (0.02 if dense == "int8" else 0.2) and r["max_abs_error"] > 0 for r in rows)
    assert report["dense"]["summary"]["bytes_out"] < report["dense"]["summary"]["bytes_in"] * (0.6 if dense == "int8"
                                                                                               else 0.35)
    assert json.loads((out / REPORT_NAME).read_text())["dense"]["summary"] == report["dense"]["summary"]
    cfg = load_config(out)
    assert cfg.quant.format == ct.FORMATS["mxfp4"] and cfg.quant.dense_format == ct.FORMATS[dense]


def test_compressed_tensors_reads_the_dense_group(dense_out):
    """compressed-tensors' own parser and decompressor: the experts' group and the dense group quantise exactly
    the modules moeswap wrote in each format, and its decompression is moeswap's decode."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    dense, _, out = dense_out
    raw = json.loads((out / "config.json").read_text())
    config = QuantizationConfig.model_validate(raw.get("quantization_config") or raw["text_config"]["quantization_config"])
    with Checkpoint.open(out) as ckpt:
        root = nn.Module()
        modules: dict[str, set[str]] = {}
        for name in ckpt.names():
            module, _, suffix = name.rpartition(".")
            modules.setdefault(module, set()).add(suffix)
        shapes = {}
        for module, suffixes in modules.items():
            if "weight_packed" in suffixes:
                info = ckpt.info(f"{module}.weight_scale")
                shapes[module] = (info.shape[0], info.shape[1] * 32)
            elif "weight" in suffixes and len(ckpt.info(f"{module}.weight").shape) == 2:
                shapes[module] = tuple(ckpt.info(f"{module}.weight").shape)
        for module, shape in shapes.items():
            parent = root
            *path, leaf = module.split(".")
            for part in path:
                if not hasattr(parent, part):
                    parent.add_module(part, nn.Module())
                parent = getattr(parent, part)
            parent.add_module(leaf, nn.Linear(shape[1], shape[0], bias=False, device="meta"))
        apply_quantization_config(root, config, show_progress=False)
        schemes = {n: m.quantization_scheme for n, m in root.named_modules()
                   if getattr(m, "quantization_scheme", None) is not None}
        experts = {n for n in schemes if ".experts." in n}
        coded = {n for n in shapes if ".experts." not in n and ("weight_packed" in modules[n]
                                                                 or ckpt.info(f"{n}.weight").dtype == torch.int8)}
        assert coded and set(schemes) == experts | coded
        for name in sorted(coded)[::3]:
            scheme = schemes[name]
            assert (scheme.weights.num_bits, scheme.weights.strategy) == ((8, "channel") if dense == "int8"
                                                                           else (4, "group"))
            compressor = BaseCompressor.get_value_from_registry(ct.FORMATS[dense])
            stored = {s: ckpt.get(f"{name}.{s}") for s in ct.stored_names(dense)}
            theirs = compressor.decompress(dict(stored), scheme)["weight"]
            ours = ct.decode_weight(dense, stored, torch.float32)
            torch.testing.assert_close(theirs.float(), ours, rtol=0, atol=0)


def test_the_cli_flag_and_its_refusals(tiny_linear_dir, tmp_path, capsys):
    assert main(["quantize", str(tiny_linear_dir), str(tmp_path / "o"), "--experts", "mxfp4", "--dense", "int8"]) == 0
    assert "dense weights as int-quantized" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--dense needs a compressed-tensors expert format"):
        quantize(tiny_linear_dir, tmp_path / "p", QuantizeOptions("fp8", dense="int4"))
    with pytest.raises(ValueError, match="--dense 'int2'"):
        quantize(tiny_linear_dir, tmp_path / "p", QuantizeOptions("mxfp4", dense="int2"))
    assert not (tmp_path / "p").exists()
