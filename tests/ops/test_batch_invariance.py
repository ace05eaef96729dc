"""A token's outputs do not depend on the other tokens of a call: every row of a T-token call of the decode
kernels (bf16 linear, its bf16-input form, the gated MLP, the routed experts in MXFP4, bf16, block FP8
and INT4, and K3's latent form around them) equals, bit for bit, the call on that token alone, in every build this machine can run; and each row
still matches the plain-torch reference. What a server's continuous batching needs for a request to decode
to the tokens it gets alone."""

from __future__ import annotations

import pytest
import torch

from moeswap.formats import fp8_block, int4, mxfp4
from moeswap.ops import cpu_kernels, expert_mxfp4, kernel_experts
from moeswap.ops.activation import glu_reference
from moeswap.ops.expert import ExpertWeights, FP8ExpertWeights, Int4ExpertWeights, MXFP4ExpertWeights
from moeswap.weights.registry import format_of

BUILDS = cpu_kernels.build_variants()
BUILD_IDS = ["native" if f is None else " ".join(f) for f in BUILDS]
BETAS = (4.0, 25.0)
MAX_T = 17  # two whole 8-token tiles and one token over


def _kernel(flags):
    kernel = cpu_kernels.kernel(flags)
    if kernel is None:
        pytest.skip(f"the kernel does not build here: {cpu_kernels.build_error()}")
    return kernel


def _each_alone(call, x_TI: torch.Tensor) -> torch.Tensor:
    return torch.cat([call(x_TI[t:t + 1]) for t in range(x_TI.shape[0])])


def _assert_rows_alone(call, x_TI: torch.Tensor) -> torch.Tensor:
    """call(x[:T]) == each row's call alone, bit for bit, for T = 1..len(x); returns the rows alone."""
    alone = _each_alone(call, x_TI)
    for T in range(1, x_TI.shape[0] + 1):
        got = call(x_TI[:T])
        assert torch.equal(got, alone[:T]), f"{T} tokens: max |diff| {(got - alone[:T]).abs().max().item()}"
    return alone


@pytest.mark.parametrize("flags", BUILDS, ids=BUILD_IDS)
def test_bf16_linear_rows_do_not_depend_on_the_batch(flags):
    """Widths with whole 32-column blocks only, an odd count of them, a 4-column tail, a narrow tail alone and
    a wide row; 39 output rows: a 32-row chunk, then 7 (row tiles of 4, 2 and 1, or 3, 2 and 1)."""
    kernel = _kernel(flags)
    gen = torch.Generator().manual_seed(11)
    O = 39
    for I in (32, 64, 96, 100, 7, 2048 + 32):
        w = torch.randn(O, I, generator=gen).bfloat16()
        x = torch.randn(MAX_T, I, generator=gen)
        alone = _assert_rows_alone(lambda xt, w=w: kernel.bf16_linear(xt, w), x)
        want = x @ w.float().T
        torch.testing.assert_close(alone, want, rtol=2e-6, atol=4e-6 * want.abs().max().item())
        if kernel.has_bf16_dot and I % 32 == 0:  # --gemm-precision bf16's pair dot products
            alone = _assert_rows_alone(lambda xt, w=w: kernel.bf16_linear(xt, w, bf16_inputs=True), x)
            want = x.bfloat16().float() @ w.float().T
            torch.testing.assert_close(alone, want, rtol=2e-6, atol=4e-6 * want.abs().max().item())


