"""Adapters on disk: PEFT's files and names, a round trip, the base fingerprint, and every way an adapter can fail
to fit (one ValueError naming the problems, before anything is applied)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moeswap.formats.checkpoint import Checkpoint
from moeswap.lora import (
    CONFIG_NAME,
    MOESWAP_NAME,
    WEIGHTS_NAME,
    LoRAConfig,
    attach_lora,
    fingerprint,
    load_adapter,
    lora_modules,
    save_adapter,
)

TARGETS = ("q_proj", "kv_b_proj", "shared_experts.gate_proj", "lm_head")


@pytest.fixture
def adapted(load, tiny_k3_dir, randomize_b):
    model = load(tiny_k3_dir)
    attach_lora(model, LoRAConfig(r=4, alpha=8, dropout=0.05, target_modules=TARGETS, use_rslora=True),
                generator=torch.Generator().manual_seed(0))
    randomize_b(model)
    return model


def test_files_are_peft_format(adapted, tiny_k3_dir, tmp_path, strict_json):
    out = save_adapter(adapted, tmp_path / "a", base_model="tiny-k3", base_fingerprint=fingerprint(tiny_k3_dir))
    assert sorted(p.name for p in out.iterdir()) == sorted([CONFIG_NAME, WEIGHTS_NAME, MOESWAP_NAME])
    cfg = strict_json((out / CONFIG_NAME).read_text())
    assert "moeswap" not in cfg  # PEFT's keys only: PEFT would warn of an unexpected one
    assert {k: cfg[k] for k in ("peft_type", "task_type", "r", "lora_alpha", "lora_dropout", "target_modules", "bias",
                                "fan_in_fan_out", "use_rslora", "base_model_name_or_path", "use_dora")} == {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8, "lora_dropout": 0.05,
        "target_modules": sorted(TARGETS), "bias": "none", "fan_in_fan_out": False, "use_rslora": True,
        "base_model_name_or_path": "tiny-k3", "use_dora": False}
    ours = strict_json((out / MOESWAP_NAME).read_text())
    assert ours == {"format_version": 1, "base_fingerprint": fingerprint(tiny_k3_dir), "expert_shared_a": False}
    with safe_open(out / WEIGHTS_NAME, "pt") as f:
        keys = set(f.keys())
        loras = lora_modules(adapted)
        # K3's checkpoint names carry the multimodal wrapper's prefix, and so do the adapter's
        assert keys == {f"base_model.model.language_model.{n}.lora_{p}.weight" for n in loras for p in "AB"}
        name = "model.layers.3.self_attn.kv_b_proj"
        assert torch.equal(f.get_tensor(f"base_model.model.language_model.{name}.lora_B.weight"),
                           loras[name].lora_B.weight)


def test_round_trip(adapted, load, tiny_k3_dir, tmp_path, tokens):
    save_adapter(adapted, tmp_path / "a", base_fingerprint=fingerprint(tiny_k3_dir))
    fresh = load(tiny_k3_dir)
    cfg = load_adapter(fresh, tmp_path / "a", base_dir=tiny_k3_dir)
    assert cfg == adapted.lora_config
    with torch.no_grad():
        assert torch.equal(fresh(tokens), adapted.eval()(tokens))
    for lora in lora_modules(fresh).values():
        assert lora.scaling == 8 / 2 and lora.lora_dropout.p == 0.05  # rsLoRA: alpha / sqrt(r)
        assert not lora.lora_A.weight.requires_grad
    with pytest.raises(ValueError, match="already carries a LoRA adapter"):
        load_adapter(fresh, tmp_path / "a")
    save_adapter(fresh, tmp_path / "b")  # a loaded adapter saves again, the same tensors
    assert (tmp_path / "a" / WEIGHTS_NAME).read_bytes() == (tmp_path / "b" / WEIGHTS_NAME).read_bytes()


@pytest.mark.parametrize("linked", [CONFIG_NAME, WEIGHTS_NAME, MOESWAP_NAME])
def test_an_adapter_file_linked_out_of_its_directory_is_refused(adapted, load, tiny_k3_dir, tmp_path, linked):
    """Adapter directories follow the model directories' rule: a file may not resolve outside its directory
    (a linked adapter_config.json is not even parsed: its target here is not JSON)."""
    save_adapter(adapted, tmp_path / "a")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.move(tmp_path / "a" / linked, elsewhere / linked)
    (tmp_path / "a" / linked).symlink_to(elsewhere / linked)
    with pytest.raises(ValueError, match=f"'{linked}' is a link that resolves outside"):
        load_adapter(load(tiny_k3_dir), tmp_path / "a")


def test_an_adapter_older_moeswap_wrote_still_loads(adapted, load, tiny_k3_dir, copy_model, tmp_path, tokens):
    """Before moeswap_adapter.json, moeswap's section was a `moeswap` key of adapter_config.json: such an
    adapter loads with the same logits, and its recorded base fingerprint is still checked."""
    save_adapter(adapted, tmp_path / "a", base_fingerprint=fingerprint(tiny_k3_dir))
    raw = json.loads((tmp_path / "a" / CONFIG_NAME).read_text())
    raw["moeswap"] = json.loads((tmp_path / "a" / MOESWAP_NAME).read_text())
    (tmp_path / "a" / CONFIG_NAME).write_text(json.dumps(raw))
    (tmp_path / "a" / MOESWAP_NAME).unlink()
    fresh = load(tiny_k3_dir)
    assert load_adapter(fresh, tmp_path / "a", base_dir=tiny_k3_dir) == adapted.lora_config
    with torch.no_grad():
        assert torch.equal(fresh(tokens), adapted.eval()(tokens))
    other = copy_model(tiny_k3_dir)
    (other / "config.json").write_text((other / "config.json").read_text() + " ")
    with pytest.raises(ValueError, match="was made for a different base model"):
        load_adapter(load(other), tmp_path / "a", base_dir=other)


def test_save_refusals(adapted, load, tiny_k3_dir, tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(FileExistsError):
        save_adapter(adapted, tmp_path / "full")
    with pytest.raises(ValueError, match="carries no LoRA adapter"):
        save_adapter(load(tiny_k3_dir), tmp_path / "none")
    assert not (tmp_path / "none").exists()


def test_fingerprint(tiny_k3_dir, copy_model):
    fp = fingerprint(tiny_k3_dir)
    assert fp == fingerprint(tiny_k3_dir) and len(fp["samples"]) == 4
    assert fingerprint(copy_model(tiny_k3_dir, "same"))["digest"] == fp["digest"]  # where it lies does not count
    changed = copy_model(tiny_k3_dir, "bytes")
    name = sorted(fp["samples"])[1]
    with Checkpoint.open(changed) as ckpt:
        info = ckpt.info(name)
    with open(info.file, "r+b") as f:  # one byte of a sampled tensor
        f.seek(info.offset)
        byte = f.read(1)
        f.seek(info.offset)
        f.write(bytes([byte[0] ^ 1]))
    other = fingerprint(changed)
    assert other["digest"] != fp["digest"] and other["config_sha256"] == fp["config_sha256"]
    assert other["samples"][name] != fp["samples"][name]
    config = copy_model(tiny_k3_dir, "config")
    (config / "config.json").write_text((config / "config.json").read_text() + "\n")
    assert fingerprint(config)["config_sha256"] != fp["config_sha256"]


def test_a_different_base_is_refused(adapted, load, tiny_k3_dir, tiny_linear_dir, copy_model, tmp_path):
    save_adapter(adapted, tmp_path / "a", base_fingerprint=fingerprint(tiny_k3_dir))
    other = copy_model(tiny_k3_dir)
    (other / "config.json").write_text((other / "config.json").read_text() + " ")
    model = load(other)
    with pytest.raises(ValueError, match=r"was made for a different base model than .* \(config.json differ\)"):
        load_adapter(model, tmp_path / "a", base_dir=other)
    assert not lora_modules(model)  # nothing applied


def edit(src, dst, tensors=None, config=None):
    """A copy of adapter `src` with its tensors and/or config changed by the given functions."""
    shutil.copytree(src, dst)
    if tensors is not None:
        with safe_open(src / WEIGHTS_NAME, "pt") as f:
            got = tensors({k: f.get_tensor(k) for k in f.keys()})
        save_file(got, dst / WEIGHTS_NAME)
    if config is not None:
        raw = json.loads((src / CONFIG_NAME).read_text())
        config(raw)
        (dst / CONFIG_NAME).write_text(json.dumps(raw))
    return dst


KV_B = "base_model.model.language_model.model.layers.3.self_attn.kv_b_proj"


@pytest.mark.parametrize("case, fragments", [
    ("wrong shape", ["1 problem", "model.layers.3.self_attn.kv_b_proj: lora_A [4, 31]", "expected [4, 32]"]),
    ("unknown module", ["has no Linear module 'model.layers.3.self_attn.nope_proj'"]),
    ("half a pair", ["kv_b_proj: has lora_A without lora_B"]),
    ("not lora", ["model.norm.magic: not a LoRA tensor name"]),
    ("rank", ["do not fit a rank-8 LoRA"]),
    ("dora", ["use_dora = True is not supported"]),
    ("not lora type", ["peft_type is 'IA3'"]),
    ("base copy", ["replaces the base weight lm_head.weight with other values"]),
])
def test_adapters_that_do_not_fit(adapted, load, tiny_k3_dir, tmp_path, case, fragments):
    save_adapter(adapted, tmp_path / "a")
    src = tmp_path / "a"
    edits = {
        "wrong shape": dict(tensors=lambda t: {**t, f"{KV_B}.lora_A.weight":
                                               t[f"{KV_B}.lora_A.weight"][:, :31].contiguous()}),
        "unknown module": dict(tensors=lambda t: {k.replace("kv_b_proj", "nope_proj"): v for k, v in t.items()}),
        "half a pair": dict(tensors=lambda t: {k: v for k, v in t.items() if k != f"{KV_B}.lora_B.weight"}),
        "not lora": dict(tensors=lambda t: {**t, "base_model.model.language_model.model.norm.magic": torch.ones(2)}),
        "rank": dict(config=lambda c: c.update(r=8)),
        "dora": dict(config=lambda c: c.update(use_dora=True)),
        "not lora type": dict(config=lambda c: c.update(peft_type="IA3")),
        "base copy": dict(tensors=lambda t: {**t, "base_model.model.language_model.lm_head.base_layer.weight":
                                             torch.zeros(512, 64)}),
    }
    bad = edit(src, tmp_path / "bad", **edits[case])
    model = load(tiny_k3_dir)
    with pytest.raises(ValueError) as err:
        load_adapter(model, bad)
    assert "\n" not in str(err.value)
    for fragment in fragments:
        assert fragment in str(err.value)
    assert not lora_modules(model) and all(not p.requires_grad for p in model.parameters())


def test_missing_files(load, tiny_k3_dir, tmp_path):
    model = load(tiny_k3_dir)
    with pytest.raises(FileNotFoundError, match="expected an adapter directory"):
        load_adapter(model, tmp_path / "nothing")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / CONFIG_NAME).write_text("{}")
    with pytest.raises(FileNotFoundError, match=f"{WEIGHTS_NAME}: missing"):
        load_adapter(model, tmp_path / "half")
