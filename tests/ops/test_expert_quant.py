"""Block-FP8 and INT4 experts computed from their stored bytes (ops/expert_quant.py, csrc/quant.c) against the
formats' plain-torch decoders (formats/fp8_block.decode: the published W = fp8 * scale_inv; formats/int4.decode:
compressed-tensors' bf16 products): the kernel's weights are the decoder's bit for bit on every E4M3 code
(NaN codes, -0, ±448, subnormals) under extreme scales and on every INT4 nibble in every position under
extreme and random bf16 scales, in every build; experts and projections (forward, backward, the GEMM path)
match decode-then-matmul; a kept expert whose bytes cannot give finite weights is named."""

from __future__ import annotations

import math

import pytest
import torch

from moeswap.formats import fp8_block, int4
from moeswap.ops import cpu_kernels, expert_quant
from moeswap.ops.expert import FP8ExpertWeights, Int4ExpertWeights
from moeswap.weights.autograd import Held, train_forward
from moeswap.weights.fp8_block import FP8_BLOCK
from moeswap.weights.int4 import INT4
from moeswap.weights.registry import format_of, run_expert

BUILDS = cpu_kernels.build_variants(without_vbmi=True)
BUILD_IDS = ["native" if f is None else " ".join(f) for f in BUILDS]
BETAS = (4.0, 25.0)

# FP8 block scales: zero, the smallest subnormal, the fold limit 2^8 (one product below it, two from it), a
# product past fp32's range, Inf, NaN, negative
FP8_SCALES = [0.0, 2.0 ** -149, 2.0 ** -126, 1e-30, 1.0 / 448, 1.0, 255.99998, 256.0, 1e5, 3e38, math.inf,
              -math.inf, math.nan, -0.75]
# bf16 scales: the smallest subnormal, the largest finite (products overflow), ones whose products round
INT4_SCALES = [0.0, 2.0 ** -133, 2.0 ** -126, 1.0, -1.0, 1.0078125, 1.9921875, 3.3895e38, -3.3895e38, math.inf,
               math.nan, 0.0123]


def _kernel(flags):
    kernel = cpu_kernels.kernel(flags)
    if kernel is None:
        pytest.skip(f"the kernel does not build here: {cpu_kernels.build_error()}")
    return kernel


def _exact_columns(kernel, kind, q, scale, W: torch.Tensor) -> None:
    """One-hot inputs read each column of W through the kernel: y[t, o] = W[o, t] plus zero products, exact;
    compared with the same product in float64 on the decoder's W (a row holding NaN or ±Inf is NaN in both)."""
    I = W.shape[1]
    x = torch.eye(I)
    got = kernel.quant_linear(kind, x, q, scale).double() + 0.0  # + 0.0: -0 and +0 sum alike
    want = (x.double() @ W.double().T) + 0.0
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))


@pytest.mark.parametrize("flags", BUILDS, ids=BUILD_IDS)
def test_fp8_kernel_weights_are_the_published_decode_of_every_code_and_scale(flags):
    kernel = _kernel(flags)
    # 256 rows (two 128-row scale blocks), code b alone in row b at column b % 32, zeros elsewhere
    codes = torch.zeros(256, 32, dtype=torch.uint8)
    codes[torch.arange(256), torch.arange(256) % 32] = torch.arange(256, dtype=torch.uint8)
    q = codes.view(torch.float8_e4m3fn)
    assert q.float()[0x7F, 0x7F % 32].isnan() and q.float()[0xFF, 0xFF % 32].isnan()  # torch's E4M3 NaNs
    assert q.float()[0x7E, 0x7E % 32] == 448 and q.float()[1, 1] == 2.0 ** -9
    for s in FP8_SCALES:
        for other in (1.0, s):  # the second block at this scale too, or at 1
            scale = torch.tensor([[s], [other]], dtype=torch.float32)
            W = fp8_block.decode(q, scale, dtype=torch.float32)
            _exact_columns(kernel, "fp8", q, scale, W)


@pytest.mark.parametrize("flags", BUILDS, ids=BUILD_IDS)
def test_int4_kernel_weights_are_compressed_tensors_decode_of_every_nibble(flags):
    kernel = _kernel(flags)
    # 16 rows: row r holds nibble (r + c) % 16 at column c, so every value sits in every position of a word
    nibbles = (torch.arange(16)[:, None] + torch.arange(32)[None, :]) % 16
    q = int4.pack((nibbles - 8).to(torch.int8))
    gen = torch.Generator().manual_seed(3)
    random_bits = torch.randint(0, 1 << 16, (8, 16), generator=gen, dtype=torch.int32).to(torch.int16)
    scales = [torch.full((16, 1), s).bfloat16() for s in INT4_SCALES]
    scales += [b.view(torch.bfloat16)[:, None].contiguous() for b in random_bits]  # any bf16 bit pattern
    # rows with subnormal and normal scales side by side (the kernel converts two rows' tables at once)
    scales.append(torch.tensor([[2.0 ** -133 if r % 3 else 1.0078125] for r in range(16)]).bfloat16())
    for scale in scales:
        W = int4.decode(q, scale, (16, 32), torch.float32)
        _exact_columns(kernel, "int4", q, scale, W)


