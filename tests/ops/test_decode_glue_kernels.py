"""The decode glue's C kernels against their torch paths: rms_norm, res_mix (AttnRes), route (the MoE
router), and the clear errors of the one-call KDA and MLA layer decodes (their parity with the torch
decode is in tests/models/test_k3_parts.py); and the weight-derived tensors kept between steps
(layers.basic.derived)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moeswap.models.layers.attn_res import mix, mix_reference
from moeswap.models.layers.basic import derived, rms_norm
from moeswap.ops import cpu_kernels, kernel_experts

kernel = cpu_kernels.kernel()
needs_kernel = pytest.mark.skipif(kernel is None, reason=f"no CPU kernel: {cpu_kernels.build_error()}")


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 1024), (3, 1, 96), (70, 1024), (5, 7)])  # 70 x 1024 runs threaded
@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_kernel_matches_torch(shape, with_weight):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g) * 3
    w = torch.randn(shape[-1], generator=g) if with_weight else None
    want = F.rms_norm(x, (shape[-1],), w, 1e-5)
    got = kernel.rms_norm(x, w, 1e-5)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    # rows are independent: one row alone gives the same bits as inside a batch (batched == single)
    assert torch.equal(kernel.rms_norm(x.reshape(-1, shape[-1])[-1:], w, 1e-5), got.reshape(-1, shape[-1])[-1:])


@needs_kernel
def test_rms_norm_layer_function_uses_the_kernel_only_without_autograd():
    x = torch.randn(2, 64)
    w = torch.randn(64, requires_grad=True)
    y = rms_norm(x, w, 1e-5)  # gradients wanted: torch's path
    y.sum().backward()
    assert w.grad is not None
    with torch.no_grad():
        torch.testing.assert_close(rms_norm(x, w, 1e-5), y.detach(), rtol=2e-6, atol=2e-6)
    bf = x.bfloat16()
    with torch.no_grad():
        assert rms_norm(bf, w, 1e-5).dtype == torch.bfloat16  # computed in fp32, returned in x's dtype


@needs_kernel
def test_rms_norm_propagates_nan_and_names_bad_input():
    x = torch.randn(2, 32)
    x[1, 3] = float("nan")
    y = kernel.rms_norm(x, None, 1e-5)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[0]).all()
    with pytest.raises(ValueError, match=r"rms_norm: x \(2, 32\) torch.float64"):
        kernel.rms_norm(x.double(), None, 1e-5)
    with pytest.raises(ValueError, match="weight"):
        kernel.rms_norm(x, torch.ones(31), 1e-5)


@needs_kernel
@pytest.mark.parametrize("sources, shape", [(2, (1, 1, 1024)), (4, (3, 2, 64)), (13, (1, 1, 96)), (3, (40, 1, 1024))])
def test_res_mix_kernel_matches_the_reference(sources, shape):
    g = torch.Generator().manual_seed(sources)
    bank = [torch.randn(*shape, generator=g) * (1 + s) for s in range(sources - 1)]
    partial = torch.randn(*shape, generator=g)
    score = torch.randn(shape[-1], generator=g) * 0.05  # scores of a few units: a real softmax, not one-hot
    want = mix_reference(partial, bank, score, 1e-5)
    got = kernel.res_mix([*bank, partial], score, 1e-5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert torch.equal(mix(partial, bank, score, 1e-5), got)  # the model's mix takes the kernel
    assert not torch.equal(got, kernel.res_mix([*bank, partial], score * 3, 1e-5))  # the score matters


@needs_kernel
def test_res_mix_names_bad_input_and_keeps_autograd_on_the_reference():
    a, b = torch.randn(2, 8), torch.randn(2, 8)
    with pytest.raises(ValueError, match="res_mix: 2 sources"):
        kernel.res_mix([a, b[:1]], torch.randn(8), 1e-5)
    with pytest.raises(ValueError, match="res_mix: 0 sources"):
        kernel.res_mix([], torch.randn(8), 1e-5)
    b.requires_grad_(True)
    mix(b, [a], torch.randn(8), 1e-5).sum().backward()
    assert b.grad is not None


def test_derived_tensors_follow_their_sources():
    layer = nn.Linear(4, 3, bias=False)
    calls = []

    def make():
        calls.append(1)
        return layer.weight.detach() * 2

    with torch.no_grad():
        first = derived(layer, "double", make, layer.weight)
        assert derived(layer, "double", make, layer.weight) is first and len(calls) == 1
        layer.weight.add_(1)  # in place: a new version
        assert torch.equal(derived(layer, "double", make, layer.weight), layer.weight * 2) and len(calls) == 2
        layer.weight = nn.Parameter(torch.zeros(3, 4))  # a new tensor
        assert torch.equal(derived(layer, "double", make, layer.weight), torch.zeros(3, 4)) and len(calls) == 3
    derived(layer, "double", make, layer.weight)  # gradients wanted: always made afresh
    assert len(calls) == 4


@needs_kernel
@pytest.mark.parametrize("scoring, renormalize, scale, groups", [
    ("sigmoid", True, 2.5, 1), ("softmax", False, 1.0, 1),
    ("sigmoid", True, 2.5, 4), ("sigmoid", True, 1.0, 8)])  # DeepSeek-V3's group-limited routing: 2 groups kept
def test_route_kernel_matches_the_router_reference(scoring, renormalize, scale, groups):
    from moeswap.config import parse_config
    from moeswap.models.layers.moe import Router
    from moeswap.tiny import tiny_config

    cfg = parse_config(tiny_config("kimi_k3", "tiny"))
    router = Router(cfg)
    router.scoring, router.renormalize, router.scaling = scoring, renormalize, scale
    router.groups, router.topk_group = groups, 2 if groups > 1 else 1
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        router.e_score_correction_bias.copy_(torch.randn(router.weight.shape[0], generator=g) * 0.1)
    x = torch.randn(37, cfg.hidden_size, generator=g)
    want_ids, want_w = router.reference(x)
    if groups > 1:  # the choice really is limited: without groups some tokens would pick other experts
        router.groups = 1
        assert not torch.equal(router.reference(x)[0], want_ids)
        router.groups = groups
        per = cfg.moe.num_experts // groups
        assert all(len(set((row // per).tolist())) <= 2 for row in want_ids)
    with torch.no_grad():
        ids, w = router(x)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(w, want_w, rtol=1e-5, atol=1e-6)
        one_ids, one_w = router(x[5:6])  # per token: batched == single
        assert torch.equal(one_ids, ids[5:6]) and torch.equal(one_w, w[5:6])
    with pytest.raises(ValueError, match="route: .*top-99"):
        kernel.route(x, router.weight.detach(), router.e_score_correction_bias.detach(), 99, False, True, 1.0)


@needs_kernel
def test_layer_decode_kernels_name_bad_input():
    H, N, R, L, V, B, cap = 2, 8, 4, 16, 8, 2, 5
    q, latent = torch.randn(B, H, N + R), torch.randn(B, cap, L + R)
    w_k, w_v = torch.randn(H, N, L), torch.randn(H, L, V)
    out = kernel.mla_decode(q, latent, torch.tensor([5, 2]), w_k, w_v, 0.3)
    assert out.shape == (B, H * V) and torch.isfinite(out).all()
    with pytest.raises(ValueError, match=r"cache lengths \[6, 2\] outside 1..5"):
        kernel.mla_decode(q, latent, torch.tensor([6, 2]), w_k, w_v, 0.3)
    with pytest.raises(ValueError, match="mla_decode: q"):
        kernel.mla_decode(q, latent[:, :, :-1], torch.tensor([5, 2]), w_k, w_v, 0.3)
    K, W = 8, 4
    C = H * K
    T = 3
    args = dict(qkv=torch.randn(B, T, 3 * C), conv=torch.zeros(B, W - 1, 3 * C), taps=torch.randn(W, 3 * C),
                z=torch.randn(B, T, C), dt_bias=torch.zeros(C), decay_rate=torch.ones(H), lower_bound=-5.0,
                b_in=torch.randn(B, T, H), state=torch.zeros(B, H, K, K), gate=torch.randn(B, T, C),
                o_norm=torch.ones(K), norm_eps=1e-5, scale=K**-0.5, l2_eps=1e-6)
    assert kernel.kda_layer(**args).shape == (B, T, C)
    with pytest.raises(ValueError, match=r"kda_layer: conv \(2, 3, 47\)"):
        kernel.kda_layer(**{**args, "conv": torch.zeros(B, W - 1, 3 * C - 1)})
    with pytest.raises(ValueError, match=r"kda_layer: z \(2, 2, 16\)"):
        kernel.kda_layer(**{**args, "z": torch.randn(B, T - 1, C)})


def test_derived_tensors_made_under_inference_mode_do_not_leak_into_training():
    """A scheduler step (inference_mode) then a training step on the same frozen weights: the kept copy
    from the first must not be saved for the second's backward (inference tensors cannot be)."""
    layer = nn.Linear(4, 3, bias=False).requires_grad_(False)
    make = lambda: layer.weight.float() * 2  # noqa: E731
    with torch.inference_mode():
        assert derived(layer, "double", make, layer.weight).is_inference()
    x = torch.randn(2, 3, requires_grad=True)
    w = derived(layer, "double", make, layer.weight)
    assert not w.is_inference()
    (x @ w).sum().backward()  # would raise if w were the inference-mode copy
    assert x.grad is not None


