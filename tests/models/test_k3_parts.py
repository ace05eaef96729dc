"""K3-only parts against formulas written out here from shared/docs/kimi_k3.md of the design docs.

Each reference below is a plain transcription of the spec (explicit loops, float64) and deliberately
calls none of moeswap's helpers (rms_norm, glu, mix, l2_normalize, ...): SiTU-GLU (§5.3), the KDA
bounded/unbounded decay gates and full-rank/low-rank output gates and a whole KDA layer (§3), gated
MLA with q-LoRA (§4), the latent MoE with bias-corrected routing (§5), block attention residuals
(§6) and the layer skeleton that wires them (§2). Modules run in fp32 on random weights; results are
compared relative to the largest reference value.
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from moeswap.archs import REGISTRY
from moeswap.config import parse_config
from moeswap.models.layers.attn_res import mix, score_vector
from moeswap.models.layers.basic import WeightOnly
from moeswap.models.layers.kda import KDA, KDAState
from moeswap.models.layers.mla import MLA, MLACache
from moeswap.models.layers.moe import MoE
from moeswap.ops.activation import glu
from moeswap.ops.expert import ExpertWeights
from moeswap.tiny import tiny_config, write_tiny_model
from moeswap.weights.registry import run_expert

EPS = 1e-5  # rms_norm_eps, o_norm eps and the attn-res rmsnorm eps of the spec


# ----------------------------------------------------------------------------- helpers


def cfg_for(arch: str):
    return parse_config(tiny_config(arch, "tiny"))


# The registered architectures whose tiny model has KDA layers, and NoPE MLA (the spec's, unrotated k_r)
KDA_ARCHS = [a for a in REGISTRY if "kda" in cfg_for(a).attn_kinds]
NOPE_MLA_ARCHS = [a for a in REGISTRY if "mla" in cfg_for(a).attn_kinds and cfg_for(a).mla.rope is None]


def randomize(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Seeded random weights of informative size (norm weights near 1, A_log so exp(A_log) in [0.5, 8])."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.5, 8.0, generator=gen).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif name.endswith("e_score_correction_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif "conv1d" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    return module.eval()


def W(linear) -> torch.Tensor:
    """A module's weight as float64 (for the references)."""
    return linear.weight.detach().double()


