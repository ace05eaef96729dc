"""DeepSeek block FP8: dequantisation multiplies by weight_scale_inv per 128x128 block (partial edge blocks
included), the encoder's round trip, and the config and shape errors."""

from __future__ import annotations

import math

import pytest
import torch

from moeswap.formats import fp8_block


def loop_dequant(weight: torch.Tensor, scale_inv: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    """The definition, one block at a time: W[i, j] = fp8[i, j] * scale_inv[i // 128, j // 128]."""
    out = torch.empty(weight.shape)
    for bi in range(scale_inv.shape[0]):
        for bj in range(scale_inv.shape[1]):
            rows = slice(bi * block[0], (bi + 1) * block[0])
            cols = slice(bj * block[1], (bj + 1) * block[1])
            out[rows, cols] = weight[rows, cols].float() * scale_inv[bi, bj]
    return out


@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (1, 129), (128, 128)])
def test_decode_multiplies_by_the_block_scale(shape):
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(shape, generator=gen) * 50).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(fp8_block.scale_shape(shape), generator=gen) * 0.01 + 1e-4
    out = fp8_block.decode(weight, scale_inv, dtype=torch.float32)
    assert torch.equal(out, loop_dequant(weight, scale_inv))
    assert fp8_block.decode(weight, scale_inv).dtype == torch.bfloat16


def test_known_values():
    weight = torch.zeros(130, 130).to(torch.float8_e4m3fn)
    weight[0, 0], weight[129, 129], weight[0, 129] = 448.0, -1.5, 2.0
    scale_inv = torch.tensor([[0.5, 4.0], [8.0, 0.25]])
    out = fp8_block.decode(weight, scale_inv, dtype=torch.float32)
    assert (out[0, 0].item(), out[129, 129].item(), out[0, 129].item()) == (224.0, -0.375, 8.0)


def test_encode_roundtrip_and_edge_blocks():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(300, 200, generator=gen) * torch.logspace(-3, 3, 300).unsqueeze(1)
    w[:128, :128] = 0.0  # a zero block: scale 1
    w[200, 150] = float("nan")  # poisons its block only
    q, scale_inv = fp8_block.encode(w)
    assert q.dtype == torch.float8_e4m3fn and scale_inv.shape == (3, 2) and scale_inv[0, 0] == 1.0
    assert math.isnan(scale_inv[1, 1].item())
    out = fp8_block.decode(q, scale_inv, dtype=torch.float32)
    assert out[:128, :128].eq(0).all()
    assert out[128:256, 128:].isnan().all()
    ok = torch.ones_like(w, dtype=torch.bool)
    ok[128:256, 128:] = False
    # E4M3 keeps 3 mantissa bits: relative error <= 2^-4 (plus the subnormal floor of each block).
    floor = fp8_block._expand(scale_inv, w.shape, fp8_block.BLOCK) * 2.0**-10
    assert ((out - w).abs() <= w.abs() * 2.0**-4 + floor)[ok].all()
    assert (q.float().abs() <= 448).all()


def test_block_size_from_config():
    assert fp8_block.block_size({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}) == (128, 128)
    with pytest.raises(ValueError, match=r"weight_block_size must be \[rows, cols\].*got \[128\]"):
        fp8_block.block_size({"quant_method": "fp8", "weight_block_size": [128]})
    with pytest.raises(ValueError, match="fmt 'e5m2' is not supported"):
        fp8_block.block_size({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]})


def test_decode_errors():
    weight = torch.zeros(256, 256).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"needs weight_scale_inv of shape \[2, 2\], found \[2, 1\]"):
        fp8_block.decode(weight, torch.ones(2, 1))
    with pytest.raises(ValueError, match=r"block \[64, 64\] needs weight_scale_inv of shape \[4, 4\]"):
        fp8_block.decode(weight, torch.ones(2, 2), block=(64, 64))
    with pytest.raises(ValueError, match="must be float8_e4m3fn, got dtype torch.bfloat16"):
        fp8_block.decode(weight.to(torch.bfloat16), torch.ones(2, 2))
    with pytest.raises(ValueError, match="weight_scale_inv must be a float tensor"):
        fp8_block.decode(weight, torch.ones(2, 2, dtype=torch.uint8))
