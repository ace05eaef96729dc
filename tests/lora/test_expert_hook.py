"""The plumbing to routed-expert LoRA, which the MoE block provides (MoE.attach_expert_lora, detach_expert_lora,
expert_lora_state_dict, load_expert_lora_state_dict): here a stand-in block API that only keeps tensors, so the
targeting, freezing, PEFT key names and loading are checked on their own (the expert math is tested with it)."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn
from safetensors import safe_open

from moeswap.lora import LoRAConfig, WEIGHTS_NAME, attach_lora, detach_lora, load_adapter, save_adapter
from moeswap.lora import trainable_parameters


def give_hook(block, calls: list):
    """The MoE expert-LoRA API on `block`: per-expert A [r, in] and B [out, r] parameters, names as documented."""
    I, F = block.routed_expert_down_proj.out_features, block.shared_experts.gate_proj.out_features
    shapes = {"w1": (I, F), "w3": (I, F), "w2": (F, I)}  # (in, out)

    def attach(self, rank, alpha, dropout, projections=("w1", "w2", "w3"), shared_a=False):
        calls.append((self.layer_idx, rank, alpha, dropout, tuple(projections), shared_a))
        self.expert_lora = nn.ParameterDict()
        for p in projections:
            fan_in, out = shapes[p]
            self.expert_lora[f"{p}_A"] = nn.Parameter(torch.randn(self.num_experts, rank, fan_in))
            self.expert_lora[f"{p}_B"] = nn.Parameter(torch.randn(self.num_experts, out, rank))

    def state(self):
        out = {}
        for key, t in getattr(self, "expert_lora", {}).items():
            p, part = key.split("_")
            for e in range(self.num_experts):
                out[f"model.layers.{self.layer_idx}.block_sparse_moe.experts.{e}.{p}.lora_{part}.weight"] = t[e]
        return out

    def load(self, sd):
        for key, t in sd.items():
            e, p, part = key.split(".")[-4], key.split(".")[-3], key.split(".")[-2][-1]
            with torch.no_grad():
                self.expert_lora[f"{p}_{part}"][int(e)].copy_(t)

    def detach(self):
        del self.expert_lora

    for name, fn in (("attach_expert_lora", attach), ("expert_lora_state_dict", state),
                     ("load_expert_lora_state_dict", load), ("detach_expert_lora", detach)):
        setattr(block, name, types.MethodType(fn, block))


def test_routed_experts_through_the_block_hook(load, tiny_k3_dir, tmp_path):
    calls: list = []
    model = load(tiny_k3_dir)
    for block in model.moe_blocks():
        give_hook(block, calls)
    cfg = LoRAConfig(r=4, alpha=8, dropout=0.1, target_modules=("q_proj", "w1", "w3"), use_rslora=True)
    targets = attach_lora(model, cfg)
    assert calls == [(i, 4, 8 * 2.0, 0.1, ("w1", "w3"), False) for i in range(1, 6)]  # rsLoRA: alpha sqrt(r)
    names = set(trainable_parameters(model))
    assert {n for n in names if "expert_lora" in n} == {f"model.layers.{i}.block_sparse_moe.expert_lora.{p}_{x}"
                                                        for i in range(1, 6) for p in ("w1", "w3") for x in "AB"}
    assert len(names) == 4 * 5 + 2 * len(targets.linears)  # everything else frozen
    save_adapter(model, tmp_path / "a")
    with safe_open(tmp_path / "a" / WEIGHTS_NAME, "pt") as f:
        key = "base_model.model.language_model.model.layers.2.block_sparse_moe.experts.7.w3.lora_B.weight"
        assert torch.equal(f.get_tensor(key), model.moe_blocks()[1].expert_lora["w3_B"][7])
        assert sum(".experts." in k for k in f.keys()) == 5 * 16 * 2 * 2

    fresh = load(tiny_k3_dir)
    calls.clear()
    for block in fresh.moe_blocks():
        give_hook(block, calls)
    load_adapter(fresh, tmp_path / "a", trainable=True)
    assert calls == [(i, 4, 8 * 2.0, 0.1, ("w1", "w3"), False) for i in range(1, 6)]
    for a, b in zip(model.moe_blocks(), fresh.moe_blocks()):
        for key in a.expert_lora:
            assert torch.equal(a.expert_lora[key], b.expert_lora[key])
    assert set(trainable_parameters(fresh)) == names
    with pytest.raises(ValueError, match="merging routed-expert LoRA into a loaded model is not supported yet"):
        detach_lora(fresh, merge=True)
    detach_lora(fresh)
    assert not trainable_parameters(fresh) and not any(hasattr(b, "expert_lora") for b in fresh.moe_blocks())