def assert_close(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-5, what: str = "") -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    scale = want.double().abs().max().item()
    err = (got.double() - want.double()).abs().max().item()
    assert scale > 1e-3, f"{what}: reference is ~0 ({scale:.2e}); the comparison would mean nothing"
    assert err <= rtol * scale, f"{what}: max abs err {err:.3e} vs scale {scale:.3e} (rtol {rtol})"


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def ref_rmsnorm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = EPS) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last axis, float64."""
    x = x.double()
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight.detach().double()


def ref_situ_glu(g: torch.Tensor, u: torch.Tensor, b1: float = 4.0, b2: float = 25.0) -> torch.Tensor:
    """§5.3: situ(g, u) = b1 tanh(g/b1) sigmoid(g) * b2 tanh(u/b2), float64."""
    g, u = g.double(), u.double()
    return b1 * torch.tanh(g / b1) * (1.0 / (1.0 + torch.exp(-g))) * (b2 * torch.tanh(u / b2))


def ref_softplus(x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return torch.where(x > 30, x, torch.log1p(torch.exp(torch.clamp(x, max=30))))


# ----------------------------------------------------------------------------- 1. activations


def test_situ_glu_matches_spec_elementwise_including_saturation():
    cfg = cfg_for("kimi_k3")
    assert cfg.hidden_act == "situ" and (cfg.situ_beta, cfg.situ_linear_beta) == (4.0, 25.0)
    values = [-1000.0, -200.0, -60.0, -20.0, -4.0, -1.0, -0.3, 0.0, 0.2, 1.0, 3.9, 8.0, 30.0, 60.0, 300.0, 1000.0]
    g = torch.tensor([a for a in values for _ in values])
    u = torch.tensor([b for _ in values for b in values])
    for b1, b2 in ((4.0, 25.0), (2.0, 10.0)):
        want = torch.tensor(
            [b1 * math.tanh(a / b1) * sigmoid(a) * b2 * math.tanh(b / b2) for a, b in zip(g.tolist(), u.tolist())],
            dtype=torch.float64,
        )
        got = glu("situ", g, u, (b1, b2))
        assert torch.isfinite(got).all()
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6), (b1, b2)
    # saturation: both halves are soft-capped at b1 (gate, for g -> +inf) and b2 (up, for |u| -> inf)
    big = glu("situ", torch.tensor([1000.0, 1000.0, -1000.0]), torch.tensor([1000.0, -1000.0, 1000.0]))
    assert torch.allclose(big, torch.tensor([100.0, -100.0, 0.0]), atol=1e-4)
    # the betas go to the right halves (swapping them changes the result)
    x = torch.tensor([6.0]), torch.tensor([40.0])
    assert (glu("situ", *x, (4.0, 25.0)) - glu("situ", *x, (25.0, 4.0))).abs().item() > 1.0


def test_swiglu_matches_spec():
    gen = torch.Generator().manual_seed(0)
    g = torch.cat([torch.randn(200, generator=gen) * 5, torch.tensor([-100.0, 0.0, 100.0])])
    u = torch.randn(203, generator=gen) * 3
    want = torch.tensor([a * sigmoid(a) * b for a, b in zip(g.tolist(), u.tolist())], dtype=torch.float64)
    got = glu("silu", g, u)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(glu("situ", g, u).double(), want, rtol=1e-3)  # the two differ on these inputs


def test_expert_weights_compute_w2_act_w1_times_w3():
    gen = torch.Generator().manual_seed(1)
    w1, w3, w2 = torch.randn(12, 8, generator=gen), torch.randn(12, 8, generator=gen), torch.randn(8, 12, generator=gen)
    x = torch.randn(5, 8, generator=gen)
    want = torch.zeros(5, 8, dtype=torch.float64)
    for t in range(5):
        hid = ref_situ_glu(w1.double() @ x[t].double(), w3.double() @ x[t].double())
        want[t] = w2.double() @ hid
    assert_close(run_expert(ExpertWeights(w1, w3, w2), x, "situ", (4.0, 25.0)), want)


# ----------------------------------------------------------------------------- 2. KDA


def make_kda(arch: str, seed: int = 0) -> KDA:
    return randomize(KDA(cfg_for(arch)), seed)


def ref_decay(layer: KDA, x: torch.Tensor, lower_bound: float | None) -> torch.Tensor:
    """§3.5 per head h and key channel c: z = W_fb W_fa x; g from A_log[h] and dt_bias[h*D + c]."""
    H, D = layer.H, layer.K
    z = x.double() @ W(layer.f_a_proj).T @ W(layer.f_b_proj).T  # [..., H*D]
    out = torch.empty(*x.shape[:-1], H, D, dtype=torch.float64)
    a_log, dt_bias = layer.A_log.detach().double(), layer.dt_bias.detach().double()
    for h in range(H):
        for c in range(D):
            zz = z[..., h * D + c] + dt_bias[h * D + c]
            if lower_bound is not None:
                out[..., h, c] = lower_bound / (1.0 + torch.exp(-torch.exp(a_log[h]) * zz))
            else:
                out[..., h, c] = -torch.exp(a_log[h]) * ref_softplus(zz)
    return out


def test_kda_bounded_decay_gate_k3():
    cfg = cfg_for("kimi_k3")
    assert cfg.kda.gate_lower_bound == -5.0
    layer = make_kda("kimi_k3", seed=1)
    x = torch.randn(2, 7, cfg.hidden_size, generator=torch.Generator().manual_seed(2)) * 0.5
    want = ref_decay(layer, x, -5.0)
    got = layer.decay(x)
    assert_close(got, want)
    assert got.dtype == torch.float32
    assert (want < 0).all() and (want > -5).all()  # the open interval (-5, 0) of the spec
    assert (got <= 0).all() and (got >= -5).all()  # fp32 sigmoid may round to exactly 0 or 1
    assert want.min() < -4.0 and want.max() > -1.0  # the test spans the gate's range


def test_kda_unbounded_decay_gate_kimi_linear():
    cfg = cfg_for("kimi_linear")
    assert cfg.kda.gate_lower_bound is None
    layer = make_kda("kimi_linear", seed=3)
    x = torch.randn(2, 7, cfg.hidden_size, generator=torch.Generator().manual_seed(4)) * 3
    want = ref_decay(layer, x, None)
    assert_close(layer.decay(x), want)
    assert want.min() < -5.0  # unbounded: goes below K3's bound on these inputs


def test_kda_output_gate_full_rank_k3_and_low_rank_kimi_linear():
    k3, kl = make_kda("kimi_k3", seed=5), make_kda("kimi_linear", seed=6)
    assert hasattr(k3, "g_proj") and not hasattr(k3, "g_a_proj")
    assert hasattr(kl, "g_a_proj") and not hasattr(kl, "g_proj")
    H, D = k3.H, k3.K
    assert k3.g_proj.weight.shape == (H * D, cfg_for("kimi_k3").hidden_size)
    assert kl.g_a_proj.weight.shape[0] == D and kl.g_b_proj.weight.shape == (H * D, D)
    x = torch.randn(3, 5, k3.q_proj.in_features, generator=torch.Generator().manual_seed(7))
    want = torch.zeros(3, 5, H * D, dtype=torch.float64)
    for b in range(3):
        for t in range(5):
            want[b, t] = W(k3.g_proj) @ x[b, t].double()
    assert_close(k3.output_gate(x), want)
    want_kl = x.double() @ W(kl.g_a_proj).T @ W(kl.g_b_proj).T
    assert_close(kl.output_gate(x), want_kl)


def ref_kda_layer(layer: KDA, x: torch.Tensor, lower_bound: float | None) -> torch.Tensor:
    """§3 steps 1-7 from scratch, token by token, float64. x: [B, T, d]."""
    B, T, _ = x.shape
    H, D, Wd = layer.H, layer.K, layer.W
    xd = x.double()
    # 1. projections
    proj = {n: xd @ W(getattr(layer, f"{n}_proj")).T for n in "qkv"}  # [B, T, H*D]
    # 2. causal depthwise conv (width W, no bias; tap W-1 multiplies the current input), then SiLU
    conv = {}
    for n in "qkv":
        w = getattr(layer, f"{n}_conv1d").weight.detach().double()  # [C, 1, W]
        y = torch.zeros_like(proj[n])
        for t in range(T):
            for j in range(Wd):
                src = t - (Wd - 1) + j
                if src >= 0:
                    y[:, t] += w[:, 0, j] * proj[n][:, src]
        conv[n] = y * (1.0 / (1.0 + torch.exp(-y)))
    q, k, v = (conv[n].reshape(B, T, H, D) for n in "qkv")
    # 3. per-head L2 norm (eps 1e-6); q scaled by D^-1/2
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * D**-0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    # 4. beta, 5. decay
    beta = 1.0 / (1.0 + torch.exp(-(xd @ W(layer.b_proj).T)))  # [B, T, H]
    g = ref_decay(layer, x, lower_bound)  # [B, T, H, D]
    # 6. recurrence, decay before the delta
    o = torch.zeros(B, T, H, D, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            S = torch.zeros(D, D, dtype=torch.float64)
            for t in range(T):
                S = torch.exp(g[b, t, h])[:, None] * S
                u = beta[b, t, h] * (v[b, t, h] - S.T @ k[b, t, h])
                S = S + torch.outer(k[b, t, h], u)
                o[b, t, h] = S.T @ q[b, t, h]
    # 7. o_norm (one [D] weight for all heads, eps 1e-5) times sigmoid(output gate), then o_proj
    gate = xd @ W(layer.g_proj).T if hasattr(layer, "g_proj") else xd @ W(layer.g_a_proj).T @ W(layer.g_b_proj).T
    gate = gate.reshape(B, T, H, D)
    wn = layer.o_norm.weight.detach().double()
    y = torch.zeros(B, T, H * D, dtype=torch.float64)
    for h in range(H):
        oh = o[:, :, h]
        normed = oh / torch.sqrt((oh * oh).mean(-1, keepdim=True) + EPS) * wn
        y[:, :, h * D:(h + 1) * D] = normed / (1.0 + torch.exp(-gate[:, :, h]))
    return y @ W(layer.o_proj).T


@pytest.mark.parametrize("arch", KDA_ARCHS)
def test_kda_layer_matches_spec_from_scratch(arch):
    cfg = cfg_for(arch)
    layer = make_kda(arch, seed=8)
    T = 70  # crosses the 64-token chunk of the prefill path
    x = torch.randn(2, T, cfg.hidden_size, generator=torch.Generator().manual_seed(9))
    want = ref_kda_layer(layer, x, cfg.kda.gate_lower_bound)
    with torch.no_grad():
        got = layer(x)
    assert_close(got, want, rtol=1e-5)


@pytest.mark.parametrize("arch", KDA_ARCHS)
def test_kda_layer_prefill_then_decode_equals_full_pass(arch):
    """Prefill with a state, then T == 1 steps (token recurrence + conv state) equal one full pass."""
    cfg = cfg_for(arch)
    layer = make_kda(arch, seed=10)
    x = torch.randn(2, 12, cfg.hidden_size, generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        full = layer(x)
        state = KDAState.zeros(2, layer.H, layer.K, layer.W, torch.float32, "cpu")
        parts = [layer(x[:, :5], state)]
        for t in range(5, 12):
            parts.append(layer(x[:, t:t + 1], state))
    assert_close(torch.cat(parts, dim=1), full)
    assert_close(full, ref_kda_layer(layer, x, cfg.kda.gate_lower_bound))


def fused_and_torch_decode(monkeypatch, layer_module, kernel_name: str, steps: int, run):
    """run() once on the layer's one-call C kernel (checking it ran `steps` times), then again with
    `layer_module`'s kernel lookup turned off (the torch path); returns both results."""
    from moeswap.ops import cpu_kernels

    if cpu_kernels.kernel() is None:
        pytest.skip("no CPU kernel")
    calls = []
    real = getattr(cpu_kernels.CpuKernels, kernel_name)
    monkeypatch.setattr(cpu_kernels.CpuKernels, kernel_name, lambda self, *a: calls.append(1) or real(self, *a))
    fused = run()
    assert len(calls) == steps
    monkeypatch.setattr(layer_module, "cpu_kernels", SimpleNamespace(for_inference=lambda *tensors: None))
    return fused, run()


