"""Routed-expert LoRA on an MoE block: PEFT's initialisation and math, PEFT key names and shapes in and
out (shared A written under every expert), loads that refuse what does not fit, dropout only in
training, the whole block (with its one-call latent decode path) following the adapter, and an adapter
holding some experts' rows only (keep_rows)."""

from __future__ import annotations

import math

import pytest
import torch

from moeswap.models.layers.expert_lora import ExpertLoRA, load_model_peft_state_dict, model_peft_state_dict, peft_key
from moeswap.models.loader import LoadOptions, load_model


@pytest.fixture(scope="module")
def k3(tiny_k3_dir):
    return load_model(tiny_k3_dir, LoadOptions(dtype="float32"))


SHAPES = {"w1": (12, 8), "w3": (12, 8), "w2": (8, 12)}


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32 results against float64 ones: equal to fp32 rounding."""
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_init_is_peft_s_and_the_delta_is_b_a_x_times_alpha_over_r():
    lora = ExpertLoRA(5, SHAPES, rank=3, alpha=6.0, generator=torch.Generator().manual_seed(0))
    assert lora.scaling == 2.0
    for p, (O, N) in SHAPES.items():
        A, B = lora.lora_A[p], lora.lora_B[p]
        assert A.shape == (5, 3, N) and B.shape == (5, O, 3) and A.requires_grad and B.requires_grad
        assert torch.equal(B, torch.zeros_like(B))  # untrained adapters change nothing
        assert A.abs().max() <= 1 / math.sqrt(N) and A.std() > 0.4 / math.sqrt(N)  # U(-1/sqrt(N), 1/sqrt(N))
    with torch.no_grad():
        lora.lora_B["w2"].normal_(generator=torch.Generator().manual_seed(1))
    x = torch.randn(4, 12, generator=torch.Generator().manual_seed(2))
    want = x.double() @ lora.lora_A["w2"][3].double().T @ lora.lora_B["w2"][3].double().T * 2.0
    close(lora.delta("w2", 3, x), want)
    merged = lora.merged_delta("w2", 3)  # x (B A s)^T is the delta
    close(x.double() @ merged.double().T, want)
    assert ExpertLoRA(5, SHAPES, 3, 6.0, projections=("w1",)).delta("w2", 0, x) is None
    shared = ExpertLoRA(5, SHAPES, 3, 6.0, shared_a=True)
    assert shared.lora_A["w1"].shape == (1, 3, 8) and shared.lora_B["w1"].shape == (5, 12, 3)


@pytest.mark.parametrize("bad, match", [
    (dict(rank=0), "rank must be a positive integer"), (dict(alpha=float("nan")), "alpha must be a finite"),
    (dict(dropout=1.0), r"dropout must be in \[0, 1\)"), (dict(projections=("w4",)), "expected distinct names"),
    (dict(projections=()), "expected distinct names")])
def test_bad_settings_are_refused(bad, match):
    kwargs = dict(rank=2, alpha=4.0) | bad
    with pytest.raises(ValueError, match=match):
        ExpertLoRA(4, SHAPES, **kwargs)


def test_dropout_only_while_training():
    lora = ExpertLoRA(2, SHAPES, 2, 2.0, dropout=0.5)
    with torch.no_grad():
        lora.lora_B["w1"].fill_(1.0)
    x = torch.ones(64, 8)
    lora.eval()
    torch.testing.assert_close(lora.delta("w1", 0, x), x @ lora.lora_A["w1"][0].T @ lora.lora_B["w1"][0].T)
    lora.train()
    torch.manual_seed(0)
    trained = lora.adapters([0])[0]("w1", x)
    rows = (trained - lora.delta("w1", 0, x).detach()).abs().sum(-1)
    assert (rows > 0).any()  # each row of x dropped differently
    lora.eval()


@pytest.mark.parametrize("shared_a", [False, True])
def test_peft_state_dict_round_trip(k3, shared_a):
    model, _ = k3
    blocks = model.moe_blocks()
    try:
        for b in blocks:
            lora = b.attach_expert_lora(4, 16.0, shared_a=shared_a, generator=torch.Generator().manual_seed(b.layer_idx))
            with torch.no_grad():
                for B in lora.lora_B.values():
                    B.normal_(generator=torch.Generator().manual_seed(b.layer_idx + 100))
        sd = model_peft_state_dict(model)
        E, I, F = blocks[0].num_experts, *blocks[0].expert_shapes["w2"]
        assert len(sd) == len(blocks) * E * 3 * 2
        L = blocks[0].layer_idx
        assert sd[peft_key(L, 7, "w1", "lora_A")].shape == (4, I) and sd[peft_key(L, 7, "w1", "lora_B")].shape == (F, 4)
        assert sd[peft_key(L, 7, "w2", "lora_A")].shape == (4, F) and sd[peft_key(L, 7, "w2", "lora_B")].shape == (I, 4)
        assert peft_key(L, 7, "w1", "lora_A") == f"model.layers.{L}.block_sparse_moe.experts.7.w1.lora_A.weight"
        own = blocks[0].expert_lora_state_dict()
        assert sorted(own) == sorted(k for k in sd if k.startswith(f"model.layers.{L}."))
        assert all(torch.equal(v, sd[k]) for k, v in own.items())
        storages = {t.untyped_storage().data_ptr() for t in sd.values()}
        assert len(storages) == len(sd)  # each its own tensor: safetensors can write them
        assert torch.equal(sd[peft_key(L, 0, "w3", "lora_A")], sd[peft_key(L, 5, "w3", "lora_A")]) == shared_a
        before = {n: p.detach().clone() for n, p in model.named_parameters() if "expert_lora" in n}
        for b in blocks:  # fresh adapters, then the saved weights back
            b.attach_expert_lora(4, 16.0, shared_a=shared_a, generator=torch.Generator().manual_seed(999))
        taken = load_model_peft_state_dict(model, sd)
        assert sorted(taken) == sorted(sd)
        after = {n: p for n, p in model.named_parameters() if "expert_lora" in n}
        assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
    finally:
        for b in blocks:
            b.detach_expert_lora()


def test_loads_that_do_not_fit_are_refused(k3):
    model, _ = k3
    block = model.moe_blocks()[0]
    L = block.layer_idx
    try:
        sd = block.attach_expert_lora(2, 4.0, projections=("w1", "w3")).peft_state_dict(L)
        with pytest.raises(ValueError, match=rf"missing model.layers.{L}.block_sparse_moe.experts.3.w3.lora_B.weight"):
            block.load_expert_lora_state_dict({k: v for k, v in sd.items() if "experts.3.w3.lora_B" not in k})
        wrong = dict(sd, **{peft_key(L, 1, "w1", "lora_A"): torch.zeros(3, 32)})
        with pytest.raises(ValueError, match=r"experts.1.w1.lora_A.weight: expected shape \[2, 32\] \(rank 2\), found \[3, 32\]"):
            block.load_expert_lora_state_dict(wrong)
        stray = dict(sd, **{peft_key(L, 0, "w2", "lora_A"): torch.zeros(2, 64)})
        with pytest.raises(ValueError, match=f"layer {L} w2, which this model's expert LoRA does not adapt"):
            block.load_expert_lora_state_dict(stray)
        block.attach_expert_lora(2, 4.0, projections=("w1", "w3"), shared_a=True)
        with pytest.raises(ValueError, match="different lora_A weights per expert .* shares one A"):
            block.load_expert_lora_state_dict(sd)  # per-expert A (uniform draws) into a shared-A adapter
        block.detach_expert_lora()
        with pytest.raises(RuntimeError, match="no expert LoRA attached"):
            block.load_expert_lora_state_dict(sd)
    finally:
        block.detach_expert_lora()


def test_the_block_forward_follows_the_adapter_at_decode(tiny_k3_dir):
    """One token through the whole block: the one-call latent decode path must not skip the adapter."""
    model, store = load_model(tiny_k3_dir, LoadOptions(dtype="float32", dense_weights="auto"))
    block = model.moe_blocks()[1]
    x = torch.randn(1, 1, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        base = block(x)
        lora = block.attach_expert_lora(2, 4.0)
        torch.testing.assert_close(block(x), base, rtol=1e-5, atol=1e-6)  # B = 0: the same function
        lora.lora_B["w2"].normal_(generator=torch.Generator().manual_seed(4))
        adapted = block(x)
        x_TD = x.reshape(1, -1)
        ids, w = block.gate(x_TD)
        routed = block.run_experts(block.routed_expert_down_proj(x_TD), ids, w)
        want = block.routed_expert_up_proj(block.routed_expert_norm(routed)) + block.shared_experts(x_TD)
        torch.testing.assert_close(adapted.reshape(1, -1), want)
        assert (adapted - base).abs().max() > 1e-3 * base.abs().max()
        block.detach_expert_lora()
        assert torch.equal(block(x), base)
    store.close()


def test_attached_expert_lora_follows_the_block_s_mode(k3):
    """An adapter attached to a model in eval mode (as loaded for inference) applies no dropout."""
    model, _ = k3
    block = model.moe_blocks()[0]
    try:
        assert not block.training
        assert not block.attach_expert_lora(4, 16.0, dropout=0.5).training
        block.train()
        assert block.attach_expert_lora(4, 16.0, dropout=0.5).training
    finally:
        block.eval()
        block.detach_expert_lora()


def test_keep_rows_holds_some_experts_with_the_same_deltas_and_peft_keys():
    """keep_rows (expert parallelism: each rank the LoRA of its own experts) keeps those experts' rows only;
    their deltas and PEFT tensors are the whole adapter's, and the rows come back whole from tensors."""
    full = ExpertLoRA(6, SHAPES, rank=2, alpha=4.0, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for B in full.lora_B.values():
            B.normal_(generator=torch.Generator().manual_seed(2))
    part = ExpertLoRA(6, SHAPES, rank=2, alpha=4.0, generator=torch.Generator().manual_seed(1))
    part.load_state_dict(full.state_dict())
    part.keep_rows([1, 4, 5])
    assert part.experts == (1, 4, 5) and all(p.shape[0] == 3 for p in part.parameters())
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    for got, want in zip(part.adapters([1, 5]), full.adapters([1, 5])):
        assert torch.equal(got("w1", x), want("w1", x))
    y = torch.randn(2, 12, generator=torch.Generator().manual_seed(4))
    assert torch.equal(part.delta("w2", 4, y), full.delta("w2", 4, y))
    assert torch.equal(part.merged_delta("w3", 4), full.merged_delta("w3", 4))
    whole = full.peft_state_dict(7)
    mine = part.peft_state_dict(7)
    assert sorted(mine) == sorted(k for k in whole if any(f".experts.{e}." in k for e in (1, 4, 5)))
    assert all(torch.equal(v, whole[k]) for k, v in mine.items())
    with pytest.raises(KeyError):
        part.adapters([2])
    back = {f"{n}.{p}": getattr(full, n)[p].detach() for n in ("lora_A", "lora_B") for p in full.projections}
    part.keep_rows(range(6), back)
    assert part.experts == tuple(range(6)) and part.peft_state_dict(7).keys() == whole.keys()
    assert all(torch.equal(v, whole[k]) for k, v in part.peft_state_dict(7).items())
    shared = ExpertLoRA(6, SHAPES, rank=2, alpha=4.0, shared_a=True)
    with pytest.raises(ValueError, match="shared A"):
        shared.keep_rows([0, 1])


def test_uniform_drawn_row_by_row_is_the_whole_draw():
    """What ExpertLoRA(experts=...) relies on: a CPU generator's uniform_ over [E, r, N] gives the values of E
    successive uniform_ calls on one [r, N] row, and leaves the generator in the same state."""
    for E, r, N in ((6, 2, 8), (5, 16, 7), (3, 1, 33)):
        gen = torch.Generator().manual_seed(11)
        whole = torch.empty(E, r, N).uniform_(-0.5, 0.5, generator=gen)
        after_whole = torch.rand(5, generator=gen)
        gen = torch.Generator().manual_seed(11)
        row, rows = torch.empty(r, N), []
        for _ in range(E):
            rows.append(row.uniform_(-0.5, 0.5, generator=gen).clone())
        assert torch.equal(torch.stack(rows), whole) and torch.equal(torch.rand(5, generator=gen), after_whole)


def test_built_with_some_experts_rows_only_it_holds_the_whole_adapters_rows_bit_for_bit():
    """ExpertLoRA(experts=...) (expert parallelism: a rank builds its own experts' LoRA only) holds those rows
    alone, each equal to the whole LoRA's from the same seed, and leaves the generator where the whole one
    does (what is drawn after it is the same)."""
    gen_whole, gen_part = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    full = ExpertLoRA(6, SHAPES, rank=2, alpha=4.0, generator=gen_whole)
    part = ExpertLoRA(6, SHAPES, rank=2, alpha=4.0, generator=gen_part, experts=[1, 4, 5])
    assert torch.equal(torch.rand(3, generator=gen_part), torch.rand(3, generator=gen_whole))
    assert part.experts == (1, 4, 5) and all(p.shape[0] == 3 for p in part.parameters())
    rows = torch.tensor([1, 4, 5])
    for name, value in full.state_dict().items():
        assert torch.equal(part.state_dict()[name], value.index_select(0, rows)), name
    whole, mine = full.peft_state_dict(7), part.peft_state_dict(7)
    assert sorted(mine) == sorted(k for k in whole if any(f".experts.{e}." in k for e in (1, 4, 5)))
    assert all(torch.equal(v, whole[k]) for k, v in mine.items())
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    assert torch.equal(part.delta("w1", 4, x), full.delta("w1", 4, x))
    with pytest.raises(KeyError):
        part.delta("w1", 2, x)
    # every expert given: the whole LoRA, with its plain row numbering
    every = ExpertLoRA(6, SHAPES, rank=2, alpha=4.0, generator=torch.Generator().manual_seed(1), experts=range(6))
    assert every._row is None and all(torch.equal(v, full.state_dict()[k]) for k, v in every.state_dict().items())
    for bad in ([4, 1], [1, 1], [6]):
        with pytest.raises(ValueError, match="ascending distinct experts below 6"):
            ExpertLoRA(6, SHAPES, rank=2, alpha=4.0, experts=bad)
    with pytest.raises(ValueError, match="shared A"):
        ExpertLoRA(6, SHAPES, rank=2, alpha=4.0, shared_a=True, experts=[0, 1])
