"""Training through the routed experts: with gradients wanted (or an expert LoRA attached) the MoE block runs
its experts as torch ops from the store's weights. The input, routing-weight and LoRA gradients equal a
float64 model of the same math on the experts' decoded weights (MXFP4 through its kernels, bf16 kept
as stored), also with the store at a 10 % budget; the frozen base gets no gradient; at 10 % and 25 %
budgets a stack of every MoE block gives bit-identical losses and gradients to all-resident while the
store evicts, lets graphs' holds go and fetches experts again for backward, never keeping more than
its budget; with no gradients the adapter is in the output, and detaching it restores the fast path."""

from __future__ import annotations

import pytest
import torch

from moeswap.experts.source import load_expert
from moeswap.models.loader import LoadOptions, load_model
from moeswap.ops.activation import glu_reference

RANK, ALPHA = 4, 8.0


def total_expert_bytes(store) -> int:
    return sum(store.fast.cost(k) for k in store.index.entries)


def attach(block, shared_a: bool = False, seed: int = 0):
    """An expert LoRA with nonzero B (as after some training), the same for the same seed."""
    lora = block.attach_expert_lora(RANK, ALPHA, shared_a=shared_a, generator=torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for B in lora.lora_B.values():
            B.copy_(torch.randn(B.shape, generator=gen) * 0.05)
    return lora


def step_inputs(block, tokens: int, seed: int):
    """(h [T, I] requiring grad, router ids [T, K], routing weights [T, K] requiring grad, output weights)."""
    gen = torch.Generator().manual_seed(seed)
    width = block.expert_shapes["w1"][1]
    h = torch.randn(tokens, width, generator=gen)
    ids = torch.stack([torch.randperm(block.num_experts, generator=gen)[: block.gate.top_k] for _ in range(tokens)])
    w = torch.rand(tokens, block.gate.top_k, generator=gen) + 0.1
    return h.requires_grad_(), ids, w.requires_grad_(), torch.randn(tokens, width, generator=gen)


def float64_step(block, store, h, ids, w, G):
    """loss = sum(G * out), out[t] = sum_k w[t, k] (w2 + s B2 A2) act((w1 + s B1 A1) h_t, (w3 + s B3 A3) h_t),
    all in float64 from each expert's weights decoded from the checkpoint. Returns the gradients of h, w and
    every LoRA parameter by name, and the output."""
    lora = block.expert_lora
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    A = {p: a.detach().double().requires_grad_() for p, a in lora.lora_A.items()}
    B = {p: b.detach().double().requires_grad_() for p, b in lora.lora_B.items()}
    out = torch.zeros_like(h64)
    cache = {}
    for t in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e not in cache:
                cache[e] = load_expert(store.ckpt, store.index, block.layer_idx, e, torch.float64)
            W = {"w1": cache[e].w1_FI, "w3": cache[e].w3_FI, "w2": cache[e].w2_IF}

            def proj(p, x, e=e, W=W):
                a = A[p][0 if lora.shared_a else e]
                return x @ W[p].T + (x @ a.T @ B[p][e].T) * lora.scaling

            hid = glu_reference(block.act, proj("w1", h64[t]), proj("w3", h64[t]), block.situ_betas)
            out[t] = out[t] + w64[t, k] * proj("w2", hid)
    (out * G.double()).sum().backward()
    grads = {"h": h64.grad, "w": w64.grad}
    grads.update({f"lora_A.{p}": a.grad for p, a in A.items()})
    grads.update({f"lora_B.{p}": b.grad for p, b in B.items()})
    return grads, out.detach()


def moeswap_step(block, h, ids, w, G):
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    out = block.run_experts(h, ids, w)
    (out * G).sum().backward()
    grads = {"h": h.grad, "w": w.grad}
    grads.update({name: p.grad for name, p in block.expert_lora.named_parameters()})
    return grads, out.detach()


def assert_near(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4 * want.abs().max().item(), msg=what)


@pytest.fixture(scope="module")
def k3_resident(tiny_k3_dir):
    model, store = load_model(tiny_k3_dir, LoadOptions(dtype="float32"))
    return model, store


@pytest.mark.parametrize("shared_a", [False, True])
@pytest.mark.parametrize("tokens", [7, 70])  # experts' few rows run the C kernel; 70 tokens take the GEMM too
def test_mxfp4_expert_gradients_equal_a_float64_model(k3_resident, shared_a, tokens):
    model, store = k3_resident
    block = model.moe_blocks()[1]
    try:
        attach(block, shared_a)
        h, ids, w, G = step_inputs(block, tokens, seed=tokens)
        got, out = moeswap_step(block, h, ids, w, G)
        want, want_out = float64_step(block, store, h, ids, w, G)
        assert_near(out, want_out, "output")
        assert set(got) == set(want)
        for name in want:
            assert_near(got[name], want[name], name)
        assert got["lora_A.w1"].abs().sum() > 0 and got["lora_B.w2"].abs().sum() > 0
        frozen = [n for n, p in block.named_parameters() if not n.startswith("expert_lora.")]
        assert frozen and all(p.grad is None and not p.requires_grad
                              for n, p in block.named_parameters() if n in frozen)
    finally:
        block.detach_expert_lora()


def test_gradients_through_the_store_at_10_percent(tiny_k3_dir, k3_resident):
    model, store = k3_resident
    block = model.moe_blocks()[2]
    small, small_store = load_model(tiny_k3_dir, LoadOptions(dtype="float32",
                                                             expert_memory=total_expert_bytes(store) // 10))
    small_block = small.moe_blocks()[2]
    try:
        attach(block), attach(small_block)
        small_store.preload([k for k in sorted(small_store.index.entries) if k[0] != block.layer_idx])
        h, ids, w, G = step_inputs(block, 40, seed=5)
        got, _ = moeswap_step(small_block, h, ids, w, G)
        s = small_store.stats
        assert s.fast.misses > 0 and s.tiers["fast"].evictions > 0 and s.graph.released > 0 and s.graph.refetched > 0
        assert small_store.fast.used <= small_store.fast.capacity
        resident, _ = moeswap_step(block, h, ids, w, G)
        want, _ = float64_step(block, store, h, ids, w, G)
        for name in want:
            assert torch.equal(got[name], resident[name]), name  # the same kernels on the same bytes
            assert_near(got[name], want[name], name)
    finally:
        block.detach_expert_lora()
        small_store.close()


def test_bf16_expert_gradients_equal_a_float64_model(tiny_linear_dir):
    model, store = load_model(tiny_linear_dir, LoadOptions(dtype="float32"))
    block = model.moe_blocks()[0]
    expert = store.fetch(block.layer_idx, [0])[0]
    assert expert.w1_FI.dtype == torch.bfloat16  # kept as stored, computed in fp32
    attach(block, seed=3)
    h, ids, w, G = step_inputs(block, 9, seed=9)
    got, out = moeswap_step(block, h, ids, w, G)
    want, want_out = float64_step(block, store, h, ids, w, G)
    assert_near(out, want_out, "output")
    for name in want:
        assert_near(got[name], want[name], name)


def stack_step(model, x, G):
    """A stack of every MoE block of the model (h + block(h)): each layer's router, latent projections,
    norm, shared experts and routed experts, forward and backward."""
    blocks = model.moe_blocks()
    h = x.detach().clone().requires_grad_()
    y = h
    for block in blocks:
        y = y + block(y)
    loss = (y * G).sum()
    loss.backward()
    return loss.detach(), [h.grad] + [p.grad for b in blocks for p in b.expert_lora.parameters()]


@pytest.mark.parametrize("percent", [10, 25])
def test_training_at_a_small_budget_equals_all_resident(tiny_k3_dir, k3_resident, percent):
    model, store = k3_resident
    small, small_store = load_model(tiny_k3_dir, LoadOptions(dtype="float32",
                                                             expert_memory=total_expert_bytes(store) * percent // 100))
    gen = torch.Generator().manual_seed(percent)
    x = torch.randn(1, 24, model.config.hidden_size, generator=gen)
    G = torch.randn(x.shape, generator=gen)
    try:
        for m in (model, small):
            for b in m.moe_blocks():
                attach(b, seed=b.layer_idx)
        want_loss, want_grads = stack_step(model, x, G)
        holds_seen = []
        original = small_store.hold

        def hold(*args):  # after each hold the graph may keep only what the fast tier holds
            held = original(*args)
            holds_seen.append(small_store.graph_bytes())
            assert {h.key for hs in small_store._holds.values() for h in hs} <= set(small_store.fast.keys())
            return held

        small_store.hold = hold
        loss, grads = stack_step(small, x, G)
        assert torch.equal(loss, want_loss)
        assert all(torch.equal(a, b) for a, b in zip(grads, want_grads))
        assert grads[0].abs().sum() > 0 and all(g.abs().sum() > 0 for g in grads[2::2])  # every B learns
        s = small_store.stats
        assert s.tiers["fast"].evictions > 0 and s.graph.released > 0 and s.graph.refetched > 0
        assert max(holds_seen) <= small_store.fast.capacity and small_store.fast.used <= small_store.fast.capacity
    finally:
        for m in (model, small):
            for b in m.moe_blocks():
                b.detach_expert_lora()
        small_store.close()


def test_inference_with_an_adapter_includes_it_and_detaching_restores_the_fast_path(k3_resident):
    model, store = k3_resident
    block = model.moe_blocks()[0]
    h, ids, w, G = step_inputs(block, 5, seed=11)
    h, w = h.detach(), w.detach()
    with torch.no_grad():
        base = block.run_experts(h, ids, w)
    try:
        attach(block, seed=12)
        with torch.no_grad():
            adapted = block.run_experts(h, ids, w)
        _, want = float64_step(block, store, h, ids, w, G)
        assert_near(adapted, want, "adapted output")
        assert (adapted - base).abs().max() > 1e-3 * base.abs().max()
        for B in block.expert_lora.lora_B.values():
            B.data.zero_()
        with torch.no_grad():
            assert_near(block.run_experts(h, ids, w), base.double(), "zero B")
    finally:
        block.detach_expert_lora()
    with torch.no_grad():
        assert torch.equal(block.run_experts(h, ids, w), base)
