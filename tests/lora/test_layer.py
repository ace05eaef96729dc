"""LoRALinear against its definition, y = W x + s B A dropout(x), written out in float64."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from moeswap.lora import LoRALinear
from moeswap.weights.dense import WeightLinear
from moeswap.weights.floating import BF16_STORED


def make(base_cls=nn.Linear, dtype=torch.float32, r=4, alpha=8.0, **kw) -> LoRALinear:
    torch.manual_seed(0)
    base = base_cls(24, 40, bias=False)
    base.weight = nn.Parameter(torch.randn(40, 24).to(dtype), requires_grad=False)
    lora = LoRALinear.from_base(base, r, alpha, generator=torch.Generator().manual_seed(1), **kw)
    with torch.no_grad():
        lora.lora_B.weight.normal_(0, 0.3)
    return lora


def reference(lora: LoRALinear, x: torch.Tensor, scaling: float) -> torch.Tensor:
    W, A, B = (t.detach().double() for t in (lora.weight, lora.lora_A.weight, lora.lora_B.weight))
    return x.double() @ W.T + scaling * (x.double() @ A.T) @ B.T


def test_peft_initialisation():
    base = nn.Linear(24, 40, bias=False)
    lora = LoRALinear.from_base(base, 4, 8.0, generator=torch.Generator().manual_seed(3))
    # PEFT: B zeros; A kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in))
    assert torch.equal(lora.lora_B.weight, torch.zeros(40, 4))
    bound = 1 / math.sqrt(24)
    assert lora.lora_A.weight.abs().max() <= bound and lora.lora_A.weight.abs().max() > 0.8 * bound
    again = LoRALinear.from_base(nn.Linear(24, 40, bias=False), 4, 8.0, generator=torch.Generator().manual_seed(3))
    assert torch.equal(again.lora_A.weight, lora.lora_A.weight)  # seeded: reproducible
    x = torch.randn(5, 24)
    assert torch.equal(lora(x), base(x))  # B = 0: the base's output, bit for bit
    assert lora.weight is base.weight  # the same parameter under the same name
    assert set(dict(lora.named_parameters())) == {"weight", "lora_A.weight", "lora_B.weight"}


@pytest.mark.parametrize("use_rslora", [False, True])
def test_forward_is_the_definition(use_rslora):
    lora = make(use_rslora=use_rslora)
    scaling = 8.0 / math.sqrt(4) if use_rslora else 8.0 / 4
    assert lora.scaling == scaling
    x = torch.randn(3, 7, 24)
    torch.testing.assert_close(lora(x).double(), reference(lora, x, scaling), rtol=1e-5, atol=1e-5)


def test_bf16_stored_weight_runs_as_ops_linear():
    """A bf16 weight kept as stored (weights.floating.BF16_STORED) under fp32 math: the base part is ops.linear's."""
    lora = make(lambda i, o, bias: WeightLinear(i, o, BF16_STORED), torch.bfloat16)
    assert lora.lora_A.weight.dtype == torch.float32  # LoRA tensors stay fp32, as PEFT keeps them
    for rows in (1, 40):  # the decode kernel and the GEMM path
        x = torch.randn(rows, 24)
        torch.testing.assert_close(lora(x).double(), reference(lora, x, lora.scaling), rtol=1e-5, atol=1e-5)


def test_merge_and_unmerge():
    lora = make()
    x = torch.randn(6, 24)
    before, w0 = lora(x), lora.weight.detach().clone()
    lora.merge()
    assert lora.merged
    torch.testing.assert_close(lora(x), before, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lora.weight.double(), w0.double() + lora.delta_weight().double(), rtol=0, atol=1e-6)
    lora.unmerge()
    torch.testing.assert_close(lora.weight, w0, rtol=0, atol=1e-6)
    torch.testing.assert_close(lora(x), before, rtol=1e-5, atol=1e-5)


def test_folded_weight_is_the_layer():
    lora = make()
    x = torch.randn(6, 24)
    torch.testing.assert_close(x @ lora.folded_weight().T, lora(x), rtol=1e-5, atol=1e-5)
    assert lora.foldable


def test_dropout_acts_on_the_lora_input_while_training_only():
    lora = make(dropout=0.5)
    x = torch.randn(64, 24)
    lora.eval()
    torch.testing.assert_close(lora(x).double(), reference(lora, x, lora.scaling), rtol=1e-5, atol=1e-5)
    assert lora.foldable
    lora.train()
    assert not lora.foldable
    torch.manual_seed(5)
    got = lora(x)
    torch.manual_seed(5)
    mask_x = nn.functional.dropout(x, 0.5, training=True)
    want = x.double() @ lora.weight.double().T + lora.scaling * (mask_x.double() @ lora.lora_A.weight.double().T) \
        @ lora.lora_B.weight.double().T
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_gradients_reach_a_and_b_only():
    lora = make()
    x = torch.randn(5, 24, dtype=torch.float32)
    lora(x).square().sum().backward()
    assert lora.weight.grad is None
    # d/dB sum(y^2) = 2 s (y) (A x)^T, in float64
    y = reference(lora, x, lora.scaling)
    ax = x.double() @ lora.lora_A.weight.detach().double().T
    torch.testing.assert_close(lora.lora_B.weight.grad.double(), 2 * lora.scaling * y.T @ ax, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bad", [dict(r=0), dict(dropout=1.0)])
def test_bad_arguments(bad):
    with pytest.raises(ValueError):
        LoRALinear.from_base(nn.Linear(4, 4, bias=False), bad.get("r", 2), 4.0, bad.get("dropout", 0.0))
