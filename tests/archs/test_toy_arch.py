"""Adding an architecture is one description plus its registration: a toy Kimi Linear variant with its own
model_type, its final norm and routed experts stored under other names, is recognised by config.py,
written by init-tiny in its own layout, loaded, and keeps the whole architecture contract (contract.py)."""

from __future__ import annotations

import dataclasses
import json
from types import MappingProxyType

import pytest
import torch

from archs.contract import CHECKS, Tiny, check_id
from moeswap import archs
from moeswap.archs.base import IDENTITY
from moeswap.archs.kimi_linear import KimiLinear
from moeswap.cli import main
from moeswap.config import ConfigError, load_config, parse_config
from moeswap.formats.checkpoint import Checkpoint
from moeswap.models.loader import LoadOptions, load_model
from moeswap.tiny import SIZES, tiny_config, write_tiny_model


# -- the one file a new architecture is ------------------------------------------------------------
class ToyLinear(KimiLinear):
    """Kimi Linear's model; its checkpoint calls the final norm `final_layernorm` and keeps routed experts
    under `moe.experts.E.{gate,up,down}`."""

    name = "toy_linear"
    model_types = ("toy_linear",)
    architectures = ("ToyLinearForCausalLM",)
    checkpoint_map = (
        (r"model\.layers\.(\d+)\.moe\.experts\.(\d+)\.(gate|up|down)\.(weight)", "expert"),
        (r"model\.final_layernorm\.weight", r"model.norm.weight"),
        *KimiLinear.checkpoint_map,
    )
    published_map = ((r"model\.norm\.weight", r"model.final_layernorm.weight"), *IDENTITY)
    expert_module = "model.layers.{layer}.moe.experts.{expert}.{proj}"
    expert_projs = MappingProxyType({"gate": "w1", "up": "w3", "down": "w2"})

    def tiny_config(self, dims, size, quant):
        return {**super().tiny_config(dims, size, quant), "architectures": ["ToyLinearForCausalLM"],
                "model_type": "toy_linear"}
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def toy():
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(archs.REGISTRY, ToyLinear.name, ToyLinear())  # its registration
        yield


@pytest.fixture(scope="module")
def toy_dir(toy, tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("toy") / "model", "toy_linear", "tiny", seed=0)


def test_unregistered_it_is_an_unknown_architecture(monkeypatch):
    monkeypatch.delitem(archs.REGISTRY, ToyLinear.name, raising=False)
    raw = ToyLinear().tiny_config(SIZES["tiny"], "tiny", "")
    with pytest.raises(ConfigError, match=r"unknown architecture \(model_type='toy_linear'"):
        parse_config(raw)
    with pytest.raises(ValueError, match="--arch 'toy_linear': expected one of"):
        tiny_config("toy_linear", "tiny")


def test_registered_config_json_is_recognised_by_either_name(toy):
    raw = tiny_config("toy_linear", "tiny")
    assert parse_config(raw).arch == "toy_linear"
    assert parse_config({**raw, "model_type": None}).arch == "toy_linear"  # by its architectures list
    assert parse_config({**raw, "architectures": []}).arch == "toy_linear"  # by its model_type
    kimi = parse_config(tiny_config("kimi_linear", "tiny"))
    assert parse_config(raw) == dataclasses.replace(kimi, arch="toy_linear")  # Kimi Linear's model


def test_init_tiny_writes_its_layout_and_it_loads(toy_dir):
    assert load_config(toy_dir).arch == "toy_linear"
    with Checkpoint.open(toy_dir) as ckpt:
        names = set(ckpt.names())
    assert "model.final_layernorm.weight" in names and "model.norm.weight" not in names
    assert "model.layers.1.moe.experts.0.gate.weight" in names
    assert not any("block_sparse_moe.experts" in n for n in names)
    model, store = load_model(toy_dir, LoadOptions(dtype="float32"))
    with Checkpoint.open(toy_dir) as ckpt:
        assert torch.equal(model.model.norm.weight, ckpt.read("model.final_layernorm.weight").float())
    # the store indexes w1 / w3 / w2 from the published gate / up / down (the description's expert_projs)
    assert store.index.entries[(1, 0)] == {proj: {"weight": f"model.layers.1.moe.experts.0.{published}.weight"}
                                           for published, proj in (("gate", "w1"), ("up", "w3"), ("down", "w2"))}


def test_the_cli_writes_and_inspects_it(toy, tmp_path, capsys):
    """`moeswap init-tiny --arch` offers it and `inspect` reads it, with nothing but the registration."""
    assert main(["init-tiny", str(tmp_path / "m"), "--arch", "toy_linear", "--size", "tiny"]) == 0
    assert "wrote toy_linear" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "m"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["arch"] == "toy_linear"


@pytest.mark.parametrize("check", CHECKS, ids=check_id)
def test_it_keeps_the_contract(toy_dir, check):
    check(Tiny("toy_linear", "", toy_dir))