@pytest.mark.parametrize("arch", KDA_ARCHS)
def test_kda_fused_kernel_equals_the_torch_prefill_and_decode(arch, monkeypatch):
    """The one-call C layer (cpu_kernels.kda_layer: the token recurrence) gives the general path's
    outputs and states, for prefill chunks (the torch path's chunked form, across a chunk boundary
    and from a carried state) and decode tokens."""
    from moeswap.models.layers import kda as kda_module

    cfg = cfg_for(arch)
    layer = make_kda(arch, seed=12)
    x = torch.randn(3, 80, cfg.hidden_size, generator=torch.Generator().manual_seed(13))

    def run():
        state = KDAState.zeros(3, layer.H, layer.K, layer.W, torch.float32, "cpu")
        with torch.no_grad():
            outs = [layer(x[:, :70], state), layer(x[:, 70:75], state)]
            outs += [layer(x[:, t:t + 1], state) for t in range(75, 80)]
        return torch.cat(outs, dim=1), state

    (got, s1), (want, s2) = fused_and_torch_decode(monkeypatch, kda_module, "kda_layer", 7, run)
    assert_close(got, want, rtol=1e-4)
    assert_close(s1.recurrent_BHKK, s2.recurrent_BHKK, rtol=1e-4)
    assert torch.equal(s1.conv_BWC, s2.conv_BWC)  # the conv history is copied, not computed