@needs_kernel
@pytest.mark.parametrize("kind", ["mxfp4", "bf16"])
def test_moe_resident_groups_the_routers_choice_as_the_caller_would(kind):
    """moe_resident (router output + a pointer table) adds exactly what `moe` adds for the same pairs
    grouped by expert, token order within; a chosen expert without a row computes nothing (None). Its
    latent form (latent_moe_resident) equals the calls it replaces."""
    from moeswap.experts.pairs import pairs_by_expert
    from moeswap.formats import mxfp4
    from moeswap.ops.expert import ExpertWeights, MXFP4ExpertWeights

    g = torch.Generator().manual_seed(5)
    I, F_, E, T, K = 64, 96, 10, 5, 3

    def make():
        if kind == "bf16":
            return ExpertWeights(*(torch.randn(*s, generator=g).bfloat16() for s in ((F_, I), (F_, I), (I, F_))))
        return MXFP4ExpertWeights(*mxfp4.encode(torch.randn(F_, I, generator=g)),
                                  *mxfp4.encode(torch.randn(F_, I, generator=g)), *mxfp4.encode(torch.randn(I, F_, generator=g)))

    experts = [make() for _ in range(E)]
    table = torch.zeros(E, 6, dtype=torch.int64)
    for e in range(E - 1):  # the last expert has no row
        F_got, row = kernel_experts.resident_row(experts[e], I, kind)
        table[e] = torch.tensor(row)
    assert F_got == F_
    x = torch.randn(T, I, generator=g)
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    got = torch.zeros(T, I)
    assert kernel.moe_resident(x, table, ids, w, F_, kind, "silu", (1.0, 1.0), got) == len(set(ids.flatten().tolist()))
    unique, counts, tokens, weights = pairs_by_expert(ids, w)
    want = torch.zeros(T, I)
    kernel_experts.moe(kernel, x, [experts[e] for e in unique], tokens,
                       [0, *torch.tensor(counts).cumsum(0).tolist()], weights, "silu", (1.0, 1.0), want)
    assert torch.equal(got, want) and got.abs().sum() > 0
    ids[2, 1] = E - 1
    untouched = torch.zeros(T, I)
    assert kernel.moe_resident(x, table, ids, w, F_, kind, "silu", (1.0, 1.0), untouched) is None
    assert not untouched.any()
    ids[2, 1] = E
    with pytest.raises(RuntimeError, match="moe_resident .*bad sizes"):
        kernel.moe_resident(x, table, ids, w, F_, kind, "silu", (1.0, 1.0), untouched)
    with pytest.raises(ValueError, match=r"moe_resident: .*ids \(5, 3\) torch.int32"):
        kernel.moe_resident(x, table, ids.int(), w, F_, kind, "silu", (1.0, 1.0), untouched)
    # K3's latent form in one call: down projection, these experts, RMSNorm, up projection; the same bits
    ids[2, 1] = 0
    D = 48
    w_down, w_up = torch.randn(I, D, generator=g).bfloat16(), torch.randn(D, I, generator=g).bfloat16()
    norm_w, xd = torch.rand(I, generator=g) + 0.5, torch.randn(T, D, generator=g)
    y, used = kernel.latent_moe_resident(xd, w_down, norm_w, 1e-5, w_up, table, ids, w, F_, kind, "silu", (1.0, 1.0))
    routed = torch.zeros(T, I)
    assert kernel.moe_resident(kernel.bf16_linear(xd, w_down), table, ids, w, F_, kind, "silu", (1.0, 1.0), routed) == used
    assert torch.equal(y, kernel.bf16_linear(kernel.rms_norm(routed, norm_w, 1e-5), w_up))
    ids[0, 0] = E - 1
    assert kernel.latent_moe_resident(xd, w_down, norm_w, 1e-5, w_up, table, ids, w, F_, kind, "silu", (1.0, 1.0)) is None
    with pytest.raises(ValueError, match=r"latent_moe_resident: .*up \(48, 63\)"):
        kernel.latent_moe_resident(xd, w_down, None, 1e-5, w_up[:, :63].contiguous(), table, ids, w, F_, kind, "silu",
                                   (1.0, 1.0))


