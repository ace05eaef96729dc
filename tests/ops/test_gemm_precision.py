"""--gemm-precision bf16: CPU matmuls with bf16 weights (dense GEMMs and decode-size products, MXFP4
experts on the GEMM path) round their inputs to bf16, inside the model's forward only; the default stays
exact."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeswap.formats import mxfp4
from moeswap.models.loader import LoadOptions, load_model
from moeswap.ops import cpu_kernels
from moeswap.ops import expert_mxfp4 as em
from moeswap.ops.expert import MXFP4ExpertWeights
from moeswap.ops.gemm_precision import gemm_in_bf16, gemm_precision
from moeswap.ops.linear import KERNEL_MAX_ROWS, linear
from numerics import gamma


def test_inputs_are_rounded_to_bf16_for_many_rows_and_few():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 80, generator=g).bfloat16()
    many, few = torch.randn(KERNEL_MAX_ROWS + 8, 80, generator=g), torch.randn(4, 80, generator=g)
    exact_many, exact_few = linear(many, w), linear(few, w)
    with gemm_precision("bf16"):
        assert gemm_in_bf16()
        got_many, got_few = linear(many, w), linear(few, w)
    assert not gemm_in_bf16()  # reset on leaving
    # many rows (prefill): the rounded inputs' exact products summed in fp32, outputs kept in fp32 (torch's bf16
    # GEMM would round them to bf16: llama.cpp does not) -- within Higham's bound of the float64 sum
    rounded_many = many.bfloat16().double() @ w.double().T
    bound = gamma(80) * (many.bfloat16().double().abs() @ w.double().abs().T)
    assert got_many.dtype == torch.float32 and ((got_many.double() - rounded_many).abs() <= bound).all()
    assert not torch.equal(got_many, F.linear(many.bfloat16(), w).float())  # not bf16 outputs
    assert not torch.equal(got_many, exact_many)
    # few rows (decode): the kernel's bf16 dot products, or the fp32 kernel on the rounded inputs
    assert not torch.equal(got_few, exact_few)
    rounded = few.bfloat16().double() @ w.double().T
    torch.testing.assert_close(got_few.double(), rounded, rtol=0, atol=1e-6 * rounded.abs().max().item())
    kernel = cpu_kernels.kernel()
    if kernel is not None and kernel.has_bf16_dot:  # widths of a multiple of 32: AVX-512 BF16 dot products
        w96, x96 = torch.randn(40, 96, generator=g).bfloat16(), torch.randn(7, 96, generator=g)
        with gemm_precision("bf16"):
            got = linear(x96, w96)
            assert torch.equal(linear(x96[2:3], w96), got[2:3])  # a row alone: the bits it gets among others
        want = x96.bfloat16().double() @ w96.double().T
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6 * want.abs().max().item())
    with pytest.raises(ValueError, match="GEMM precision 'fp16': expected one of fp32, bf16"):
        with gemm_precision("fp16"):
            pass


def test_mxfp4_experts_on_the_gemm_path_in_bf16():
    g = torch.Generator().manual_seed(1)
    I, F_ = 64, 96

    def quantized(o, i):
        packed, scale = mxfp4.encode(torch.randn(o, i, generator=g))
        return packed, scale

    (p1, s1), (p3, s3), (p2, s2) = quantized(F_, I), quantized(F_, I), quantized(I, F_)
    w = MXFP4ExpertWeights(p1, s1, p3, s3, p2, s2)
    x = torch.randn(em.GEMM_MIN_TOKENS + 5, I, generator=g)
    want = em.reference(w, x, "situ", (4.0, 25.0))
    assert torch.equal(em.torch_rows(w, x, "situ", (4.0, 25.0)), em.torch_rows(w, x, "situ", (4.0, 25.0)))
    with gemm_precision("bf16"):
        got = em.torch_rows(w, x, "situ", (4.0, 25.0))
    assert not torch.equal(got, em.torch_rows(w, x, "situ", (4.0, 25.0)))
    torch.testing.assert_close(got, want, rtol=0, atol=3e-2 * want.abs().max().item())


def test_the_model_sets_it_for_its_forward_only(tiny_k3_dir):
    exact, _ = load_model(tiny_k3_dir, LoadOptions())
    fast, _ = load_model(tiny_k3_dir, LoadOptions(gemm_precision="bf16"))
    assert fast.gemm_precision == "bf16" and exact.gemm_precision == "fp32"
    prompt = torch.arange(3, 3 + KERNEL_MAX_ROWS + 8)[None]
    with torch.no_grad():
        want, got = exact(prompt), fast(prompt)
        assert not gemm_in_bf16()
        assert not torch.equal(got, want)
        # the first position is close; later ones may part where this random model's routing is near-tied
        # (the same happens against llama.cpp, docs/benchmarks.md)
        torch.testing.assert_close(got[:, 0], want[:, 0], rtol=0, atol=2e-2 * want[:, 0].abs().max().item())
        # few rows (a decode step's size) round too
        short_fast, short_exact = fast(prompt[:, :5]), exact(prompt[:, :5])
        assert not torch.equal(short_fast, short_exact)
        torch.testing.assert_close(short_fast[:, 0], short_exact[:, 0], rtol=0,
                                   atol=2e-2 * short_exact[:, 0].abs().max().item())
    with pytest.raises(ValueError, match="--gemm-precision 'int4'"):
        load_model(tiny_k3_dir, LoadOptions(gemm_precision="int4"))
