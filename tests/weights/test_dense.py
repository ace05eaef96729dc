"""weights.dense and registry.choose_linear_method: which method a dense Linear gets at load (the one
question the loader asks), and that a model's layers keep their one method object through copies."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from moeswap.formats import fp8_block
from moeswap.ops import cpu_kernels
from moeswap.weights.dense import FLOAT_LINEAR, WeightLinear, kernel_of, linear_method, plain_weight
from moeswap.weights.floating import BF16_STORED
from moeswap.weights.fp8_block import FP8_BLOCK_KEPT
from moeswap.weights.registry import choose_linear_method

BF16 = {"weight": torch.bfloat16}
FP8 = {"weight": torch.float8_e4m3fn, "weight_scale_inv": torch.float32}
needs_kernel = pytest.mark.skipif(cpu_kernels.kernel() is None, reason="no CPU kernel")


@needs_kernel
@pytest.mark.parametrize("stored, dtypes, block, compute, device, dense_weights, keepable, want", [
    ("float", BF16, None, torch.float32, "cpu", "auto", True, BF16_STORED),
    ("float", BF16, None, torch.float32, "cpu", "compute", True, FLOAT_LINEAR),  # --dense-weights compute
    ("float", BF16, None, torch.float32, "cpu", "auto", False, FLOAT_LINEAR),  # a bias, or not a Linear's weight
    ("float", BF16, None, torch.bfloat16, "cpu", "auto", True, FLOAT_LINEAR),  # bf16 math: nothing to keep
    ("float", {"weight": torch.float16}, None, torch.float32, "cpu", "auto", True, FLOAT_LINEAR),
    ("float", BF16, None, torch.float32, "meta", "auto", True, FLOAT_LINEAR),  # not a CPU
    ("fp8_block", FP8, (128, 128), torch.float32, "cpu", "auto", True, FP8_BLOCK_KEPT),
    ("fp8_block", FP8, (128, 128), torch.float32, "cpu", "compute", True, FLOAT_LINEAR),
    ("fp8_block", FP8, (64, 64), torch.float32, "cpu", "auto", True, FLOAT_LINEAR),  # the kernel's blocks only
    ("fp8_block", {**FP8, "weight": torch.float8_e5m2}, (128, 128), torch.float32, "cpu", "auto", True, FLOAT_LINEAR),
    ("fp8_block", FP8, (128, 128), torch.bfloat16, "cpu", "auto", True, FLOAT_LINEAR),
])
def test_the_one_choice_of_a_dense_method(stored, dtypes, block, compute, device, dense_weights, keepable, want):
    assert choose_linear_method(stored, dtypes, block, compute, device, dense_weights, keepable) is want


def test_without_the_kernel_every_weight_is_decoded(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "kernel", lambda: None)
    assert choose_linear_method("float", BF16, None, torch.float32, "cpu", "auto", True) is FLOAT_LINEAR
    assert choose_linear_method("fp8_block", FP8, (128, 128), torch.float32, "cpu", "auto", True) is FLOAT_LINEAR


def test_a_layer_keeps_its_method_object_through_copies_and_names_its_tensors_as_stored():
    codes, scale = fp8_block.encode(torch.randn(200, 256, generator=torch.Generator().manual_seed(0)))
    layer = WeightLinear(256, 200, FP8_BLOCK_KEPT)
    FP8_BLOCK_KEPT.load_weights(layer, {"weight": codes, "weight_scale_inv": scale}, "cpu")
    assert set(layer.state_dict()) == {"weight", "weight_scale_inv"}
    again = copy.deepcopy(layer)
    assert again.method is FP8_BLOCK_KEPT and torch.equal(again.weight_scale_inv, layer.weight_scale_inv)
    assert pickle.loads(pickle.dumps(BF16_STORED)) is BF16_STORED  # by name, through the registry
    assert kernel_of(layer) == "fp8" and not plain_weight(layer) and "method=fp8_block" in repr(layer)


def test_the_method_of_any_module():
    plain = nn.Linear(4, 3, bias=False)
    assert linear_method(plain) is FLOAT_LINEAR and plain_weight(plain) and kernel_of(plain) is None
    kept = WeightLinear(4, 3, BF16_STORED)
    assert linear_method(kept) is BF16_STORED and plain_weight(kept) and kernel_of(kept) == "bf16"
    assert linear_method(nn.Sequential(plain)) is None and not plain_weight(nn.Sequential(plain))
