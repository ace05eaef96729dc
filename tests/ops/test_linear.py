"""ops.linear: bf16 weights under fp32 math equal the fp32 copy's result (kernel and GEMM paths, any
leading shape, gradients), and the loader keeps bf16-stored Linear weights only where that holds."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moeswap.engine.generate import GenerationConfig, generate
from moeswap.models.loader import LoadOptions, load_model
from moeswap.ops import cpu_kernels
from moeswap.ops.linear import KERNEL_MAX_ROWS, linear
from moeswap.weights.dense import WeightLinear, kernel_of


@pytest.mark.parametrize("rows", [1, 3, 16, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 1, 100])
def test_bf16_weight_matches_the_fp32_copy(rows):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(48, 80, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, 80, generator=gen)
    want = x @ w.float().T
    got = linear(x, w)
    assert got.dtype == torch.float32 and got.shape == (rows, 48)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=4e-6 * want.abs().max().item())
    torch.testing.assert_close(linear(x.reshape(1, rows, 80), w), want.reshape(1, rows, 48), rtol=2e-6,
                               atol=4e-6 * want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 8, 40, 150])
def test_a_slice_of_a_wider_matrix_gives_its_copy_s_bits(rows, dtype):
    """A fused product's part fed to the next product (rows 290 floats apart, 40 bytes off alignment) gives
    the bits of the same values in a tensor of their own, the unfused module's output: on an AMD EPYC (Zen 4)
    torch's GEMM differs for rows that are not 16-byte aligned unless linear aligns them (docs/numerics.md)."""
    gen = torch.Generator().manual_seed(rows)
    wide = torch.randn(rows, 290, generator=gen)
    x = wide[:, 10:42]
    for w in (torch.randn(n, 32, generator=gen).to(dtype) for n in (2, 4, 16, 64)):
        assert torch.equal(linear(x, w), linear(x.clone(), w))
        assert torch.equal(linear(x.unsqueeze(0), w), linear(x.clone().unsqueeze(0), w))


def test_same_dtype_and_gradients_use_torch():
    w = torch.randn(8, 16).to(torch.bfloat16)
    x = torch.randn(2, 16, requires_grad=True)
    linear(x, w).sum().backward()  # the C kernel has no backward: this must take the torch path
    torch.testing.assert_close(x.grad, w.float().sum(0).expand(2, 16))
    w32 = torch.randn(8, 16)
    assert torch.equal(linear(x.detach(), w32), torch.nn.functional.linear(x.detach(), w32))


def test_loader_keeps_bf16_linear_weights_and_tokens_do_not_change(tiny_k3_dir):
    stored, _ = load_model(tiny_k3_dir)
    converted, _ = load_model(tiny_k3_dir, LoadOptions(dense_weights="compute"))
    linears = [m for m in stored.modules() if isinstance(m, nn.Linear)]
    kept = [m for m in linears if kernel_of(m) == "bf16"]
    if cpu_kernels.kernel() is None:
        assert not kept
    else:
        assert kept and all(m.weight.dtype == torch.bfloat16 for m in kept)
    assert all(m.weight.dtype == torch.float32 for m in converted.modules() if isinstance(m, nn.Linear))
    assert stored.state_dict().keys() == converted.state_dict().keys()
    tokens = torch.tensor([[5, 9, 2, 7, 1, 3]])
    with torch.no_grad():
        a, b = stored(tokens), converted(tokens)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item())
    cfg = GenerationConfig(max_tokens=8, stop_ids=())
    assert generate(stored, [5, 9, 2], cfg).tokens == generate(converted, [5, 9, 2], cfg).tokens


def test_unknown_dense_weights_option(tiny_k3_dir):
    with pytest.raises(ValueError, match="--dense-weights 'half': expected one of auto, compute"):
        load_model(tiny_k3_dir, LoadOptions(dense_weights="half"))


def test_bf16_experts_stay_bf16_and_tokens_do_not_change(tiny_linear_dir):
    stored, store = load_model(tiny_linear_dir)
    converted, store_c = load_model(tiny_linear_dir, LoadOptions(dense_weights="compute"))
    kept = store.fetch(1, [0])[0]
    assert kept.w1_FI.dtype == (torch.float32 if cpu_kernels.kernel() is None else torch.bfloat16)
    assert store_c.fetch(1, [0])[0].w1_FI.dtype == torch.float32
    cfg = GenerationConfig(max_tokens=8, stop_ids=())
    assert generate(stored, [5, 9, 2], cfg).tokens == generate(converted, [5, 9, 2], cfg).tokens
    tokens = torch.tensor([[5, 9, 2, 7, 1, 3]])
    with torch.no_grad():
        torch.testing.assert_close(stored(tokens), converted(tokens), rtol=1e-4, atol=1e-4)


