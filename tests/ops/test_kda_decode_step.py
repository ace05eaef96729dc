"""kda_decode_step (the fused CPU kernel where it builds, else torch) equals normalising q/k and running
the reference recurrence: outputs and the in-place state, over several tokens, including strong decay."""

from __future__ import annotations

import pytest
import torch

from moeswap.ops import cpu_kernels
from moeswap.ops.kda import kda_decode_step, kda_recurrent, l2_normalize


@pytest.mark.parametrize("B,H,K,V", [(1, 2, 16, 16), (3, 4, 64, 64), (2, 1, 32, 48)])
@pytest.mark.parametrize("use_kernel", [True, False])
def test_decode_step_matches_the_recurrence(B, H, K, V, use_kernel, monkeypatch):
    if use_kernel and cpu_kernels.kernel() is None:
        pytest.skip("no CPU kernel here")
    if not use_kernel:
        monkeypatch.setattr(cpu_kernels, "kernel", lambda flags=None: None)
    gen = torch.Generator().manual_seed(B * 100 + K)
    state = torch.randn(B, H, K, V, generator=gen) * 0.1
    want_state = state.clone()
    for _ in range(4):
        q, k = torch.randn(B, 1, H, K, generator=gen) * 3, torch.randn(B, 1, H, K, generator=gen)
        v = torch.randn(B, 1, H, V, generator=gen)
        g = -5 * torch.rand(B, 1, H, K, generator=gen)  # down to K3's bound
        beta = torch.rand(B, 1, H, generator=gen)
        got = kda_decode_step(q, k, v, g, beta, state, K**-0.5)
        want, want_state = kda_recurrent(l2_normalize(q) * K**-0.5, l2_normalize(k), v, g, beta, want_state)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(state, want_state, rtol=1e-5, atol=1e-5)


def test_kernel_rejects_bad_shapes():
    kernel = cpu_kernels.kernel()
    if kernel is None:
        pytest.skip("no CPU kernel here")
    with pytest.raises(ValueError, match="kda_decode: q .2, 8."):
        kernel.kda_decode(torch.zeros(2, 8), torch.zeros(2, 8), torch.zeros(2, 8), torch.zeros(2, 8),
                          torch.zeros(2), torch.zeros(2, 8, 4), 1.0, 1e-6)
