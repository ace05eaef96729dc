"""The integer dense weights' C products (csrc/int8.c for INT8 channel weights; csrc/quant.c's INT4 for the
pack-quantized dense method) against the formats' plain-torch decoders, in every build this machine runs
(MOESWAP_KERNEL_ISA's levels): the kernel's weights are the decoder's bit for bit (one-hot inputs read each
column exactly), and decode- and prefill-sized products stay within fp32 summation's error bound of the float64
product; the dense methods (weights.int8 / weights.int4) give the same from a Linear at every size, the
prefill path's row chunks included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeswap.formats import int4, int8
from moeswap.ops import cpu_kernels
from moeswap.ops.linear import KERNEL_MAX_ROWS
from moeswap.weights import codes_linear
from moeswap.weights.dense import WeightLinear
from moeswap.weights.int4 import INT4, INT4_KEPT
from moeswap.weights.int8 import INT8, INT8_KEPT
from numerics import gamma

BUILDS = cpu_kernels.build_variants()
BUILD_IDS = ["native" if f is None else " ".join(f) for f in BUILDS]


def _kernel(flags):
    kernel = cpu_kernels.kernel(flags)
    if kernel is None:
        pytest.skip(f"the kernel does not build here: {cpu_kernels.build_error()}")
    return kernel


def _run(kernel, kind, x, stored):
    if kind == "int8":
        return kernel.int8_linear(x, stored["weight"], stored["weight_scale"])
    return kernel.quant_linear("int4", x, stored["weight_packed"], stored["weight_scale"])


FMT = {"int8": INT8, "int4": INT4}


@pytest.mark.parametrize("flags", BUILDS, ids=BUILD_IDS)
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_the_kernels_weights_are_the_decoders_bit_for_bit(flags, kind):
    """Every int8 code -127..127 (and INT4's -8..7) under scales from tiny to huge: x = I's rows read W's
    columns one at a time, so y = W^T exactly."""
    kernel = _kernel(flags)
    gen = torch.Generator().manual_seed(1)
    O, I = 24, 256
    w = torch.randn(O, I, generator=gen) * torch.logspace(-30, 30, O).unsqueeze(1)
    w[0, :] = torch.arange(-127, 129)[:I].clamp(max=127).float()  # every code once
    stored = FMT[kind].encode(w)
    W = FMT[kind].decode(stored, torch.float32)
    got = _run(kernel, kind, torch.eye(I), stored)
    assert torch.equal(got + 0.0, W.T.contiguous() + 0.0)  # + 0.0: -0 and +0 alike


@pytest.mark.parametrize("flags", BUILDS, ids=BUILD_IDS)
@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 5, KERNEL_MAX_ROWS, 70])  # decode sizes, and a prefill-sized call
def test_the_kernels_products_are_within_fp32_summation_error(flags, kind, rows):
    kernel = _kernel(flags)
    gen = torch.Generator().manual_seed(rows)
    O, I = 67, 320
    stored = FMT[kind].encode(torch.randn(O, I, generator=gen) * 0.05)
    W = FMT[kind].decode(stored, torch.float64)
    x = torch.randn(rows, I, generator=gen)
    exact = x.double() @ W.T
    bound = gamma(I) * (x.double().abs() @ W.abs().T)
    got = _run(kernel, kind, x, stored).double()
    assert ((got - exact).abs() <= bound).all()


@pytest.mark.parametrize("flags", BUILDS, ids=BUILD_IDS)
def test_int4_decode_is_the_decoder_bit_for_bit(flags):
    """csrc/quant.c's int4_decode (the dense method's prefill chunks) against formats.int4.decode in fp32: every
    code under scales from tiny to huge, subnormal and NaN scales and their rounding to bf16 included."""
    kernel = _kernel(flags)
    gen = torch.Generator().manual_seed(3)
    O, I = 40, 320
    w = torch.randn(O, I, generator=gen) * torch.logspace(-38, 37, O).unsqueeze(1)
    q, scale = int4.encode(w)
    q[0, :2] = int4.pack(torch.arange(-8, 8, dtype=torch.int8).repeat(1, 1))  # every code once
    scale[1, 3], scale[2, 0], scale[3, 9] = float("nan"), 3e-39, -1e-40  # NaN, subnormal scales
    scale[4] = torch.randn(I // 32, generator=gen).to(torch.bfloat16) * 1.01  # mantissas that round
    expected = int4.decode(q, scale, (O, I), torch.float32)
    got = kernel.int4_decode(q, scale)
    assert torch.equal(got.isnan(), expected.isnan()) and expected.isnan().any()
    assert torch.equal(got.nan_to_num() + 0.0, expected.nan_to_num() + 0.0)
    out = torch.full((O * I,), 7.0)
    assert kernel.int4_decode(q[5:9], scale[5:9], out=out[: 4 * I]).data_ptr() == out.data_ptr()
    assert torch.equal(out[: 4 * I].view(4, I), expected[5:9])
    with pytest.raises(ValueError, match="int4_decode"):
        kernel.int4_decode(q, scale.float())


@pytest.mark.parametrize("method, fmt", [(INT8_KEPT, INT8), (INT4_KEPT, INT4)], ids=["int8", "int4"])
@pytest.mark.parametrize("rows", [1, KERNEL_MAX_ROWS, 100])
def test_the_dense_methods_multiply_the_decoded_weight(method, fmt, rows, monkeypatch):
    """A WeightLinear of each method: decode-sized inputs (the kernel) and prefill-sized ones (decoded row chunks,
    made small here so a 70-row weight takes several) both within the bound of x @ decode(stored)^T."""
    if cpu_kernels.kernel() is None:
        pytest.skip("no CPU kernel here")
    monkeypatch.setattr(codes_linear, "PREFILL_CHUNK_BYTES", 16 * 96 * 4)  # 16 rows of 96 inputs a chunk
    gen = torch.Generator().manual_seed(rows)
    O, I = 70, 96
    stored = fmt.encode(torch.randn(O, I, generator=gen))
    layer = WeightLinear(I, O, method)
    method.load_weights(layer, stored, "cpu")
    W = fmt.decode(stored, torch.float64)
    assert torch.equal(method.values(layer), fmt.decode(stored, torch.float32))
    x = torch.randn(2, rows, I, generator=gen)
    with torch.no_grad():
        got = layer(x).double()
    exact = x.double() @ W.T
    assert got.shape == (2, rows, O)
    assert ((got - exact).abs() <= gamma(I) * (x.double().abs() @ W.abs().T)).all()
    # and a gradient through it (LoRA over a quantised base): dx = dy W
    xg = x.clone().requires_grad_(True)
    dy = torch.randn(2, rows, O, generator=gen)
    layer(xg).backward(dy)
    torch.testing.assert_close(xg.grad.double(), dy.double() @ W, rtol=1e-5, atol=1e-5)


def test_int8_codec():
    """encode: one scale per row = amax / 127, codes round to nearest; zero rows get scale 1; NaN rows NaN."""
    w = torch.tensor([[1.0, -0.5, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0], [3.0, float("nan"), 1.0, 0.0]])
    q, s = int8.encode(w)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (3, 1)
    assert q[0].tolist() == [127, -64, 32, 0] and s[0, 0] == torch.tensor(1.0) / 127
    assert s[1, 0] == 1.0 and q[1].abs().sum() == 0 and s[2, 0].isnan()
    assert int8.decode(q, s, torch.float32)[2].isnan().all()
    with pytest.raises(ValueError, match="one per output row"):
        int8.decode(q, s.T.contiguous())
    g = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    back = int8.decode(*int8.encode(g), dtype=torch.float32)
    # round to nearest: the error is at most half a step per row
    assert ((back - g).abs() <= g.abs().amax(1, keepdim=True) / 127 / 2 * (1 + 1e-6)).all()
    back4 = int4.decode(*int4.encode(g), (64, 256), torch.float32)
    assert F.mse_loss(back, g) < F.mse_loss(back4, g) / 50  # 8 bits per row beat 4 bits per 32
