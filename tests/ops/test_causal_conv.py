"""The KDA short convolution as shifted multiply-adds equals the conv1d reference, with history."""

import torch

from moeswap.models.layers.kda import causal_conv_silu, causal_conv_silu_reference


def test_shifted_conv_equals_conv1d_reference():
    gen = torch.Generator().manual_seed(0)
    for T in (1, 3, 17):
        x = torch.randn(2, T, 24, generator=gen)
        history = torch.randn(2, 3, 24, generator=gen)
        weight = torch.randn(24, 1, 4, generator=gen)
        want = causal_conv_silu_reference(x, history, weight)
        got = causal_conv_silu(x, history, weight)
        assert got.shape == want.shape == (2, T, 24)
        assert (got - want).abs().max().item() < 1e-5
