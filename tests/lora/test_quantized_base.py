"""LoRA over a base whose dense weights are kept as integer codes (--dense-weights int8|int4): the wrappers read
the method's decoded values, so the adapted model's logits and its LoRA gradients are those of the same adapter on
a base holding those values as plain fp32 weights, within rounding (tests/numerics.py), and the codes get no
gradient."""

from __future__ import annotations

import pytest
import torch

from moeswap.lora import LoRAConfig, attach_lora, trainable_parameters
from moeswap.weights.dense import WeightLinear
from numerics import assert_within_rounding

TARGETS = ("q_proj", "k_proj", "v_proj", "g_proj", "o_proj", "q_b_proj", "kv_b_proj", "mlp.down_proj",
           "shared_experts.gate_proj", "routed_expert_up_proj", "lm_head")


def _values_twin(load, path, quantized, dtype):
    """`path` loaded with plain weights, every Linear `quantized` keeps as codes set to its decoded values."""
    twin = load(path, dense_weights="compute").to(dtype)
    with torch.no_grad():
        for name, m in quantized.named_modules():
            if isinstance(m, WeightLinear) and m.method.codes is not None:
                twin.get_submodule(name).weight.copy_(m.method.values(m).to(dtype))
    return twin


def _run(model, config, tokens, weights):
    attach_lora(model, config, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for name, p in trainable_parameters(model).items():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    loss = (model(tokens).double() * weights).sum()
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in trainable_parameters(model).items()}


@pytest.mark.parametrize("dense", ["int8", "int4"])
def test_lora_over_codes_trains_as_over_their_values(load, tiny_k3_dir, tokens, dense):
    config = LoRAConfig(r=2, alpha=4, target_modules=TARGETS)
    quantized = load(tiny_k3_dir, dense_weights=dense)
    assert any(isinstance(m, WeightLinear) and m.method.codes for m in quantized.modules())
    plain, exact = (_values_twin(load, tiny_k3_dir, quantized, d) for d in (torch.float32, torch.float64))
    weights = torch.randn(*tokens.shape, quantized.config.vocab_size, dtype=torch.float64,
                          generator=torch.Generator().manual_seed(3))
    got_loss, got = _run(quantized, config, tokens, weights)
    want_loss, want = _run(plain, config, tokens, weights)
    exact_loss, exact_grads = _run(exact, config, tokens, weights)
    assert set(got) == set(want) and got
    assert_within_rounding(got_loss, want_loss, exact_loss)
    for name in got:
        assert_within_rounding(got[name], want[name], exact_grads[name])
    assert all(not p.requires_grad for n, p in quantized.named_parameters() if n.endswith(("weight_packed", "weight_scale")))
