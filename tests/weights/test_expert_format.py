"""weights: the format objects classify stored tensors and decode as the codecs do; one projection
x W^T through autograd (`project`) gives the decoded product forward and dy W backward for MXFP4 bytes
(both kernel paths) and dense fp32 / bf16 weights, passes gradcheck in float64, and leaves the frozen
weights without gradients; `train_forward` with an adapter is the plain-torch expert plus the adapter."""

from __future__ import annotations

import pytest
import torch

from moeswap.formats import fp8_block, mxfp4, mxfp8
from moeswap.ops import cpu_kernels
from moeswap.ops import expert_mxfp4 as em
from moeswap.ops.activation import glu_reference
from moeswap.ops.expert import ExpertWeights, MXFP4ExpertWeights
from moeswap.weights import autograd as ag
from moeswap.weights.format import PROJS
from moeswap.weights.registry import FORMATS, for_suffixes, format_of, run_expert

FLOAT, MXFP4, MXFP8, FP8_BLOCK, INT4 = (FORMATS[n] for n in ("float", "mxfp4", "mxfp8", "fp8_block", "int4"))

BETAS = (4.0, 25.0)


def mxfp4_expert(in_dim: int, width: int, seed: int = 0) -> MXFP4ExpertWeights:
    gen = torch.Generator().manual_seed(seed)

    def matrix(out_dim, n):
        return (torch.randint(0, 256, (out_dim, n // 2), dtype=torch.uint8, generator=gen),
                torch.randint(119, 127, (out_dim, n // 32), dtype=torch.uint8, generator=gen))

    (a, b), (c, d), (e, f) = matrix(width, in_dim), matrix(width, in_dim), matrix(in_dim, width)
    return MXFP4ExpertWeights(a, b, c, d, e, f)


def dense_expert(in_dim: int, width: int, dtype: torch.dtype, seed: int = 0) -> ExpertWeights:
    gen = torch.Generator().manual_seed(seed)
    mats = [torch.randn(o, n, generator=gen) * 0.1 for o, n in ((width, in_dim), (width, in_dim), (in_dim, width))]
    return ExpertWeights(*(m.to(dtype) for m in mats))


EXPERTS = {
    "mxfp4": lambda: mxfp4_expert(64, 96),
    "fp32": lambda: dense_expert(64, 96, torch.float32),
    "bf16": lambda: dense_expert(64, 96, torch.bfloat16),
}


def test_formats_are_classified_by_their_tensors_once():
    assert for_suffixes({"weight"}) is FLOAT
    assert for_suffixes(["weight_packed", "weight_scale"]) is MXFP4
    assert for_suffixes({"weight": 0, "weight_scale": 0}) is MXFP8
    assert for_suffixes({"weight", "weight_scale_inv"}) is FP8_BLOCK
    assert for_suffixes({"weight_packed"}) is None and for_suffixes({"weight", "weight_packed"}) is None
    assert format_of(mxfp4_expert(64, 32)) is MXFP4
    assert format_of(dense_expert(32, 32, torch.float32)) is FLOAT  # every decoded expert computes as FLOAT
    assert [f.keeps_bytes for f in (FLOAT, MXFP4, MXFP8, FP8_BLOCK, INT4)] == [False, True, False, True, True]


def test_each_format_decodes_as_its_codec():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(8, 64, generator=gen)
    packed, scale = mxfp4.encode(w)
    assert torch.equal(MXFP4.decode({"weight_packed": packed, "weight_scale": scale}, torch.bfloat16),
                       mxfp4.decode(packed, scale, torch.bfloat16))
    data, scale8 = mxfp8.encode(w)
    assert torch.equal(MXFP8.decode({"weight": data, "weight_scale": scale8}, torch.float32),
                       mxfp8.decode(data, scale8, torch.float32))
    q, inv = fp8_block.encode(w)
    assert torch.equal(FP8_BLOCK.decode({"weight": q, "weight_scale_inv": inv}, torch.float32),
                       fp8_block.decode(q, inv, fp8_block.BLOCK, torch.float32))
    for fmt in (MXFP4, MXFP8):  # what quantize writes reads back through the same object
        stored = fmt.encode(w)
        assert {s: (t.dtype, tuple(t.shape)) for s, t in stored.items()} == fmt.stored_specs((8, 64))
        assert torch.equal(fmt.decode(stored, torch.float32), fmt.decode(stored, torch.float64).float())


@pytest.mark.parametrize("kind", list(EXPERTS))
@pytest.mark.parametrize("tokens", [1, 5, em.GEMM_MIN_TOKENS + 8])  # kernel rows and decoded-rows GEMM
def test_project_forward_and_backward_match_the_decoded_matrix(kind, tokens):
    w = EXPERTS[kind]()
    gen = torch.Generator().manual_seed(tokens)
    for proj in ("w1", "w3", "w2"):
        W = format_of(w).weight(w, proj, torch.float64)
        x = torch.randn(tokens, W.shape[1], generator=gen, requires_grad=True)
        y = ag.project(ag.Held(w), proj, x)
        want = x.detach().double() @ W.T
        assert y.dtype == torch.float32 and y.shape == want.shape
        torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        dy = torch.randn(y.shape, generator=gen)
        y.backward(dy)
        want_dx = dy.double() @ W
        torch.testing.assert_close(x.grad.double(), want_dx, rtol=1e-5, atol=1e-5 * want_dx.abs().max().item())
    assert all(t.grad is None and not t.requires_grad for t in vars(w).values() if torch.is_tensor(t))


@pytest.mark.parametrize("kind", ["mxfp4", "fp32"])
def test_project_passes_gradcheck_in_float64(kind):
    w = mxfp4_expert(32, 32, seed=2) if kind == "mxfp4" else dense_expert(32, 32, torch.float64, seed=2)
    x = torch.randn(3, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3), requires_grad=True)
    for proj in ("w1", "w2"):
        assert torch.autograd.gradcheck(lambda x, proj=proj: ag.project(ag.Held(w), proj, x), (x,))


def test_backward_uses_the_held_weights_not_a_saved_copy():
    """The graph keeps the expert only through its Held: whatever get() returns at backward is used."""
    w, other = mxfp4_expert(64, 32, seed=4), mxfp4_expert(64, 32, seed=5)

    class Swapping(ag.Held):
        def get(self):
            return self.w

    held = Swapping(w)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(6), requires_grad=True)
    y = ag.project(held, "w1", x)
    held.w = other  # as a store's hold fetches the same bytes again after an eviction
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(x.grad, torch.ones(2, 32) @ format_of(other).weight(other, "w1", torch.float32))


@pytest.mark.parametrize("kind", list(EXPERTS))
def test_train_forward_is_the_expert_plus_its_adapter(kind):
    w = EXPERTS[kind]()
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(6, 64, generator=gen)
    assert_close = lambda got, want: torch.testing.assert_close(got.double(), want, rtol=2e-5,
                                                                atol=2e-5 * want.abs().max().item())
    want = format_of(w).reference(w, x.double(), "situ", BETAS)
    assert_close(ag.train_forward(ag.Held(w), x, "situ", BETAS), want)
    assert_close(run_expert(w, x, "situ", BETAS), want)  # the inference kernels agree
    lora = {p: torch.randn(*format_of(w).shape(w, p)[:1], format_of(w).shape(w, p)[1], generator=gen) * 0.01 for p in PROJS}
    adapter = lambda proj, inp: inp @ lora[proj].T if proj != "w3" else None
    W = {p: format_of(w).weight(w, p, torch.float64) for p in PROJS}
    x64 = x.double()
    h = glu_reference("situ", x64 @ (W["w1"] + lora["w1"].double()).T, x64 @ W["w3"].T, BETAS)
    assert_close(ag.train_forward(ag.Held(w), x, "situ", BETAS, adapter), h @ (W["w2"] + lora["w2"].double()).T)


@pytest.mark.parametrize("act", ["situ", "silu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_frozen_group_matches_the_float64_experts_forward_and_backward(act, dtype):
    """`frozen_group` (one node for all experts) against each expert in float64 plain torch: outputs and
    input gradients, with uneven counts (one of a single pair)."""
    experts = [dense_expert(64, 96, dtype, seed=s) for s in range(5)]
    counts = [7, 1, 12, 3, 9]
    assert all(ag.groupable(w, torch.zeros(1, 64)) for w in experts)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(sum(counts), 64, generator=gen, requires_grad=True)
    dy = torch.randn(sum(counts), 64, generator=gen)
    y = ag.frozen_group([ag.Held(w) for w in experts], x, counts, act, BETAS)
    y.backward(dy)
    x64 = x.detach().double().requires_grad_()
    want = torch.cat([format_of(w).reference(w, part, act, BETAS) for w, part in zip(experts, x64.split(counts))])
    want.backward(dy.double())
    for got, ref in ((y, want), (x.grad, x64.grad)):
        assert got.dtype == torch.float32 and got.shape == ref.shape
        torch.testing.assert_close(got.double(), ref.detach(), rtol=2e-5, atol=2e-5 * ref.abs().max().item())
    assert all(t.grad is None and not t.requires_grad for w in experts for t in vars(w).values() if torch.is_tensor(t))


def test_frozen_group_passes_gradcheck_in_float64():
    experts = [dense_expert(32, 32, torch.float64, seed=s) for s in (9, 10)]
    x = torch.randn(5, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(11), requires_grad=True)
    helds = [ag.Held(w) for w in experts]
    assert torch.autograd.gradcheck(lambda x: ag.frozen_group(helds, x, [2, 3], "situ", BETAS), (x,))


def test_frozen_group_backward_uses_the_held_weights():
    """As `project`: the group keeps its experts only through their Held objects (its own copy of the list)."""
    w, other = dense_expert(64, 32, torch.bfloat16, seed=12), dense_expert(64, 32, torch.bfloat16, seed=13)

    class Swapping(ag.Held):
        def get(self):
            return self.w

    held = Swapping(w)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(14), requires_grad=True)
    helds, counts = [held], [3]
    y = ag.frozen_group(helds, x, counts, "silu", BETAS)
    helds.clear(), counts.clear()  # the caller's lists are its own again (the MoE block reuses them)
    held.w = other
    y.backward(torch.ones_like(y))
    x64 = x.detach().double().requires_grad_()
    W = {p: format_of(other).weight(other, p, torch.float64) for p in PROJS}
    # the forward's saved gate/up came from w; backward's products from `other`
    g, u = x64 @ format_of(w).weight(w, "w1", torch.float64).T, x64 @ format_of(w).weight(w, "w3", torch.float64).T
    g.retain_grad(), u.retain_grad()
    dh = torch.ones(3, 64, dtype=torch.float64) @ W["w2"]
    dg, du = torch.autograd.grad(glu_reference("silu", g, u), (g, u), dh)
    torch.testing.assert_close(x.grad.double(), dg @ W["w1"] + du @ W["w3"], rtol=1e-5, atol=1e-6)


def test_float_check_finite_finds_nan_and_inf_and_passes_sums_that_overflow():
    names = {p: {"weight": f"e.{p}.weight"} for p in PROJS}
    big = torch.full((4, 4), 3.0e38).bfloat16()  # finite, but its fp32 sum overflows: the full check runs
    w = ExpertWeights(big, big.clone(), big.clone())
    assert format_of(w).check_finite(w, names) is None
    for bad, at in ((float("nan"), [1, 2]), (float("inf"), [3, 0])):
        up = torch.zeros(4, 4, dtype=torch.bfloat16)
        up[tuple(at)] = bad
        if bad == float("inf"):
            up[0, 0] = -bad  # +Inf and -Inf sum to NaN: still caught, first at [0, 0]
            at = [0, 0]
        w = ExpertWeights(torch.zeros(4, 4, dtype=torch.bfloat16), up, torch.zeros(4, 4, dtype=torch.bfloat16))
        name, proj, what = format_of(w).check_finite(w, names)
        assert (name, proj) == ("e.w3.weight", "w3") and f"first at {at}" in what


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_frozen_moe_is_the_weighted_sum_of_the_experts(dtype):
    """`frozen_moe` against plain float64 torch: each token's pairs' expert outputs times their weights,
    summed; the gradients of the input rows (a token routed to several experts) and of the weights."""
    experts = [dense_expert(64, 96, dtype, seed=s) for s in range(4)]
    gen = torch.Generator().manual_seed(15)
    T, counts = 6, [3, 1, 5, 2]
    token_of = torch.cat([torch.randperm(T, generator=gen)[:n].sort().values for n in counts])
    h = torch.randn(T, 64, generator=gen, requires_grad=True)
    wts = torch.rand(sum(counts), generator=gen, requires_grad=True)
    out = ag.frozen_moe([ag.Held(w) for w in experts], h, token_of, wts, counts, "situ", BETAS)
    dout = torch.randn(T, 64, generator=gen)
    out.backward(dout)
    h64, w64 = h.detach().double().requires_grad_(), wts.detach().double().requires_grad_()
    ys = torch.cat([format_of(w).reference(w, h64[rows], "situ", BETAS)
                    for w, rows in zip(experts, token_of.split(counts))])
    want = torch.zeros(T, 64, dtype=torch.float64).index_add(0, token_of, ys * w64[:, None])
    want.backward(dout.double())
    for got, ref in ((out, want), (h.grad, h64.grad), (wts.grad, w64.grad)):
        assert got.dtype == torch.float32 and got.shape == ref.shape
        torch.testing.assert_close(got.double(), ref.detach(), rtol=2e-5, atol=2e-5 * ref.abs().max().item())


def test_frozen_moe_passes_gradcheck_in_float64():
    experts = [dense_expert(32, 32, torch.float64, seed=s) for s in (16, 17)]
    gen = torch.Generator().manual_seed(18)
    h = torch.randn(3, 32, dtype=torch.float64, generator=gen, requires_grad=True)
    wts = torch.rand(4, dtype=torch.float64, generator=gen, requires_grad=True)
    token_of = torch.tensor([0, 2, 0, 1])
    helds = [ag.Held(w) for w in experts]
    assert torch.autograd.gradcheck(lambda h, w: ag.frozen_moe(helds, h, token_of, w, [2, 2], "situ", BETAS), (h, wts))


def test_frozen_nodes_take_bf16_weights_as_stored_and_widen_the_rest():
    """Where the C kernel is, bf16 experts under fp32 math go to the products as stored (no fp32 copy); fp16
    ones are widened into the reused buffers, fp32 ones taken as they are."""
    if cpu_kernels.kernel() is None:
        pytest.skip(f"the kernel does not build here: {cpu_kernels.build_error()}")
    wide = ag._Widened(torch.float32, torch.device("cpu"))
    bf16, fp16, fp32 = (dense_expert(64, 32, t, seed=30) for t in (torch.bfloat16, torch.float16, torch.float32))
    assert all(m is getattr(bf16, f) for m, f in zip(wide.get(bf16), ag._Widened.FIELDS))
    assert all(m is getattr(fp32, f) for m, f in zip(wide.get(fp32), ag._Widened.FIELDS))
    mats = wide.get(fp16)
    assert all(m.dtype == torch.float32 and torch.equal(m, getattr(fp16, f).float()) and m is wide.bufs[f]
               for m, f in zip(mats, ag._Widened.FIELDS))