@pytest.mark.parametrize("flags", BUILDS, ids=BUILD_IDS)
@pytest.mark.parametrize("act", ["situ", "silu"])
def test_bf16_mlp_rows_do_not_depend_on_the_batch(flags, act):
    kernel = _kernel(flags)
    gen = torch.Generator().manual_seed(12)
    D, H = 96, 100  # the down projection's rows have a tail
    w_gu = torch.randn(2 * H, D, generator=gen).bfloat16()
    w_down = (torch.randn(D, H, generator=gen) / 8).bfloat16()
    x = torch.randn(MAX_T, D, generator=gen)
    alone = _assert_rows_alone(lambda xt: kernel.bf16_mlp(xt.contiguous(), w_gu, w_down, act, BETAS), x)
    gu = x @ w_gu.float().T
    want = glu_reference(act, gu[:, :H], gu[:, H:], BETAS) @ w_down.float().T
    torch.testing.assert_close(alone, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def _experts(kind: str, I: int, F: int, E: int, gen: torch.Generator) -> list:
    def make():
        if kind == "bf16":
            return ExpertWeights(*(torch.randn(*s, generator=gen).bfloat16() for s in ((F, I), (F, I), (I, F))))
        if kind in ("fp8", "int4"):
            cls, encode = (FP8ExpertWeights, fp8_block.encode) if kind == "fp8" else (Int4ExpertWeights, int4.encode)
            return cls(*(t for s in ((F, I), (F, I), (I, F)) for t in encode(torch.randn(*s, generator=gen))))
        return MXFP4ExpertWeights(*mxfp4.encode(torch.randn(F, I, generator=gen)),
                                  *mxfp4.encode(torch.randn(F, I, generator=gen)),
                                  *mxfp4.encode(torch.randn(I, F, generator=gen)))

    return [make() for _ in range(E)]


def _expert_reference(kind: str, w, x_TI: torch.Tensor) -> torch.Tensor:
    if kind == "mxfp4":
        return expert_mxfp4.reference(w, x_TI, "situ", BETAS)
    if kind in ("fp8", "int4"):
        return format_of(w).reference(w, x_TI, "situ", BETAS)
    return glu_reference("situ", x_TI @ w.w1_FI.float().T, x_TI @ w.w3_FI.float().T, BETAS) @ w.w2_IF.float().T


@pytest.mark.parametrize("flags", BUILDS, ids=BUILD_IDS)
@pytest.mark.parametrize("kind", ["mxfp4", "mxfp4-int8", "bf16", "fp8", "int4"])
def test_routed_experts_rows_do_not_depend_on_the_batch(flags, kind):
    """The experts group a step's tokens by expert, so how many tokens an expert gets (its tiles) depends on
    the others: a token's rows must not. K3's latent form (bf16 down and up projections around them) too."""
    kernel = _kernel(flags)
    int8 = kind == "mxfp4-int8"
    if int8 and not kernel.has_int8_activations:
        pytest.skip("this build has no int8-activation path")
    kind = "mxfp4" if int8 else kind
    gen = torch.Generator().manual_seed(13)
    # FP8: 160 rows are a whole 128-row scale block and part of one; 96 columns part of one
    I, F, E, K, D = 96, {"mxfp4": 64, "bf16": 100}.get(kind, 160), 6, 3, 80
    experts = _experts(kind, I, F, E, gen)
    table = torch.zeros(E, 6, dtype=torch.int64)
    for e, w in enumerate(experts):
        table[e] = torch.tensor(kernel_experts.resident_row(w, I, kind)[1])
    # 6 experts, 3 each: with up to 17 tokens every expert gets from none to most of them
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(MAX_T)])
    weight = torch.rand(MAX_T, K, generator=gen)

    def routed(rows: slice, x: torch.Tensor) -> torch.Tensor:
        y = torch.zeros(x.shape[0], I)
        assert kernel.moe_resident(x, table, ids[rows].contiguous(), weight[rows].contiguous(), F, kind, "situ",
                                   BETAS, y, int8) is not None
        return y

    x = torch.randn(MAX_T, I, generator=gen)
    alone = torch.cat([routed(slice(t, t + 1), x[t:t + 1]) for t in range(MAX_T)])
    for T in range(1, MAX_T + 1):
        assert torch.equal(routed(slice(0, T), x[:T]), alone[:T]), f"{T} tokens"
    if not int8:
        want = torch.stack([sum(weight[t, k] * _expert_reference(kind, experts[ids[t, k]], x[t:t + 1])[0]
                                for k in range(K)) for t in range(MAX_T)])
        torch.testing.assert_close(alone, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())

    w_down, w_up = torch.randn(I, D, generator=gen).bfloat16(), torch.randn(D, I, generator=gen).bfloat16()
    norm_w, xd = torch.rand(I, generator=gen) + 0.5, torch.randn(MAX_T, D, generator=gen)

    def latent(rows: slice) -> torch.Tensor:
        return kernel.latent_moe_resident(xd[rows].contiguous(), w_down, norm_w, 1e-5, w_up, table,
                                          ids[rows].contiguous(), weight[rows].contiguous(), F, kind, "situ", BETAS,
                                          int8)[0]

    alone = torch.cat([latent(slice(t, t + 1)) for t in range(MAX_T)])
    for T in range(1, MAX_T + 1):
        assert torch.equal(latent(slice(0, T)), alone[:T]), f"latent, {T} tokens"