@pytest.mark.parametrize("flags", BUILDS, ids=BUILD_IDS)
def test_int4_kernel_weights_under_a_different_bf16_scale_per_block(flags):
    """Each block's table comes from its own scale (the vector tiles read two blocks' scales in one load and
    split them): any bf16 bit pattern per (row, block), neighbours differing, in tiles whose scales are all
    normal and in tiles holding a subnormal, Inf, NaN or smallest-exponent one, gives compressed-tensors'
    decode."""
    kernel = _kernel(flags)
    gen = torch.Generator().manual_seed(11)
    O, I = 24, 32 * 6
    q = int4.pack(torch.randint(-8, 8, (O, I), generator=gen, dtype=torch.int8))
    bits = torch.randint(0, 1 << 16, (O, I // 32), generator=gen, dtype=torch.int32)
    bits[:8] = (bits[:8] & 0x807F) | (torch.randint(2, 255, (8, I // 32), generator=gen, dtype=torch.int32) << 7)
    # one each: exponent 1 (negative), Inf, the smallest subnormal, NaN
    bits[10, 3], bits[13, 0], bits[17, 5], bits[22, 2] = 0x80C5, 0x7F80, 0x0001, 0x7FC1
    scale = bits.to(torch.int16).view(torch.bfloat16)  # rows 0-7 all normal: the fast path throughout
    W = int4.decode(q, scale, (O, I), torch.float32)
    _exact_columns(kernel, "int4", q, scale, W)


@pytest.mark.parametrize("flags", BUILDS, ids=BUILD_IDS)
@pytest.mark.parametrize("bad", [2.0 ** -133, math.nan])
def test_one_subnormal_or_nan_int4_scale_anywhere_in_a_tile_gives_the_decode(flags, bad):
    """The vector tiles check a tile's scales 32 at a time (and a masked tail) and rerun a tile holding a
    subnormal or NaN scale on rounded products: one such scale at the start, middle or end of a tile's scales,
    in a tile of 4 rows, of 2 and of one row; one token alone gets the bits it gets among many."""
    kernel = _kernel(flags)
    gen = torch.Generator().manual_seed(5)
    O, I = 10, 32 * 24
    q = int4.pack(torch.randint(-8, 8, (O, I), generator=gen, dtype=torch.int8))
    for row, block in ((0, 0), (2, 23), (5, 10), (8, 0), (9, 23)):
        scale = (torch.rand(O, I // 32, generator=gen) + 0.5).bfloat16()
        scale[row, block] = bad
        W = int4.decode(q, scale, (O, I), torch.float32)
        _exact_columns(kernel, "int4", q, scale, W)
        x = torch.randn(3, I, generator=gen)
        many = kernel.quant_linear("int4", x, q, scale)
        for t in range(3):
            alone = kernel.quant_linear("int4", x[t:t + 1], q, scale)
            assert torch.equal(alone.isnan(), many[t:t + 1].isnan())
            assert torch.equal(alone.nan_to_num(0.0), many[t:t + 1].nan_to_num(0.0))


def _expert(kind: str, F: int, I: int, gen: torch.Generator):
    cls, encode = (FP8ExpertWeights, fp8_block.encode) if kind == "fp8" else (Int4ExpertWeights, int4.encode)
    return cls(*(t for s in ((F, I), (F, I), (I, F)) for t in encode(torch.randn(*s, generator=gen))))


def _random_fp8_expert(F: int, I: int, gen: torch.Generator) -> FP8ExpertWeights:
    """Random bytes (NaN codes drawn again) and log-uniform scales over 2^-20..2^12, not encode's output."""
    def matrix(o, i):
        b = torch.randint(0, 256, (o, i), generator=gen, dtype=torch.uint8)
        b = torch.where((b | 0x80) == 0xFF, torch.zeros_like(b), b)
        scale = torch.exp2(torch.rand(fp8_block.scale_shape((o, i)), generator=gen) * 32 - 20)
        return b.view(torch.float8_e4m3fn), scale

    return FP8ExpertWeights(*matrix(F, I), *matrix(F, I), *matrix(I, F))


@pytest.mark.parametrize("kind", ["fp8", "fp8-random", "int4"])
def test_experts_and_projections_match_decode_then_matmul(kind):
    gen = torch.Generator().manual_seed(5)
    F, I = 160, 288  # partial 128 x 128 blocks both ways
    w = _random_fp8_expert(F, I, gen) if kind == "fp8-random" else _expert(kind, F, I, gen)
    assert format_of(w) is (FP8_BLOCK if kind.startswith("fp8") else INT4)
    if kind.startswith("fp8"):
        assert w.nbytes == 3 * F * I + 4 * 3 * 2 * 3  # the codes, and 2 x 3 fp32 scales per matrix
    else:
        assert w.nbytes == 3 * F * I // 2 + 2 * 3 * F * I // 32
    for T in (1, 5, 40):  # 40: the GEMM path
        x = torch.randn(T, I, generator=gen)
        want = format_of(w).reference(w, x, "situ", BETAS)
        got = run_expert(w, x, "situ", BETAS)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())  # summation order
        for proj, inp in (("w1", x), ("w2", torch.randn(T, F, generator=gen))):
            W = format_of(w).weight(w, proj, torch.float64)
            y = format_of(w).project_forward(w, proj, inp)
            torch.testing.assert_close(y.double(), inp.double() @ W.T, rtol=1e-5, atol=1e-5 * y.abs().max().item())
            dy = torch.randn(T, W.shape[0], dtype=torch.float64, generator=gen)
            torch.testing.assert_close(format_of(w).project_backward(w, proj, dy), dy @ W)  # float64: exact decoding
    bf = torch.randn(3, I, generator=gen).bfloat16()  # bf16 inputs: computed in fp32, close to the bf16 reference
    torch.testing.assert_close(run_expert(w, bf, "silu", BETAS).float(), format_of(w).reference(w, bf.float(), "silu", BETAS),
                               rtol=2e-2, atol=2e-2)


def test_expert_under_autograd_gives_the_input_gradient_of_its_decoded_weights():
    gen = torch.Generator().manual_seed(6)
    w = _expert("int4", 64, 96, gen)
    x = torch.randn(3, 96, dtype=torch.float64, generator=gen, requires_grad=True)
    y = train_forward(Held(w), x, "silu", BETAS)
    y.sum().backward()
    x2 = x.detach().clone().requires_grad_()
    mats = {p: format_of(w).weight(w, p, torch.float64) for p in ("w1", "w3", "w2")}
    from moeswap.ops.activation import glu_reference
    (glu_reference("silu", x2 @ mats["w1"].T, x2 @ mats["w3"].T, BETAS) @ mats["w2"].T).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)


def test_kept_bytes_that_cannot_give_finite_weights_are_named():
    gen = torch.Generator().manual_seed(7)
    names = {p: {"weight": f"{p}.weight", "weight_scale_inv": f"{p}.weight_scale_inv", "weight_packed": f"{p}.packed",
                 "weight_scale": f"{p}.weight_scale"} for p in ("w1", "w2", "w3")}
    w = _expert("fp8", 64, 64, gen)
    assert FP8_BLOCK.check_finite(w, names) is None
    w.w3_weight.view(torch.uint8)[5, 7] = 0xFF
    name, proj, what = FP8_BLOCK.check_finite(w, names)
    assert (name, proj) == ("w3.weight", "w3") and "NaN codes" in what and "[5, 7]" in what
    w = _expert("fp8", 64, 64, gen)
    w.w2_scale_inv[0, 0] = 1e36  # 448 * 1e36 overflows fp32
    assert FP8_BLOCK.check_finite(w, names)[:2] == ("w2.weight_scale_inv", "w2")
    v = _expert("int4", 64, 64, gen)
    assert INT4.check_finite(v, names) is None
    v.w1_scale[3, 1] = float("inf")
    name, proj, what = INT4.check_finite(v, names)
    assert (name, proj) == ("w1.weight_scale", "w1") and "[3, 1]" in what


def test_kernel_is_not_used_where_it_does_not_apply():
    """Widths that are not whole 32-column groups, or INT4 scales that are not bf16 (their products round in
    that dtype), take the decoding path, with the same results as the reference."""
    gen = torch.Generator().manual_seed(8)
    w = _expert("fp8", 48, 80, gen)
    assert expert_quant.group_kind(w) is None
    x = torch.randn(2, 80, generator=gen)
    torch.testing.assert_close(run_expert(w, x, "silu", BETAS), format_of(w).reference(w, x, "silu", BETAS))
    q, s = int4.encode(torch.randn(64, 64, generator=gen), scale_dtype=torch.float16)
    v = Int4ExpertWeights(q, s, q.clone(), s.clone(), q.clone(), s.clone())
    assert expert_quant.group_kind(v) is None
    x = torch.randn(2, 64, generator=gen)
    torch.testing.assert_close(run_expert(v, x, "silu", BETAS), format_of(v).reference(v, x, "silu", BETAS))
