"""Routed-expert LoRA through the MoE blocks' own hook (MoE.attach_expert_lora, models/layers/expert_lora.py):
attach_lora / load_adapter / save_adapter / detach_lora put it on, name it as PEFT would, load it back
(per-expert A, and the shared-A option), apply it in the forward, and refuse what does not fit before touching
the model. The expert math itself (gradients, kernels, the store) is tests/experts/test_expert_training.py's."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from moeswap.lora import (
    MOESWAP_NAME,
    WEIGHTS_NAME,
    LoRAConfig,
    attach_lora,
    detach_lora,
    load_adapter,
    lora_modules,
    save_adapter,
    trainable_parameters,
)

KEY = "base_model.model.language_model.model.layers.{layer}.block_sparse_moe.experts.{e}.{p}.lora_{x}.weight"


def expert_params(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if ".expert_lora." in n}


@pytest.mark.parametrize("shared_a", [False, True])
def test_routed_experts_through_the_block_hook(load, tiny_k3_dir, tmp_path, tokens, randomize_b, shared_a):
    model = load(tiny_k3_dir)
    with torch.no_grad():
        base = model(tokens)
    cfg = LoRAConfig(r=4, alpha=8, dropout=0.1, target_modules=("q_proj", "w1", "w3"), use_rslora=True,
                     expert_shared_a=shared_a)
    targets = attach_lora(model, cfg, generator=torch.Generator().manual_seed(0))
    blocks = model.moe_blocks()
    assert targets.experts == {f"model.layers.{b.layer_idx}.block_sparse_moe": ("w1", "w3") for b in blocks}
    for b in blocks:
        lora = b.expert_lora
        assert (lora.rank, lora.scaling, lora.dropout, lora.projections, lora.shared_a) == (4, 8 / 2, 0.1, ("w1", "w3"),
                                                                                             shared_a)  # rsLoRA
        F, I = b.expert_shapes["w1"]
        assert lora.lora_A["w1"].shape == (1 if shared_a else b.num_experts, 4, I)
        assert lora.lora_B["w3"].shape == (b.num_experts, F, 4) and not lora.lora_B["w3"].any()
    names = set(trainable_parameters(model))
    assert set(expert_params(model)) == {f"model.layers.{b.layer_idx}.block_sparse_moe.expert_lora.lora_{x}.{p}"
                                         for b in blocks for p in ("w1", "w3") for x in "AB"}
    assert len(names) == 4 * len(blocks) + 2 * len(targets.linears)  # everything else frozen
    # the generator fixes the experts' A as it does the dense ones'
    again = load(tiny_k3_dir)
    attach_lora(again, cfg, generator=torch.Generator().manual_seed(0))
    assert all(torch.equal(a, b) for a, b in zip(expert_params(model).values(), expert_params(again).values()))

    randomize_b(model)
    model.eval()
    with torch.no_grad():
        adapted = model(tokens)
    assert (adapted - base).abs().max() > 0.1
    save_adapter(model, tmp_path / "a")
    b2 = blocks[1]
    with safe_open(tmp_path / "a" / WEIGHTS_NAME, "pt") as f:
        key = KEY.format(layer=b2.layer_idx, e=7, p="w3", x="B")
        assert torch.equal(f.get_tensor(key), b2.expert_lora.lora_B["w3"][7])
        a = [f.get_tensor(KEY.format(layer=b2.layer_idx, e=e, p="w1", x="A")) for e in range(b2.num_experts)]
        assert all(torch.equal(t, b2.expert_lora.lora_A["w1"][0 if shared_a else e]) for e, t in enumerate(a))
        assert sum(".experts." in k for k in f.keys()) == len(blocks) * b2.num_experts * 2 * 2  # PEFT: per expert
    assert json.loads((tmp_path / "a" / MOESWAP_NAME).read_text())["expert_shared_a"] == shared_a

    fresh = load(tiny_k3_dir)
    load_adapter(fresh, tmp_path / "a", trainable=True)
    assert all(torch.equal(a, b) for a, b in zip(expert_params(model).values(), expert_params(fresh).values()))
    assert set(trainable_parameters(fresh)) == names and fresh.moe_blocks()[0].expert_lora.shared_a == shared_a
    with torch.no_grad():
        assert torch.equal(fresh.eval()(tokens), adapted)
    with pytest.raises(ValueError, match="merging routed-expert LoRA into a loaded model is not supported"):
        detach_lora(fresh, merge=True)
    detach_lora(fresh)
    assert not trainable_parameters(fresh) and not any("expert_lora" in b._modules for b in fresh.moe_blocks())
    with torch.no_grad():
        assert torch.equal(fresh(tokens), base)


def test_an_expert_adapter_that_does_not_fit_is_refused_before_anything_changes(load, tiny_k3_dir, tmp_path,
                                                                               randomize_b):
    model = load(tiny_k3_dir)
    attach_lora(model, LoRAConfig(r=4, target_modules=("q_proj", "w2")), generator=torch.Generator().manual_seed(0))
    randomize_b(model)
    save_adapter(model, tmp_path / "a")
    # a per-expert adapter declared as shared-A: its experts' A differ
    raw = json.loads((tmp_path / "a" / MOESWAP_NAME).read_text())
    raw["expert_shared_a"] = True
    (tmp_path / "a" / MOESWAP_NAME).write_text(json.dumps(raw))
    fresh = load(tiny_k3_dir)
    with pytest.raises(ValueError, match=r"does not fit this model: adapter has different lora_A weights per expert"):
        load_adapter(fresh, tmp_path / "a")
    assert not lora_modules(fresh) and not any("expert_lora" in b._modules for b in fresh.moe_blocks())
    assert getattr(fresh, "lora_config", None) is None
