"""Full mode's routed experts (train/experts.py) and its model directory (train/export.py): the trainable
experts compute what the store's experts compute; their gradients match float64; the router bias follows
K3's balancing rule exactly; the written model loads and holds exactly the trained weights."""

from __future__ import annotations

import math

import pytest
import torch

from moeswap.models.loader import load_model
from moeswap.options import LoadOptions
from moeswap.train.experts import TrainableExperts, balance_routers, make_experts_trainable, moe_blocks
from moeswap.train.loop import train
from moeswap.weights.registry import format_of


def test_trainable_experts_compute_what_the_store_computes(tiny_k3_dir):
    model, store = load_model(tiny_k3_dir, LoadOptions(dense_weights="compute"))
    try:
        ids = torch.tensor([[5, 17, 3, 99, 250, 7, 7, 1]])
        with torch.no_grad():
            before = model(ids)
            make_experts_trainable(model)
            after = model(ids)
        torch.testing.assert_close(after, before, rtol=2e-5, atol=2e-5)
    finally:
        store.close()


def test_expert_gradients_match_float64():
    g = torch.Generator().manual_seed(0)
    E, F, I, T, K = 4, 6, 5, 7, 2
    weights = {"w1": torch.randn(E, F, I, generator=g), "w3": torch.randn(E, F, I, generator=g),
               "w2": torch.randn(E, I, F, generator=g)}
    h = torch.randn(T, I, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)

    def reference(ws, h, w):  # every token through its experts, one at a time, in float64
        out = torch.zeros(T, I, dtype=torch.float64)
        rows = []
        for t in range(T):
            acc = torch.zeros(I, dtype=torch.float64)
            for j in range(K):
                e = int(ids[t, j])
                a, b = ws["w1"][e] @ h[t], ws["w3"][e] @ h[t]
                act = 4.0 * torch.tanh(a / 4.0) * torch.sigmoid(a) * (25.0 * torch.tanh(b / 25.0))
                acc = acc + w[t, j] * (ws["w2"][e] @ act)
            rows.append(acc)
        return out + torch.stack(rows)

    ref_ws = {k: v.double().requires_grad_(True) for k, v in weights.items()}
    ref_h, ref_w = h.double().requires_grad_(True), w.double().requires_grad_(True)
    probe = torch.randn(T, I, generator=g, dtype=torch.float64)
    (reference(ref_ws, ref_h, ref_w) * probe).sum().backward()

    experts = TrainableExperts({k: v.clone() for k, v in weights.items()}, "situ", (4.0, 25.0))
    got_h, got_w = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    (experts(got_h, ids, got_w) * probe.float()).sum().backward()
    for name in ("w1", "w2", "w3"):
        torch.testing.assert_close(getattr(experts, name).grad.double(), ref_ws[name].grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_h.grad.double(), ref_h.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_w.grad.double(), ref_w.grad, rtol=1e-4, atol=1e-5)
    assert experts.load.tolist() == torch.bincount(ids.flatten(), minlength=E).tolist()


def test_router_bias_moves_by_the_rate_toward_balance(tiny_k3_dir):
    model, store = load_model(tiny_k3_dir, LoadOptions(dense_weights="compute"))
    try:
        make_experts_trainable(model)
        model.train()
        blocks = moe_blocks(model)
        before = [b.gate.e_score_correction_bias.detach().clone() for b in blocks]
        with torch.no_grad():
            model(torch.arange(40).reshape(2, 20))
        loads = [b.experts.load.float().clone() for b in blocks]
        balance_routers(model, 0.01)
        for b, bias0, load in zip(blocks, before, loads):
            step = b.gate.e_score_correction_bias - bias0
            want = 0.01 * torch.sign(load.mean() - load)
            torch.testing.assert_close(step, want, rtol=0, atol=1e-7)
            assert b.experts.load.sum() == 0 and torch.equal(b.experts.last_load.float(), load)
        assert any((load != load.mean()).any() for load in loads)  # the routing was uneven: some bias moved
    finally:
        store.close()


def test_full_run_writes_a_model_that_loads_with_the_trained_weights(small_run, tmp_path):
    result = train(small_run(max_steps=3, router_bias_rate=0.01), progress=False)
    out = result.out_dir
    assert result.manifest["expert_load"]["worst_max_over_mean"] >= 1.0
    trained, store = load_model(out, LoadOptions(dense_weights="compute"))
    base, base_store = load_model(small_run().model, LoadOptions(dense_weights="compute"))
    try:
        changed_experts = 0
        for block, base_block in zip(moe_blocks(trained), moe_blocks(base)):
            got = block.store.fetch(block.layer_idx, [0, 1])
            was = base_block.store.fetch(base_block.layer_idx, [0, 1])
            for i in range(2):
                a = format_of(got[i]).weight(got[i], "w2", torch.float32)
                assert format_of(got[i]).weight(got[i], "w2", torch.bfloat16).dtype == torch.bfloat16
                changed_experts += not torch.equal(a, format_of(was[i]).weight(was[i], "w2", torch.float32))
        assert changed_experts > 0
        biases = [(b.gate.e_score_correction_bias, bb.gate.e_score_correction_bias)
                  for b, bb in zip(moe_blocks(trained), moe_blocks(base))]
        # three balancing steps of 0.01 each, in either direction: the bias moved by a multiple of 0.01
        for now, then in biases:
            moved = ((now - then) / 0.01).round()
            assert moved.abs().max() <= 3 and moved.abs().max() >= 1
            torch.testing.assert_close(now - then, moved * 0.01, rtol=0, atol=1e-6)
        with torch.no_grad():
            logits = trained(torch.tensor([[1, 2, 3, 4]]))
        assert torch.isfinite(logits).all()
        assert not math.isclose(float((logits - base(torch.tensor([[1, 2, 3, 4]]))).abs().max()), 0.0)
    finally:
        store.close()
        base_store.close()


@pytest.mark.parametrize("fixture", ["tiny_k3_dir", "tiny_linear_dir"])
def test_written_model_holds_exactly_the_weights_rounded_to_the_stored_dtypes(fixture, request, tmp_path):
    from moeswap.train.export import write_model

    base_dir = request.getfixturevalue(fixture)
    model, store = load_model(base_dir, LoadOptions(dense_weights="compute"))
    make_experts_trainable(model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g))
    out = tmp_path / "written"
    out.mkdir()
    files = write_model(model, base_dir, out)
    assert "config.json" in files and "tokenizer.json" in files
    loaded, loaded_store = load_model(out, LoadOptions(dense_weights="compute"))
    try:
        params = dict(loaded.named_parameters())
        for name, p in model.named_parameters():
            if ".experts." in name:
                continue
            keep_fp32 = name.endswith(("A_log", "dt_bias", "e_score_correction_bias", "conv1d.weight"))
            want = p.detach() if keep_fp32 and params[name].dtype == torch.float32 else p.detach().bfloat16().float()
            assert torch.equal(params[name].float(), want), name
        for block, mine in zip(moe_blocks(loaded), moe_blocks(model)):
            got = block.store.fetch(block.layer_idx, list(range(block.num_experts)))
            for e in range(block.num_experts):
                for proj in ("w1", "w2", "w3"):
                    want = getattr(mine.experts, proj)[e].detach().bfloat16()
                    assert torch.equal(format_of(got[e]).weight(got[e], proj, torch.bfloat16), want), (block.layer_idx, e)
    finally:
        store.close()
        loaded_store.close()