def test_many_rows_widen_into_a_reused_buffer_in_and_out_of_inference_mode(monkeypatch):
    """The fp32 copy of a bf16 weight for a GEMM lives in a per-thread buffer: the first use may be
    in inference mode (a scheduler step) and the next outside it; results stay exact each time."""
    from moeswap.ops import linear as linear_module

    monkeypatch.setattr(linear_module, "_scratch", threading.local())  # as in a fresh thread
    g = torch.Generator().manual_seed(3)
    small, large = torch.randn(16, 40, generator=g).bfloat16(), torch.randn(48, 40, generator=g).bfloat16()
    x = torch.randn(KERNEL_MAX_ROWS + 4, 40, generator=g)
    with torch.inference_mode():
        a = linear(x, large)
    b, c = linear(x, small), linear(x, large)
    for got, w in ((a, large), (b, small), (c, large)):
        assert torch.equal(got, F.linear(x, w.float()))
    assert linear_module._scratch.buf.numel() == large.numel()
    monkeypatch.setattr(linear_module, "WIDEN_SCRATCH_MAX", large.numel())  # bigger weights: a transient copy
    huge = torch.randn(64, 40, generator=g).bfloat16()
    assert torch.equal(linear(x, huge), F.linear(x, huge.float()))
    assert linear_module._scratch.buf.numel() == large.numel()


def _fp8_linear(out_features: int, in_features: int, seed: int = 0):
    """A block-FP8 kept Linear holding fp8_block.encode of a random weight (rows not a multiple of 128: a partial block)."""
    from moeswap.formats import fp8_block
    from moeswap.weights.fp8_block import FP8_BLOCK_KEPT

    w = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))
    codes, scale = fp8_block.encode(w)
    layer = WeightLinear(in_features, out_features, FP8_BLOCK_KEPT)
    FP8_BLOCK_KEPT.load_weights(layer, {"weight": codes, "weight_scale_inv": scale}, "cpu")
    return layer, fp8_block.decode(codes, scale, dtype=torch.float32)


@pytest.mark.skipif(cpu_kernels.kernel() is None, reason="no CPU kernel")
@pytest.mark.parametrize("rows", [1, 3, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 1])
def test_block_fp8_linear_computes_from_its_codes_as_the_decoded_weight(rows):
    """A block-FP8 kept Linear: decode-sized inputs run the quant kernel from the codes (its bits, the decoded weight's
    values to fp32 rounding), more rows (prefill) and autograd the decoded weight (formats/fp8_block.decode)."""
    layer, decoded = _fp8_linear(200, 256)
    assert torch.equal(layer.method.values(layer), decoded)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    with torch.no_grad():
        y = layer(x.view(rows, 1, 256)).view(rows, 200)
    if rows <= KERNEL_MAX_ROWS:
        assert torch.equal(y, cpu_kernels.kernel().quant_linear("fp8", x, layer.weight, layer.weight_scale_inv))
        torch.testing.assert_close(y, x @ decoded.T, rtol=1e-5, atol=1e-4)
    else:
        assert torch.equal(y, F.linear(x, decoded))
    xg = x.clone().requires_grad_()
    layer(xg).sum().backward()
    torch.testing.assert_close(xg.grad, decoded.sum(0).expand(rows, 256))


def test_a_lora_wrapper_over_block_fp8_weights_reads_their_values():
    """A LoRA wrapper reads and merges into `weight`: over a block-FP8 Linear it holds the decoded weight
    (what --dense-weights compute loads), so with B = 0 it gives the decoded weight's outputs."""
    from moeswap.lora.layer import LoRALinear
    from moeswap.lora.multi import AdapterRows, MultiLoRALinear

    layer, decoded = _fp8_linear(128, 64)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    for wrapped in (LoRALinear.from_base(layer, r=4, alpha=8), MultiLoRALinear(layer, AdapterRows(1))):
        assert torch.equal(wrapped.weight, decoded) and not wrapped.weight.requires_grad
        with torch.no_grad():
            assert torch.equal(wrapped(x), F.linear(x, decoded))