# ----------------------------------------------------------------------------- 3. MLA


def make_mla(arch: str, seed: int = 0) -> MLA:
    return randomize(MLA(cfg_for(arch)), seed)


def ref_mla(layer: MLA, x: torch.Tensor) -> torch.Tensor:
    """§4, non-absorbed: per-head keys [k_nope_h | k_r] and values from kv_b_proj, causal softmax."""
    B, T, _ = x.shape
    H, N, R, V, L = layer.H, layer.N, layer.R, layer.V, layer.L
    xd = x.double()
    if hasattr(layer, "q_a_proj"):  # 1. q-LoRA (K3)
        c_q = ref_rmsnorm(xd @ W(layer.q_a_proj).T, layer.q_a_layernorm.weight)
        q = c_q @ W(layer.q_b_proj).T
    else:
        q = xd @ W(layer.q_proj).T
    q = q.reshape(B, T, H, N + R)
    kv_a = xd @ W(layer.kv_a_proj_with_mqa).T  # 2. [c_kv | k_r]
    c_kv, k_r = ref_rmsnorm(kv_a[..., :L], layer.kv_a_layernorm.weight), kv_a[..., L:]
    kv = (c_kv @ W(layer.kv_b_proj).T).reshape(B, T, H, N + V)  # 3.
    k_nope, v = kv[..., :N], kv[..., N:]
    scale = (N + R) ** -0.5
    attn = torch.zeros(B, T, H * V, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                query = q[b, t, h]
                scores = []
                for s in range(t + 1):  # causal
                    key = torch.cat([k_nope[b, s, h], k_r[b, s]])  # k_r shared by all heads, unrotated
                    scores.append(float(query @ key) * scale)
                m = max(scores)
                p = [math.exp(sc - m) for sc in scores]
                z = sum(p)
                attn[b, t, h * V:(h + 1) * V] = sum(p[s] / z * v[b, s, h] for s in range(t + 1))
    if hasattr(layer, "g_proj"):  # 5. sigmoid output gate (K3)
        attn = attn / (1.0 + torch.exp(-(xd @ W(layer.g_proj).T)))
    return attn @ W(layer.o_proj).T


@pytest.mark.parametrize("arch", NOPE_MLA_ARCHS)
def test_mla_matches_spec_non_absorbed(arch):
    cfg = cfg_for(arch)
    layer = make_mla(arch, seed=12)
    if arch == "kimi_k3":
        assert hasattr(layer, "q_a_proj") and hasattr(layer, "g_proj") and cfg.mla.output_gate
    else:
        assert hasattr(layer, "q_proj") and not hasattr(layer, "g_proj")
    assert layer.scale == pytest.approx((cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim) ** -0.5)
    x = torch.randn(2, 9, cfg.hidden_size, generator=torch.Generator().manual_seed(13))
    want = ref_mla(layer, x)
    with torch.no_grad():
        got = layer(x)
    assert_close(got, want)


def test_mla_output_gate_matters():
    """The gate is applied: with g_proj zeroed (sigmoid = 1/2 everywhere) the output still follows the
    spec and differs from the gated one."""
    layer = make_mla("kimi_k3", seed=14)
    x = torch.randn(1, 6, layer.o_proj.out_features, generator=torch.Generator().manual_seed(15))
    with torch.no_grad():
        gated = layer(x)
        layer.g_proj.weight.zero_()
        half = layer(x)
    want = ref_mla(layer, x)
    assert_close(half, want)
    assert (gated - half).abs().max() > 1e-2


def test_mla_incremental_with_cache_equals_full_pass():
    cfg = cfg_for("kimi_k3")
    layer = make_mla("kimi_k3", seed=16)
    x = torch.randn(2, 11, cfg.hidden_size, generator=torch.Generator().manual_seed(17))
    with torch.no_grad():
        full = layer(x)
        cache = MLACache.empty(2, layer.cache_width(), torch.float32, "cpu", capacity=3)  # forces growth
        parts = [layer(x[:, :4], cache)]
        for t in range(4, 11):
            parts.append(layer(x[:, t:t + 1], cache))
    assert cache.lengths_B.tolist() == [11, 11]
    assert_close(torch.cat(parts, dim=1), full)
    assert_close(full, ref_mla(layer, x))


@pytest.mark.parametrize("arch", NOPE_MLA_ARCHS)
def test_mla_fused_decode_kernel_equals_the_torch_decode(arch, monkeypatch):
    """The one-call C decode (cpu_kernels.mla_decode) gives the torch path's outputs on ragged caches
    (sequences of different lengths in one batch) and leaves the same cache behind."""
    from moeswap.models.layers import mla as mla_module

    cfg = cfg_for(arch)
    layer = make_mla(arch, seed=14)
    x = torch.randn(3, 9, cfg.hidden_size, generator=torch.Generator().manual_seed(15))
    with torch.no_grad():
        base = MLACache.empty(3, layer.cache_width(), torch.float32, "cpu", capacity=16)
        layer(x[:, :5], base)
        base.lengths_B[1] -= 2  # sequence 1 holds 3 tokens, the others 5
        base.max_length = None

    def run():
        cache = MLACache(base.latent_BSX.clone(), base.lengths_B.clone())
        with torch.no_grad():
            outs = [layer(x[:, t:t + 1], cache) for t in range(5, 9)]
        return torch.cat(outs, dim=1), cache

    (got, c1), (want, c2) = fused_and_torch_decode(monkeypatch, mla_module, "mla_decode", 4, run)
    assert_close(got, want, rtol=1e-5)
    assert torch.equal(c1.lengths_B, c2.lengths_B) and torch.equal(c1.latent_BSX, c2.latent_BSX)


# ----------------------------------------------------------------------------- 4. latent MoE


class DictStore:
    """The expert-store protocol: fetch(layer, ids) -> callables, from a plain dict."""

    def __init__(self, layer: int, experts: dict[int, ExpertWeights]):
        self.layer, self.experts, self.fetched = layer, experts, []

    def fetch(self, layer, ids):
        assert layer == self.layer
        self.fetched.append(list(ids))
        return [self.experts[i] for i in ids]


def make_moe(scaling: float = 1.0, seed: int = 20) -> tuple[MoE, DictStore]:
    cfg = cfg_for("kimi_k3")
    assert cfg.moe.latent_dim and cfg.moe.latent_norm and cfg.moe.scoring == "sigmoid" and cfg.moe.renormalize
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, routed_scaling_factor=scaling))
    block = randomize(MoE(cfg, layer_idx=1), seed)
    gen = torch.Generator().manual_seed(seed + 1)
    I, F = cfg.moe.latent_dim, cfg.moe.expert_dim
    experts = {}
    for e in range(cfg.moe.num_experts):
        w1, w3 = (torch.randn(F, I, generator=gen) / math.sqrt(I) for _ in range(2))
        experts[e] = ExpertWeights(w1, w3, torch.randn(I, F, generator=gen) / math.sqrt(F))
    store = DictStore(1, experts)
    block.store = store
    return block, store


