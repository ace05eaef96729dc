"""Projection fusion (applied by the engine): same outputs as separate projections, state_dict unchanged,
and it steps aside when a projection is replaced (e.g. by a LoRA wrapper) or its weight reloaded."""

import torch
from torch import nn

from moeswap.engine.scheduler import fuse_projections
from moeswap.models.layers.kda import KDAState
from moeswap.models.loader import LoadOptions, load_model


def test_fused_attention_equals_unfused(tiny_k3_dir):
    model, _ = load_model(tiny_k3_dir, LoadOptions(dtype="float32"))
    x = torch.randn(3, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kda, mla = model.model.layers[0].self_attn, model.model.layers[3].self_attn
    with torch.no_grad():
        want_kda, want_mla = kda(x, None), mla(x, None)
        fuse_projections(model)
        assert "_fused_input" in kda.__dict__ and "_fused_input" in mla.__dict__
        torch.testing.assert_close(kda(x, None), want_kda, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(mla(x, None), want_mla, rtol=1e-5, atol=1e-6)
        after = model.state_dict()
        assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)

        class Doubled(nn.Module):  # stands in for a LoRA wrapper
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, x):
                return 2 * self.inner(x)

        kda.v_proj = Doubled(kda.v_proj)
        st = KDAState.zeros(3, kda.H, kda.K, kda.W, torch.float32, "cpu")
        changed = kda(x, st)
        assert not torch.allclose(changed, want_kda)  # the wrapper is honoured, not bypassed
        kda.v_proj = kda.v_proj.inner
        torch.testing.assert_close(kda(x, None), want_kda, rtol=1e-5, atol=1e-6)


def test_fused_gated_mlps_equal_unfused(tiny_k3_dir):
    model, _ = load_model(tiny_k3_dir)
    dense, shared = model.model.layers[0].mlp, model.model.layers[1].block_sparse_moe.shared_experts
    x = torch.randn(2, 3, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = dense(x), shared(x)
        fuse_projections(model)
        assert "_fused_input" in dense.__dict__ and "_fused_input" in shared.__dict__
        for got, w in zip((dense(x), shared(x)), want):
            torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-6)