@pytest.mark.parametrize("flags", BUILDS, ids=BUILD_IDS)
@pytest.mark.parametrize("kind", ["fp8", "int4"])
def test_quant_linear_rows_do_not_depend_on_the_batch(flags, kind):
    """One block-FP8 or INT4 matrix (a projection under autograd's forward): 39 rows (a 32-row chunk, then 7)."""
    kernel = _kernel(flags)
    gen = torch.Generator().manual_seed(14)
    O, I = 39, 160
    q, scale = (fp8_block.encode if kind == "fp8" else int4.encode)(torch.randn(O, I, generator=gen))
    x = torch.randn(MAX_T, I, generator=gen)
    alone = _assert_rows_alone(lambda xt: kernel.quant_linear(kind, xt.contiguous(), q, scale), x)
    W = fp8_block.decode(q, scale, dtype=torch.float32) if kind == "fp8" else int4.decode(q, scale, (O, I), torch.float32)
    want = x @ W.T
    torch.testing.assert_close(alone, want, rtol=2e-6, atol=4e-6 * want.abs().max().item())


def _assert_tiles(call, x_TI: torch.Tensor, T_from: int) -> None:
    """call(x[:T]) == the same tokens in calls of at most 8 (one tile each), bit for bit, for T = T_from..len(x)."""
    tiles = torch.cat([call(x_TI[t:t + 8]) for t in range(0, x_TI.shape[0], 8)])
    for T in range(T_from, x_TI.shape[0] + 1):
        got = call(x_TI[:T])
        assert torch.equal(got, tiles[:T]), f"{T} tokens: max |diff| {(got - tiles[:T]).abs().max().item()}"


@pytest.mark.parametrize("flags", BUILDS, ids=BUILD_IDS)
def test_mxfp4_prefill_rows_equal_the_8_token_tiles(flags):
    """Prefill gives an expert 9-40 tokens: each token's row equals the same token's in calls of at most 8 tokens
    (one tile each), bit for bit, so a kernel that takes more tokens at once (a block decoded once for more of
    them) must keep the tiles' sums. Widths of 3, 9 and 16 blocks; odd row counts (row pairs and the odd row);
    an expert and a layer step whose 160- and 288-row chunks hold several 32-row groups."""
    kernel = _kernel(flags)
    gen = torch.Generator().manual_seed(15)
    T_MAX = 40
    for O, I in ((39, 96), (71, 288), (33, 512)):
        mats = [mxfp4.encode(torch.randn(O, I, generator=gen)), mxfp4.encode(torch.randn(O + 2, I, generator=gen))]
        x = torch.randn(T_MAX, I, generator=gen)
        _assert_tiles(lambda xt, mats=mats: torch.cat(kernel.linear(xt.contiguous(), mats), dim=1), x, 9)
    I, F = 288, 160
    (w,) = _experts("mxfp4", I, F, 1, gen)
    x = torch.randn(T_MAX, I, generator=gen)
    _assert_tiles(lambda xt: kernel_experts.expert(kernel, xt.contiguous(), w, "situ", BETAS), x, 9)
    table = torch.tensor([kernel_experts.resident_row(w, I, "mxfp4")[1]], dtype=torch.int64)
    weight = torch.rand(T_MAX, 1, generator=gen)

    def routed(xt: torch.Tensor, rows: slice) -> torch.Tensor:  # one expert: it gets every token of the call
        y = torch.zeros(xt.shape[0], I)
        assert kernel.moe_resident(xt.contiguous(), table, torch.zeros(xt.shape[0], 1, dtype=torch.int64),
                                   weight[rows].contiguous(), F, "mxfp4", "situ", BETAS, y) is not None
        return y

    tiles = torch.cat([routed(x[t:t + 8], slice(t, t + 8)) for t in range(0, T_MAX, 8)])
    for T in range(9, T_MAX + 1):
        assert torch.equal(routed(x[:T], slice(0, T)), tiles[:T]), f"layer step, {T} tokens"