def ref_route(block: MoE, x: torch.Tensor, use_bias: bool = True):
    """§5.1 for one token: ids (sorted by s + b) and weights s_i / sum_sel s * scaling."""
    E, k = block.gate.weight.shape[0], block.gate.top_k
    logits = W(block.gate) @ x.double()
    s = [sigmoid(float(v)) for v in logits]
    b = block.gate.e_score_correction_bias.detach().double().tolist()
    choice = [s[e] + (b[e] if use_bias else 0.0) for e in range(E)]
    ids = sorted(range(E), key=lambda e: -choice[e])[:k]
    total = sum(s[e] for e in ids)
    return ids, [s[e] / total * block.gate.scaling for e in ids]


def ref_moe(block: MoE, store: DictStore, x: torch.Tensor, weights_from_choice: bool = False) -> torch.Tensor:
    """§5 per token. weights_from_choice=True is a deliberately wrong variant (bias in the weights)."""
    shape = x.shape
    xs = x.reshape(-1, shape[-1]).double()
    out = torch.zeros(xs.shape, dtype=torch.float64)
    for t in range(xs.shape[0]):
        ids, w = ref_route(block, xs[t])
        if weights_from_choice:
            bias = block.gate.e_score_correction_bias.detach().double()
            s = [sigmoid(float(W(block.gate)[e] @ xs[t])) + float(bias[e]) for e in ids]
            w = [si / sum(s) * block.gate.scaling for si in s]
        h = W(block.routed_expert_down_proj) @ xs[t]  # 2. latent
        r = torch.zeros_like(h)
        for e, we in zip(ids, w):  # 3-4. experts in the latent width, weighted sum
            ex = store.experts[e]
            r = r + we * (ex.w2_IF.double() @ ref_situ_glu(ex.w1_FI.double() @ h, ex.w3_FI.double() @ h))
        y_routed = W(block.routed_expert_up_proj) @ ref_rmsnorm(r, block.routed_expert_norm.weight)
        se = block.shared_experts  # 5. shared experts on full-width x
        y_shared = W(se.down_proj) @ ref_situ_glu(W(se.gate_proj) @ xs[t], W(se.up_proj) @ xs[t])
        out[t] = y_routed + y_shared
    return out.reshape(shape)


