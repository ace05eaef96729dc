"""csrc/gemm_bf16.c (cpu_kernels.bf16_gemm), training's GEMM on bf16 weights as stored, in both directions
(x W^T and dy W): against float64 plain torch on odd shapes and 1..70 rows; every build this machine can run
gives the same bits (one fma chain per output, k in order); a row's result does not depend on the other rows
or the thread count; accumulating a second product continues the same chain (dg W1 + du W3 is the product
of the concatenations); bad inputs are refused with a ValueError naming them."""

from __future__ import annotations

import pytest
import torch

from moeswap.ops import cpu_kernels

BUILDS = cpu_kernels.build_variants()
BUILD_IDS = ["native" if f is None else " ".join(f) for f in BUILDS]
# (rows, K, N): single rows and columns, widths off every panel and tile size, a few rows past a tile, 70 rows
SHAPES = [(1, 1, 1), (1, 256, 256), (5, 17, 33), (12, 64, 32), (13, 100, 31), (31, 48, 130), (64, 256, 96),
          (70, 33, 47), (3, 7, 16)]


def _kernel(flags=None):
    kernel = cpu_kernels.kernel(flags)
    if kernel is None:
        pytest.skip(f"the kernel does not build here: {cpu_kernels.build_error()}")
    return kernel


def _operands(M: int, K: int, N: int, trans: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(M, K, generator=gen)
    w = torch.randn(*((N, K) if trans else (K, N)), generator=gen).bfloat16()
    return a, w


def _reference(a: torch.Tensor, w: torch.Tensor, trans: bool) -> torch.Tensor:
    w64 = w.double()
    return a.double() @ (w64.T if trans else w64)


def _assert_near(got: torch.Tensor, want: torch.Tensor, a: torch.Tensor, w: torch.Tensor, trans: bool) -> None:
    """Within fp32 summation error: K ulps of the sum of |products|, per output."""
    bound = (a.double().abs() @ (w.double().abs().T if trans else w.double().abs())) * a.shape[1] * 2.0 ** -23
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert ((got.double() - want).abs() <= bound + 1e-30).all(), f"max |diff| {(got.double() - want).abs().max()}"


@pytest.mark.parametrize("trans", [True, False], ids=["xWT", "dyW"])
@pytest.mark.parametrize("flags", BUILDS, ids=BUILD_IDS)
def test_matches_float64_and_every_build_gives_the_same_bits(flags, trans):
    kernel, native = _kernel(flags), _kernel()
    for i, (M, K, N) in enumerate(SHAPES):
        a, w = _operands(M, K, N, trans, seed=i)
        got = kernel.bf16_gemm(a, w, trans)
        _assert_near(got, _reference(a, w, trans), a, w, trans)
        assert torch.equal(got, native.bf16_gemm(a, w, trans)), (M, K, N)


@pytest.mark.parametrize("trans", [True, False], ids=["xWT", "dyW"])
def test_a_row_is_the_same_alone_and_under_two_threads(trans):
    kernel = _kernel()
    a, w = _operands(70, 100, 130, trans, seed=20)  # large enough for the kernel to use both threads
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel.bf16_gemm(a, w, trans)
        alone = torch.cat([kernel.bf16_gemm(a[m:m + 1], w, trans) for m in range(a.shape[0])])
        torch.set_num_threads(2)
        two = kernel.bf16_gemm(a, w, trans)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, alone) and torch.equal(one, two)
    for M in (1, 11, 12, 13, 25):
        assert torch.equal(kernel.bf16_gemm(a[:M], w, trans), one[:M]), M


@pytest.mark.parametrize("trans", [True, False], ids=["xWT", "dyW"])
def test_accumulating_continues_the_chain(trans):
    """gemm(a1, W1) then += gemm(a2, W2) is, bit for bit, the product of [a1 | a2] and W1 stacked over W2."""
    kernel = _kernel()
    a1, w1 = _operands(37, 40, 70, trans, seed=21)
    a2, w2 = _operands(37, 29, 70, trans, seed=22)
    out = kernel.bf16_gemm(a1, w1, trans)
    assert kernel.bf16_gemm(a2, w2, trans, out=out, accumulate=True) is out
    whole = kernel.bf16_gemm(torch.cat([a1, a2], 1), torch.cat([w1, w2], 1 if trans else 0), trans)
    assert torch.equal(out, whole)
    _assert_near(out, _reference(a1, w1, trans) + _reference(a2, w2, trans), torch.cat([a1, a2], 1),
                 torch.cat([w1, w2], 1 if trans else 0), trans)


def test_writes_into_a_row_slice_and_handles_empty_sizes():
    kernel = _kernel()
    a, w = _operands(9, 24, 40, True, seed=23)
    big = torch.full((20, 40), 7.0)
    kernel.bf16_gemm(a, w, True, out=big[5:14])
    assert torch.equal(big[5:14], kernel.bf16_gemm(a, w, True))
    assert (big[:5] == 7).all() and (big[14:] == 7).all()
    assert kernel.bf16_gemm(a[:0], w, True).shape == (0, 40)
    assert torch.equal(kernel.bf16_gemm(torch.zeros(3, 0), torch.zeros(5, 0, dtype=torch.bfloat16), True),
                       torch.zeros(3, 5))


@pytest.mark.parametrize("bad", ["fp32 weight", "width", "out shape", "out strided", "accumulate without out"])
def test_bad_inputs_are_refused(bad):
    kernel = _kernel()
    a, w = _operands(4, 8, 6, True, seed=24)
    call = {
        "fp32 weight": lambda: kernel.bf16_gemm(a, w.float(), True),
        "width": lambda: kernel.bf16_gemm(a, w, False),  # w [6, 8] is not [K=8, N]
        "out shape": lambda: kernel.bf16_gemm(a, w, True, out=torch.empty(4, 5)),
        "out strided": lambda: kernel.bf16_gemm(a, w, True, out=torch.empty(6, 4).T),
        "accumulate without out": lambda: kernel.bf16_gemm(a, w, True, accumulate=True),
    }[bad]
    with pytest.raises(ValueError, match="bf16_gemm"):
        call()
