"""Projection fusion (applied by the engine): the same bits as separate projections, at decode's few rows
(the row kernel) and at prefill's many (torch's GEMM, one product a projection: on MKL's AVX2 kernels a
fused product's columns can differ, docs/numerics.md); state_dict unchanged; it steps aside when a
projection is replaced (e.g. by a LoRA wrapper) or its weight reloaded."""

import torch
from torch import nn

from moeswap.engine.scheduler import fuse_projections
from moeswap.models.layers.kda import KDAState
from moeswap.models.loader import LoadOptions, load_model

# 15 rows: the row kernel; 80: torch's GEMM, one product a projection (one fused product differed on MKL's AVX2 path)
SHAPES = [(3, 5), (2, 40)]


def test_fused_attention_equals_unfused(tiny_k3_dir):
    model, _ = load_model(tiny_k3_dir, LoadOptions(dtype="float32"))
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(*shape, model.config.hidden_size, generator=gen) for shape in SHAPES]
    x = xs[0]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kda, mla = model.model.layers[0].self_attn, model.model.layers[3].self_attn
    with torch.no_grad():
        wants = [(kda(x, None), mla(x, None)) for x in xs]
        want_kda = wants[0][0]
        fuse_projections(model)
        assert "_fused_input" in kda.__dict__ and "_fused_input" in mla.__dict__
        for x, (want_k, want_m) in zip(xs, wants):
            assert torch.equal(kda(x, None), want_k) and torch.equal(mla(x, None), want_m), x.shape
        x = xs[0]
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
        assert torch.equal(kda(x, None), want_kda)


def test_fused_gated_mlps_equal_unfused(tiny_k3_dir):
    model, _ = load_model(tiny_k3_dir)
    dense, shared = model.model.layers[0].mlp, model.model.layers[1].block_sparse_moe.shared_experts
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(*shape, model.config.hidden_size, generator=gen) for shape in SHAPES]
    with torch.no_grad():
        wants = [(dense(x), shared(x)) for x in xs]
        fuse_projections(model)
        assert "_fused_input" in dense.__dict__ and "_fused_input" in shared.__dict__
        for x, want in zip(xs, wants):
            for got, w in zip((dense(x), shared(x)), want):
                assert torch.equal(got, w), x.shape