def test_router_matches_spec():
    block, _ = make_moe(scaling=2.5)
    x = torch.randn(10, block.gate.weight.shape[1], generator=torch.Generator().manual_seed(21))
    ids, w = block.gate(x)
    for t in range(10):
        want_ids, want_w = ref_route(block, x[t])
        assert ids[t].tolist() == want_ids
        assert torch.allclose(w[t].double(), torch.tensor(want_w, dtype=torch.float64), rtol=1e-5, atol=0)
        assert w[t].sum().item() == pytest.approx(2.5, rel=1e-5)  # renormalized, times the scaling


@pytest.mark.parametrize("scaling", [1.0, 2.5])
def test_latent_moe_matches_spec_per_token(scaling):
    block, store = make_moe(scaling=scaling)
    cfg = cfg_for("kimi_k3")
    assert cfg.moe.num_shared_experts == 2 and block.shared_experts.gate_proj.out_features == 2 * cfg.moe.expert_dim
    x = torch.randn(2, 6, cfg.hidden_size, generator=torch.Generator().manual_seed(22))
    with torch.no_grad():
        got = block(x)
    assert_close(got, ref_moe(block, store, x))
    assert store.fetched and all(len(f) == len(set(f)) for f in store.fetched)


def test_latent_moe_bias_steers_selection_only():
    """A bias that changes the selected experts: the module follows s + b for the choice and s for the
    weights. Both the unbiased choice and bias-in-the-weights are shown to give different outputs."""
    block, store = make_moe(seed=30)
    cfg = cfg_for("kimi_k3")
    x = torch.randn(8, cfg.hidden_size, generator=torch.Generator().manual_seed(31))
    with torch.no_grad():
        # push experts 3 and 11 into every selection although their scores are ordinary
        bias = torch.zeros(cfg.moe.num_experts)
        bias[3], bias[11] = 0.8, 0.6
        block.gate.e_score_correction_bias.copy_(bias)
        got = block(x)
    changed = sum(ref_route(block, x[t])[0] != ref_route(block, x[t], use_bias=False)[0] for t in range(8))
    assert changed >= 4, "the bias should change the selection for most tokens"
    for t in range(8):
        assert {3, 11} <= set(ref_route(block, x[t])[0])
    want = ref_moe(block, store, x)
    assert_close(got, want)
    wrong = ref_moe(block, store, x, weights_from_choice=True)
    assert (wrong - want).abs().max() > 0.05 * want.abs().max()
    with torch.no_grad():
        block.gate.e_score_correction_bias.zero_()
        unbiased = block(x)
    assert (unbiased.double() - want).abs().max() > 0.05 * want.abs().max()