@needs_kernel
@pytest.mark.parametrize("act", ["situ", "silu"])
def test_gated_mlp_in_one_call_gives_the_three_calls_outputs(act, monkeypatch):
    """A decode step's GatedMLP on bf16 weights runs as one C call (cpu_kernels.bf16_mlp): the same bits as
    bf16_linear, glu, bf16_linear for SiTU (its C glu either way); SiLU's three-call path uses torch's silu."""
    from moeswap.models.layers import basic
    from moeswap.models.layers.basic import GatedMLP
    from moeswap.weights.dense import WeightLinear
    from moeswap.weights.floating import BF16_STORED

    g = torch.Generator().manual_seed(9)
    mlp = GatedMLP(64, 96, act, (4.0, 25.0))
    for name in ("gate_proj", "up_proj", "down_proj"):
        old = getattr(mlp, name)
        new = WeightLinear(old.in_features, old.out_features, BF16_STORED)
        new.weight = nn.Parameter(torch.randn(old.weight.shape, generator=g).bfloat16(), requires_grad=False)
        setattr(mlp, name, new)
    mlp.fuse_projections()
    x = torch.randn(3, 2, 64, generator=g)
    calls = []
    real = cpu_kernels.CpuKernels.bf16_mlp
    monkeypatch.setattr(cpu_kernels.CpuKernels, "bf16_mlp", lambda self, *a: calls.append(1) or real(self, *a))
    with torch.no_grad():
        one = mlp(x)
        assert len(calls) == 1 and one.shape == (3, 2, 64)
        monkeypatch.setattr(basic, "KERNEL_MAX_ROWS", 0)  # the three-call path
        three = mlp(x)
    assert len(calls) == 1
    if act == "situ":
        assert torch.equal(one, three)
    else:
        torch.testing.assert_close(one, three, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"bf16_mlp: .*down \(64, 95\)"):
        kernel.bf16_mlp(x[0], mlp.__dict__["_fused_input"][0], mlp.down_proj.weight[:, :95].contiguous(), act,
                        (4.0, 25.0))
