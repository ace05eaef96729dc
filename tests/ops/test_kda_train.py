"""The KDA training kernels (csrc/kda_train.c via ops.kda.KDATokenRecurrence) against the token recurrence
in torch: outputs against ops.kda.kda_recurrent (fp32), and outputs and every input's gradient against float64
autograd through the same recurrence written in float64 here."""

from __future__ import annotations

import pytest
import torch

from moeswap.ops import cpu_kernels
from moeswap.ops.kda import TRAIN_CHECKPOINT, KDATokenRecurrence, kda_recurrent, l2_normalize

pytestmark = pytest.mark.skipif(cpu_kernels.kernel() is None, reason="no C compiler for the CPU kernels")


def _inputs(B, T, H, K, V, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(B, T, H, K, generator=g, dtype=torch.float64)) * K**-0.5
    k = l2_normalize(torch.randn(B, T, H, K, generator=g, dtype=torch.float64))
    v = torch.randn(B, T, H, V, generator=g, dtype=torch.float64)
    decay = -5 * torch.sigmoid(torch.randn(B, T, H, K, generator=g, dtype=torch.float64))  # K3's bounded gate
    beta = torch.sigmoid(torch.randn(B, T, H, generator=g, dtype=torch.float64))
    S0 = 0.3 * torch.randn(B, H, K, V, generator=g, dtype=torch.float64)
    return [t.to(dtype).requires_grad_(True) for t in (q, k, v, decay, beta, S0)]


def _recurrence64(q, k, v, g, beta, S):
    """kda_recurrent's update in float64 (that function computes in fp32)."""
    outs = []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp().unsqueeze(-1)
        u = beta[:, t].unsqueeze(-1) * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))
        S = S + k[:, t].unsqueeze(-1) * u.unsqueeze(-2)
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return torch.stack(outs, dim=1), S


@pytest.mark.parametrize("B,T,H,K,V", [(1, 1, 1, 4, 4), (2, 70, 3, 16, 8), (1, TRAIN_CHECKPOINT * 2, 2, 8, 12),
                                       (2, 131, 1, 32, 32)])
def test_outputs_and_gradients_match_the_float64_recurrence(B, T, H, K, V):
    ref = _inputs(B, T, H, K, V, seed=T, dtype=torch.float64)
    o_ref, S_ref = _recurrence64(*ref)
    g = torch.Generator().manual_seed(1)
    w_o = torch.randn(o_ref.shape, generator=g, dtype=torch.float64)
    w_S = torch.randn(S_ref.shape, generator=g, dtype=torch.float64)
    ((o_ref * w_o).sum() + (S_ref * w_S).sum()).backward()

    got = _inputs(B, T, H, K, V, seed=T, dtype=torch.float32)
    o, S = KDATokenRecurrence.apply(*got)
    ((o * w_o.float()).sum() + (S * w_S.float()).sum()).backward()
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(S.double(), S_ref, rtol=1e-5, atol=1e-5)
    o32, S32 = kda_recurrent(*(t.detach() for t in got))
    torch.testing.assert_close(o.detach(), o32, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(S.detach(), S32, rtol=1e-5, atol=1e-6)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "S0"), ref, got):
        scale = a.grad.abs().max()
        assert (b.grad.double() - a.grad).abs().max() <= 1e-4 * scale, name


def test_only_the_output_or_only_the_state_receives_a_gradient():
    for use_o in (True, False):
        ref = _inputs(1, 40, 2, 8, 8, seed=3, dtype=torch.float64)
        o_ref, S_ref = _recurrence64(*ref)
        (o_ref.sum() if use_o else S_ref.sum()).backward()
        got = _inputs(1, 40, 2, 8, 8, seed=3, dtype=torch.float32)
        o, S = KDATokenRecurrence.apply(*got)
        (o.sum() if use_o else S.sum()).backward()
        for a, b in zip(ref, got):  # (q gets none from the final state alone: zeros here)
            want = a.grad if a.grad is not None else torch.zeros_like(a)
            torch.testing.assert_close(b.grad.double(), want, rtol=1e-4, atol=1e-5)


def test_bad_shapes_are_refused_naming_them():
    q, k, v, g, beta, S0 = (t.detach() for t in _inputs(1, 5, 1, 4, 4, seed=0, dtype=torch.float32))
    heads = lambda t: t.transpose(1, 2).reshape(1, 5, -1).contiguous()  # noqa: E731
    with pytest.raises(ValueError, match=r"kda_train_forward: q \(1, 5, 4\)"):
        cpu_kernels.kernel().kda_train_forward(heads(q), heads(k), heads(v), heads(g)[:, :4].contiguous(),
                                               beta.reshape(1, 5), S0.reshape(1, 4, 4), 64)