def test_pairs_grouped_by_expert_the_same_in_python_lists_and_torch(monkeypatch):
    """Decode-size steps group their (token, slot) pairs in Python lists, bigger ones with torch ops:
    the same groups (expert order, token order within), and weights stay in autograd's graph."""
    from moeswap.experts import pairs as pairs_module

    g = torch.Generator().manual_seed(40)
    ids = torch.stack([torch.randperm(12, generator=g)[:4] for _ in range(9)])  # [T 9, K 4]
    ids[3] = ids[1]  # two tokens on the same experts
    w = torch.rand(9, 4, generator=g)
    small = pairs_module.pairs_by_expert(ids, w)
    monkeypatch.setattr(pairs_module, "PAIRS_IN_PYTHON", 0)
    big = pairs_module.pairs_by_expert(ids, w)
    assert small[:2] == big[:2] and sum(small[1]) == 36 and small[0] == sorted(set(ids.flatten().tolist()))
    assert torch.equal(small[2], big[2]) and torch.equal(small[3], big[3])
    starts = [sum(small[1][:i]) for i in range(len(small[1]))]
    for e, start, n in zip(small[0], starts, small[1]):
        tokens = small[2][start:start + n].tolist()
        assert tokens == sorted(tokens) and all(e in ids[t].tolist() for t in tokens)
    monkeypatch.setattr(pairs_module, "PAIRS_IN_PYTHON", 256)
    wg = w.clone().requires_grad_()
    pairs_module.pairs_by_expert(ids, wg)[3].sum().backward()
    assert torch.equal(wg.grad, torch.ones_like(w))


# ----------------------------------------------------------------------------- 5. attention residuals


def ref_mix(partial: torch.Tensor, bank: list[torch.Tensor], w: torch.Tensor) -> torch.Tensor:
    """§6 per token: score_j = sum_c rmsnorm(V_j)_c w_c; p = softmax_j; sum_j p_j V_j (raw V_j)."""
    if not bank:
        return partial
    sources = [*bank, partial]
    flat = [s.double().reshape(-1, s.shape[-1]) for s in sources]
    w = w.detach().double()
    out = torch.zeros_like(flat[0])
    for n in range(flat[0].shape[0]):
        scores = []
        for V in flat:
            v = V[n]
            rms = math.sqrt(float((v * v).sum()) / v.numel() + EPS)
            scores.append(float((v / rms * w).sum()))
        m = max(scores)
        e = [math.exp(sc - m) for sc in scores]
        for j, V in enumerate(flat):
            out[n] += e[j] / sum(e) * V[n]
    return out.reshape(partial.shape)


