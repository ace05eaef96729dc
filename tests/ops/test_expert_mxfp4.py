"""expert_mxfp4: every implementation (and every instruction-set build of the C kernel this CPU can run)
matches the plain-torch reference; selection, overrides and the fallback when the kernel cannot build."""

from __future__ import annotations

import shutil

import pytest
import torch

from moeswap.formats import mxfp4
from moeswap.ops import cpu_kernels, kernel_experts, native_build
from moeswap.ops import expert_mxfp4 as em
from moeswap.ops.expert import ExpertWeights, MXFP4ExpertWeights
from moeswap.weights.registry import run_expert

BETAS = (4.0, 25.0)


def random_matrix(out_dim: int, in_dim: int, gen: torch.Generator, scale_range=(118, 130)):
    packed = torch.randint(0, 256, (out_dim, in_dim // 2), dtype=torch.uint8, generator=gen)
    return packed, torch.randint(*scale_range, (out_dim, in_dim // 32), dtype=torch.uint8, generator=gen)


def random_expert(in_dim: int, expert_dim: int, seed: int = 0) -> MXFP4ExpertWeights:
    gen = torch.Generator().manual_seed(seed)
    (a, b), (c, d), (e, f) = (random_matrix(expert_dim, in_dim, gen), random_matrix(expert_dim, in_dim, gen),
                              random_matrix(in_dim, expert_dim, gen))
    return MXFP4ExpertWeights(a, b, c, d, e, f)


def assert_matches(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    # Same products, different summation order: fp32 sums agree to a few ulps of the largest output;
    # bf16 outputs may land on the neighbouring bf16 value.
    tol = {torch.float32: 2e-6, torch.bfloat16: 1.6e-2}[dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * want.float().abs().max().item())


@pytest.mark.parametrize("name", ["torch_rows", "cpu_c"])
@pytest.mark.parametrize("tokens", [1, 2, 3, 5, 8, 13, 16, 17, em.GEMM_MIN_TOKENS + 3])
def test_implementations_match_the_reference(name, tokens):
    if not em.available()[name]:
        pytest.skip(f"{name} is not available here")
    w = random_expert(160, 96, seed=tokens)
    x = torch.randn(tokens, 160, generator=torch.Generator().manual_seed(1))
    for act in ("situ", "silu"):
        assert_matches(em.IMPLEMENTATIONS[name](w, x, act, BETAS), em.reference(w, x, act, BETAS), torch.float32)


@pytest.mark.parametrize("name", ["torch_rows", "cpu_c"])
def test_bf16_inputs_and_batched_shapes(name):
    if not em.available()[name]:
        pytest.skip(f"{name} is not available here")
    w = random_expert(64, 128)
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    got, want = em.IMPLEMENTATIONS[name](w, x, "situ", BETAS), em.reference(w, x, "situ", BETAS)
    assert_matches(got, want, torch.bfloat16)


@pytest.mark.slow
@pytest.mark.parametrize("flags", cpu_kernels.build_variants(), ids=lambda f: "native" if f is None else " ".join(f))
def test_every_kernel_build_matches_the_decoded_matmul(flags):
    kernel = cpu_kernels.kernel(flags)
    if kernel is None:
        pytest.skip(f"the kernel does not build here: {cpu_kernels.build_error()}")
    gen = torch.Generator().manual_seed(3)
    packed, scale = random_matrix(37, 96, gen)  # 37 rows: 4-row tiles and a tail
    scale[0, 0], scale[1, 1], scale[2, 2], scale[3, 0] = 0, 230, 1, 255  # 2^-127, 2^103, 2^-126, NaN
    weight = mxfp4.decode(packed, scale, torch.float32)
    second = random_matrix(5, 96, gen)
    for tokens in (1, 2, 4, 7, 8, 11, 16, 19):
        x = torch.randn(tokens, 96, generator=gen)
        y, y2 = kernel.linear(x, [(packed, scale), second])
        want = x @ weight.T
        assert y[:, 3].isnan().all() and want[:, 3].isnan().all()
        keep = [r for r in range(37) if r not in (1, 3)]
        torch.testing.assert_close(y[:, keep], want[:, keep], rtol=2e-6, atol=2e-6 * want[:, keep].abs().max().item())
        torch.testing.assert_close(y[:, 1], want[:, 1], rtol=1e-5, atol=0)  # ~2^106 outputs
        want2 = x @ mxfp4.decode(*second, torch.float32).T
        torch.testing.assert_close(y2, want2, rtol=2e-6, atol=2e-6 * want2.abs().max().item())
    w = random_expert(96, 160, seed=9)
    for tokens, act in ((1, "situ"), (3, "silu"), (9, "situ")):
        x = torch.randn(tokens, 96, generator=gen)
        assert_matches(kernel_experts.expert(kernel, x, w, act, BETAS), em.reference(w, x, act, BETAS), torch.float32)
    check_grouped_moe(kernel, gen)
    decoded = kernel.mxfp4_decode(packed, scale)  # bit-exact, NaN rows and extreme scales included
    assert torch.equal(decoded.isnan(), weight.isnan()) and torch.equal(decoded.nan_to_num(), weight.nan_to_num())
    as_bf16 = kernel.mxfp4_decode(packed, scale, dtype=torch.bfloat16)  # exact in bf16 too (--gemm-precision)
    assert as_bf16.dtype == torch.bfloat16 and torch.equal(as_bf16.float().isnan(), weight.isnan())
    assert torch.equal(as_bf16.float().nan_to_num(), weight.nan_to_num())
    check_bf16_linear(kernel, gen)
    tiny = torch.zeros(1, 96)
    tiny[0, 0] = 1.0
    packed0 = torch.zeros(1, 48, dtype=torch.uint8)
    packed0[0, 0] = 0x02  # code 2 (1.0) in column 0
    (out,) = kernel.linear(tiny, [(packed0, torch.zeros(1, 3, dtype=torch.uint8))])
    assert out.item() == 2.0**-127  # the subnormal scale is not flushed


def test_kernel_rejects_mismatched_shapes():
    kernel = cpu_kernels.kernel()
    if kernel is None:
        pytest.skip("no kernel")
    packed, scale = random_matrix(4, 64, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="do not fit input width 96"):
        kernel.linear(torch.zeros(1, 96), [(packed, scale)])
    with pytest.raises(ValueError, match="wrong group size"):
        kernel.linear(torch.zeros(1, 64), [(packed, scale[:, :1])])


def test_select_and_overrides(monkeypatch):
    monkeypatch.delenv(em.ENV_KERNEL, raising=False)
    w = random_expert(64, 64)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(4))
    assert em.select("reference") is em.reference
    monkeypatch.setenv(em.ENV_KERNEL, "reference")
    assert em.select() is em.reference
    assert torch.equal(run_expert(w, x, "silu", BETAS), em.reference(w, x, "silu", BETAS))  # the MXFP4 format runs select()
    monkeypatch.setenv(em.ENV_KERNEL, "fastest")
    with pytest.raises(ValueError, match="unknown expert kernel 'fastest'.*reference, torch_rows, cpu_c"):
        run_expert(w, x, "silu", BETAS)
    monkeypatch.delenv(em.ENV_KERNEL)
    assert em.best_name() == ("cpu_c" if em.available()["cpu_c"] else "torch_rows")
    assert_matches(run_expert(w, x, "situ", BETAS), em.reference(w, x, "situ", BETAS), torch.float32)


def test_build_failure_falls_back_to_torch(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    monkeypatch.setenv(native_build.ENV_CACHE, str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.delenv(em.ENV_KERNEL, raising=False)
    w = random_expert(64, 64)
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(5))
    with pytest.warns(RuntimeWarning, match="CPU kernels unavailable, using the plain torch paths"):
        out = run_expert(w, x, "situ", BETAS)
    assert_matches(out, em.reference(w, x, "situ", BETAS), torch.float32)
    assert em.best_name() == "torch_rows"
    with pytest.raises(RuntimeError, match="'cpu_c' was asked for but is not available here"):
        em.select("cpu_c")


@pytest.mark.slow
def test_fresh_build_into_an_empty_cache(monkeypatch, tmp_path):
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler")
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    monkeypatch.setenv(native_build.ENV_CACHE, str(tmp_path))
    kernel = cpu_kernels.kernel()
    assert kernel is not None and kernel.path.parent == tmp_path / "kernels"
    assert cpu_kernels.build() == kernel.path  # cached: the second call compiles nothing


def check_grouped_moe(kernel, gen: torch.Generator) -> None:
    """moe(): each expert's weighted output summed per token, equal to the per-expert reference."""
    experts = [random_expert(64, 96, seed=20 + e) for e in range(3)]
    for tokens, pairs in ((1, [[0], [0], [0]]), (5, [[0, 2, 4], [1], [0, 1, 2, 3, 4]]), (9, [[3], [], list(range(9))])):
        x = torch.randn(tokens, 64, generator=gen)
        flat = [t for p in pairs for t in p]
        weights = torch.rand(len(flat), generator=gen)
        offsets = [0]
        for p in pairs:
            offsets.append(offsets[-1] + len(p))
        y = torch.full((tokens, 64), 0.5)  # the kernel adds to what is there
        kernel_experts.moe(kernel, x, experts, torch.tensor(flat, dtype=torch.int64), offsets, weights, "situ", BETAS,
                           y)
        want = torch.full((tokens, 64), 0.5)
        for e, p in enumerate(pairs):
            for k, t in enumerate(p):
                want[t] += weights[offsets[e] + k] * em.reference(experts[e], x[t : t + 1], "situ", BETAS)[0]
        torch.testing.assert_close(y, want, rtol=2e-6, atol=2e-6 * want.abs().max().item())
        bf16 = [ExpertWeights(*(mxfp4.decode(getattr(w, f"{p}_packed"), getattr(w, f"{p}_scale"), torch.float32)
                                .to(torch.bfloat16) for p in ("w1", "w3", "w2"))) for w in experts]
        y = torch.full((tokens, 64), 0.5)
        kernel_experts.moe(kernel, x, bf16, torch.tensor(flat, dtype=torch.int64), offsets, weights, "situ", BETAS,
                           y)
        torch.testing.assert_close(y, want, rtol=2e-6, atol=2e-6 * want.abs().max().item())  # MXFP4 is exact in bf16
        # the same bf16 experts with a strided down matrix: copied for the call, never remembered by pointer
        strided = [ExpertWeights(w.w1_FI, w.w3_FI, w.w2_IF.T.contiguous().T) for w in bf16]
        y = torch.full((tokens, 64), 0.5)
        kernel_experts.moe(kernel, x, strided, torch.tensor(flat, dtype=torch.int64), offsets, weights, "situ", BETAS,
                           y)
        torch.testing.assert_close(y, want, rtol=2e-6, atol=2e-6 * want.abs().max().item())
        assert all("_kernel_pointers" not in w.__dict__ for w in strided)
    with pytest.raises(ValueError, match="must be of one kind"):
        kernel_experts.moe(kernel, x, [experts[0], bf16[1]], torch.zeros(2, dtype=torch.int64), [0, 1, 2],
                           torch.ones(2), "situ", BETAS, y)
    with pytest.raises(ValueError, match="do not fit x"):
        kernel_experts.moe(kernel, x, experts, torch.zeros(2, dtype=torch.int64), [0, 1, 2], torch.ones(2), "situ",
                           BETAS, y)
    with pytest.raises(RuntimeError, match="bad sizes"):  # a token index outside x
        kernel_experts.moe(kernel, x, experts[:1], torch.tensor([tokens]), [0, 1], torch.ones(1), "situ", BETAS, y)


def check_bf16_linear(kernel, gen: torch.Generator) -> None:
    """bf16_linear(): fp32 x times bf16 weights widened exactly; sizes with vector tails and row tails."""
    for rows, cols in ((37, 96), (5, 1027), (64, 16)):
        w = torch.randn(rows, cols, generator=gen).to(torch.bfloat16)
        for tokens in (1, 2, 3, 4, 8, 13, 16):
            x = torch.randn(tokens, cols, generator=gen)
            want = x @ w.float().T
            torch.testing.assert_close(kernel.bf16_linear(x, w), want, rtol=2e-6,
                                       atol=4e-6 * want.abs().max().item())
            if kernel.has_bf16_dot and cols % 32 == 0:  # --gemm-precision bf16: inputs rounded, pair dot products
                rounded = x.bfloat16().float() @ w.float().T
                torch.testing.assert_close(kernel.bf16_linear(x, w, bf16_inputs=True), rounded, rtol=2e-6,
                                           atol=4e-6 * rounded.abs().max().item())
    with pytest.raises(ValueError, match="expected fp32 .T, I. and bf16"):
        kernel.bf16_linear(torch.zeros(1, 16), torch.zeros(4, 16))
    with pytest.raises(ValueError, match="bf16 inputs need"):
        kernel.bf16_linear(torch.zeros(1, 1027), torch.zeros(4, 1027).bfloat16(), bf16_inputs=True)


def test_kernel_rejects_scales_that_are_not_e8m0_bytes():
    kernel = cpu_kernels.kernel()
    if kernel is None:
        pytest.skip("no kernel")
    packed, scale = random_matrix(4, 64, torch.Generator().manual_seed(0))
    assert torch.equal(kernel.mxfp4_decode(packed, scale.view(torch.float8_e8m0fnu)), kernel.mxfp4_decode(packed, scale))
    with pytest.raises(ValueError, match="MXFP4 kernel scale must be uint8 E8M0 bytes, got dtype torch.float32"):
        kernel.mxfp4_decode(packed, scale.float())
    with pytest.raises(ValueError, match="cannot hold .4, 64. fp32"):
        kernel.mxfp4_decode(packed, scale, out=torch.empty(4 * 63))
    with pytest.raises(ValueError, match="dtype torch.float16"):
        kernel.mxfp4_decode(packed, scale, dtype=torch.float16)


def test_int8_block_quantization_matches_llama_cpp_q8_0():
    x = torch.tensor([[127.0, 63.5, -0.5, 1.5] + [0.0] * 28 + [1e-3] * 31 + [float("nan")]])
    q = em.quantize_int8_blocks(x)
    # scale 1.0: values on the grid stay, halves round to even; the NaN poisons only its own block
    assert q[0, :4].tolist() == [127.0, 64.0, -0.0, 2.0] and q[0, 4:32].eq(0).all()
    assert q[0, 32:].isnan().all()
    y = torch.randn(3, 96, generator=torch.Generator().manual_seed(0)) * 7
    step = y.unflatten(-1, (-1, 32)).abs().amax(-1, keepdim=True) / 127
    err = (em.quantize_int8_blocks(y) - y).unflatten(-1, (-1, 32)).abs()
    assert (err <= step * (0.5 + 127 * 2**-11)).all()  # half a step, plus 127 times the step's rounding
    fp16_step = (step.half().float() / step - 1).abs()
    assert fp16_step.max() < 2**-11 and fp16_step.max() > 0  # d rounded to fp16 precision, as Q8_0 stores it


def int8_kernel():
    kernel = cpu_kernels.kernel()
    if kernel is None or not kernel.has_int8_activations:
        pytest.skip("no CPU kernel with AVX-512 VNNI here")
    return kernel


@pytest.mark.parametrize("in_dim,expert_dim", [(64, 96), (160, 96), (512, 256)])  # 160: a partial 128-column chunk
def test_int8_activation_moe_matches_its_reference(in_dim, expert_dim):
    kernel = int8_kernel()
    gen = torch.Generator().manual_seed(in_dim)
    experts = [random_expert(in_dim, expert_dim, seed=30 + e) for e in range(3)]
    for tokens, pairs in ((1, [[0], [0], [0]]), (6, [[0, 2, 4], [1], list(range(6))]), (11, [[3], list(range(11)), []])):
        x = torch.randn(tokens, in_dim, generator=gen) * 3
        flat = [t for p in pairs for t in p]
        offsets = [0]
        for p in pairs:
            offsets.append(offsets[-1] + len(p))
        weights = torch.rand(len(flat), generator=gen)
        want, exact = torch.zeros(tokens, in_dim), torch.zeros(tokens, in_dim)
        for e, p in enumerate(pairs):
            for k, t in enumerate(p):
                want[t] += weights[offsets[e] + k] * em.reference_int8(experts[e], x[t : t + 1], "silu", BETAS)[0]
                exact[t] += weights[offsets[e] + k] * em.reference(experts[e], x[t : t + 1], "silu", BETAS)[0]
        y = torch.zeros(tokens, in_dim)
        kernel_experts.moe(kernel, x, experts, torch.tensor(flat, dtype=torch.int64), offsets, weights, "silu", BETAS,
                           y, int8_activations=True)
        # integer sums are exact; the hidden activations differ from torch's in the last bit, which can move
        # one of them across a rounding boundary of the second quantization: one step of one value
        torch.testing.assert_close(y, want, rtol=0, atol=5e-4 * want.abs().max().item())
        assert 1e-4 < (y - exact).abs().max() / exact.abs().max() < 0.1  # it is not the fp32 path


@pytest.mark.parametrize("width", [32, 160, 1024])  # 160: a partial 128-column chunk
def test_vector_int8_quantization_writes_the_reference_bytes(width):
    """The AVX-512 block quantizer against the plain one, byte for byte: halves after scaling, zero blocks,
    tiny and huge magnitudes, and blocks with a NaN or an infinity (which take the plain path)."""
    kernel = int8_kernel()
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(9, width, generator=gen) * torch.logspace(-30, 30, 9)[:, None]
    x[1, :32] = 0.0
    x[2, :32] = torch.arange(32) - 15.5  # amax 15.5: values land on halves of the int8 grid
    x[3, 5] = float("nan")
    x[4, -1] = float("inf")
    x[5, :32] = -x[5, :32].abs()
    row = (width + 127) // 128 * (128 + 64 + 64)
    vector, plain = (torch.full((9, row), 0xAB, dtype=torch.uint8) for _ in range(2))
    assert kernel.lib.moeswap_q8_quantize(x.data_ptr(), 9, width, vector.data_ptr(), 0) == 0
    assert kernel.lib.moeswap_q8_quantize(x.data_ptr(), 9, width, plain.data_ptr(), 1) == 0
    assert torch.equal(vector, plain)
    # a zero block's values are zeros (block 0: the chunk's bytes 0-15 and 64-79), a random one's are not
    assert plain[1, :16].eq(0).all() and plain[1, 64:80].eq(0).all() and not plain[0, :16].eq(0).all()


def test_int8_activations_keep_nan_and_refuse_bf16_experts():
    kernel = int8_kernel()
    w = random_expert(64, 96, seed=1)
    x = torch.randn(2, 64)
    x[1, 40] = float("nan")
    y = torch.zeros(2, 64)
    kernel_experts.moe(kernel, x, [w], torch.tensor([0, 1]), [0, 2], torch.ones(2), "silu", BETAS, y,
                       int8_activations=True)
    assert y[0].isfinite().all() and y[1].isnan().all()
    bf16 = ExpertWeights(*(torch.zeros(*s, dtype=torch.bfloat16) for s in ((96, 64), (96, 64), (64, 96))))
    with pytest.raises(ValueError, match="int8 activations are for MXFP4 experts"):
        kernel_experts.moe(kernel, x, [bf16], torch.tensor([0]), [0, 1], torch.ones(1), "silu", BETAS, y,
                           int8_activations=True)


def test_a_kernel_level_is_named_and_checked_against_the_cpu(monkeypatch):
    """MOESWAP_KERNEL_ISA: a known level this CPU runs gives its -march; an unknown one, or one whose flags
    this CPU lacks, is a ValueError naming the levels (kernel() raises it, the CLI says it in one line)."""
    if "x86-64" in cpu_kernels.supported_levels():
        monkeypatch.setenv(cpu_kernels.ISA_ENV, "x86-64")
        assert cpu_kernels.isa_flags() == ("-march=x86-64",)
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "pentium")
    with pytest.raises(ValueError, match=r"MOESWAP_KERNEL_ISA='pentium': expected one of native, x86-64-v4"):
        cpu_kernels.kernel()
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset({"sse4_2"}))
    monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: "x86_64")
    cpu_kernels._level_flags.cache_clear()
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "x86-64-v3")
    try:
        with pytest.raises(ValueError, match=r"MOESWAP_KERNEL_ISA=x86-64-v3: this CPU lacks avx2, fma"):
            cpu_kernels.isa_flags()
    finally:
        cpu_kernels._level_flags.cache_clear()