def test_attn_res_mix_matches_spec():
    gen = torch.Generator().manual_seed(40)
    D = 16
    # sources of very different scales: mixing raw vs normalised sources would differ
    bank = [torch.randn(2, 3, D, generator=gen) * s for s in (0.1, 5.0, 1.0)]
    partial = torch.randn(2, 3, D, generator=gen) * 2.0
    norm, proj = WeightOnly(D), WeightOnly(1, D)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.3 * torch.randn(D, generator=gen))
        proj.weight.copy_(torch.randn(1, D, generator=gen))
    w = score_vector(norm, proj)
    assert w.dtype == torch.float32
    assert torch.allclose(w.double(), norm.weight.double() * proj.weight.double()[0])
    got = mix(partial, bank, w, EPS)
    want = ref_mix(partial, bank, w)
    assert_close(got, want)
    # the mix is not degenerate: it is neither the partial sum nor one banked source
    for src in (partial, *bank):
        assert (want - src.double()).abs().max() > 1e-2
    assert mix(partial, [], w, EPS) is partial  # empty bank: the first argument


@pytest.fixture(scope="module")
def tiny_k3(tmp_path_factory):
    from moeswap.models.loader import LoadOptions, load_model

    path = write_tiny_model(tmp_path_factory.mktemp("k3") / "model", "kimi_k3", "tiny", seed=3)
    model, _ = load_model(path, LoadOptions(dtype="float32"))
    return model


def ref_model_forward(model, tokens: torch.Tensor, restart: bool = True) -> tuple[torch.Tensor, int]:
    """§2 literally; the model's own modules only for the attention/MLP sublayers and their norms.
    restart=False is a deliberately wrong wiring (bank without restarting P). Returns (logits, banks)."""
    c = model.config
    blk = c.attn_res_block_size

    def w_of(norm, proj):
        return norm.weight.detach().double() * proj.weight.detach().double()[0]

    P = model.model.embed_tokens.weight.detach()[tokens]  # x0 = embed(tokens)
    bank: list[torch.Tensor] = []
    for l, layer in enumerate(model.model.layers):
        h = ref_mix(P, bank, w_of(layer.self_attention_res_norm, layer.self_attention_res_proj)).float()
        if l % blk == 0:
            bank.append(P)
            if restart:
                P = torch.zeros_like(P)
        P = P + layer.self_attn(layer.input_layernorm(h))
        m = ref_mix(P, bank, w_of(layer.mlp_res_norm, layer.mlp_res_proj)).float()
        ff = layer.mlp if c.mlp_kinds[l] == "dense" else layer.block_sparse_moe
        P = P + ff(layer.post_attention_layernorm(m))
    y = ref_mix(P, bank, w_of(model.model.output_attn_res_norm, model.model.output_attn_res_proj))
    y = ref_rmsnorm(y, model.model.norm.weight)
    return (y @ model.lm_head.weight.detach().double().T).float(), len(bank)


def test_whole_model_follows_layer_skeleton(tiny_k3):
    model = tiny_k3
    c = model.config
    blk = c.attn_res_block_size
    assert blk and c.num_layers > blk, "the tiny config must have more than one bank"
    assert c.mlp_kinds[0] == "dense" and all(k == "moe" for k in c.mlp_kinds[1:])
    assert "kda" in c.attn_kinds and "mla" in c.attn_kinds
    tokens = torch.randint(0, c.vocab_size, (2, 9), generator=torch.Generator().manual_seed(41))
    with torch.no_grad():
        got = model(tokens)
        want, banks = ref_model_forward(model, tokens)
        wrong, _ = ref_model_forward(model, tokens, restart=False)
    assert banks == len(range(0, c.num_layers, blk)) and banks >= 2
    # 5e-5: fp32 rounding of six layers against the float64 mixes
    assert_close(got, want, rtol=5e-5)
    assert want.std() > 0.05
    assert (wrong - want).abs().max() > 1e-2  # the wiring matters on this model
