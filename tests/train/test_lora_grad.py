"""Acceptance: LoRA gradients of a whole model prepared as `moeswap train` prepares it (its loader settings and
train.targets.prepare_model), with adapters on every target kind of K3 including the routed experts, equal a
float64 reference model's (the same adapter on the same weights, the experts decoded to float64 and run as
plain torch ops) as closely as that model computed in fp32 does. The trained model's routed experts run
through the MXFP4 kernels from the expert store, all resident and at a 10 % budget (where the store evicts and fetches experts again for backward). The
frozen base gets no gradient. Reuses tests/lora/test_grad.py's decoded-expert store and held routing (top-k
is piecewise constant: the reference takes the trained model's choices, its weights its own function)."""

from __future__ import annotations

import re

import torch

from lora.test_grad import TARGETS, DecodedStore, HeldRouting
from moeswap.lora import attach_lora, trainable_parameters
from moeswap.models.layers.moe import Router
from moeswap.models.loader import load_model
from moeswap.train.config import TrainConfig
from moeswap.train.targets import lora_config, prepare_model

ALL_TARGETS = TARGETS + ("w1", "w2", "w3")


def kda_in_range(model) -> None:
    """KDA gates in their working range (this init saturates K3's decay at 0, and a zero gradient compares
    trivially)."""
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.attn_kind == "kda":
                layer.self_attn.A_log.fill_(-1.0)
                layer.self_attn.dt_bias.zero_()


def set_adapter(model, seed: int = 1) -> None:
    """Every LoRA tensor drawn from N(0, 0.1^2) in name order (B nonzero, as after some training)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(trainable_parameters(model).items()):
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) * 0.1)


def recording_routers(model, choices: dict[int, torch.Tensor]):
    """Router.forward that also records each MoE block's expert choice by layer."""
    layer_of = {id(b.gate): b.layer_idx for b in model.moe_blocks()}
    forward = Router.forward

    def run(router, x):
        ids, w = forward(router, x)
        choices[layer_of[id(router)]] = ids
        return ids, w

    return run


def trained_gradients(tiny_k3_dir, cfg, tokens, weights, monkeypatch, expert_memory=None):
    load = cfg.load if expert_memory is None else cfg.load.replace(expert_memory=expert_memory)
    model, store = load_model(tiny_k3_dir, load)
    try:
        kda_in_range(model)
        params = dict(prepare_model(model, cfg))
        set_adapter(model)
        choices: dict[int, torch.Tensor] = {}
        with monkeypatch.context() as m:
            m.setattr(Router, "forward", recording_routers(model, choices))
            (model(tokens).double() * weights).sum().backward()
        frozen = [n for n, p in model.named_parameters() if n not in params]
        assert frozen and all(model.get_parameter(n).grad is None for n in frozen)  # the base gets none
        return {n: p.grad for n, p in params.items()}, choices, store.stats
    finally:
        store.close()


def reference_gradients(tiny_k3_dir, cfg, tokens, weights, choices, monkeypatch, dtype=torch.float64):
    """The reference model's LoRA gradients: dense weights and decoded experts in `dtype`, all plain torch."""
    from moeswap.options import LoadOptions

    model, store = load_model(tiny_k3_dir, LoadOptions(dtype="float32", dense_weights="compute"))
    try:
        model = model.to(dtype)
        kda_in_range(model)
        for block in model.moe_blocks():
            block.store = DecodedStore(block.store, dtype)
        attach_lora(model, lora_config(cfg))
        set_adapter(model)
        held = HeldRouting()
        for block in model.moe_blocks():
            held.ids[id(block.gate)] = choices[block.layer_idx]
        with monkeypatch.context() as m:
            m.setattr(Router, "forward", lambda self, x: held(self, x))
            (model(tokens).double() * weights).sum().backward()
        return {n: p.grad for n, p in trainable_parameters(model).items()}
    finally:
        store.close()


def assert_close_to(got: dict, want: dict, fp32: dict) -> None:
    """Each of `got` is as near `want` (float64) as the plain fp32 model's gradient `fp32` is, or nearer.
    This random tiny model is ill-conditioned: fp32 rounding alone moves some gradients (layer 4's KDA
    q/k/b) by 2 %, others by 1e-4; a path missing from the graph moves them by their whole share."""
    assert got.keys() == want.keys() == fp32.keys()
    for name, g in got.items():
        ref = want[name]
        assert ref.abs().max() > 0, name  # every adapter tensor moves the loss: the comparison is not vacuous
        err, floor = (float((x.double() - ref).norm() / ref.norm()) for x in (g, fp32[name]))
        assert err <= 1.5 * floor + 1e-4 and err < 0.03, (name, err, floor)


def test_lora_gradients_of_every_target_kind_equal_a_float64_model(tiny_k3_dir, tmp_path, monkeypatch):
    cfg = TrainConfig(model=str(tiny_k3_dir), mode="lora", target_modules=ALL_TARGETS, rank=3, alpha=6.0)
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(3, 500, (2, 24), generator=gen)
    weights = torch.randn(2, 24, 512, generator=gen, dtype=torch.float64)

    got, choices, _ = trained_gradients(tiny_k3_dir, cfg, tokens, weights, monkeypatch)
    assert len(got) == 2 * (68 + 3 * 5)  # 68 Linear adapters and 3 expert projections in each of 5 MoE blocks
    assert all(any(re.search(rf"(^|\.){re.escape(t)}(\.|$)", n) for n in got) for t in ALL_TARGETS)  # every kind
    want = reference_gradients(tiny_k3_dir, cfg, tokens, weights, choices, monkeypatch)
    fp32 = reference_gradients(tiny_k3_dir, cfg, tokens, weights, choices, monkeypatch, torch.float32)
    assert_close_to(got, want, fp32)

    # the same through the store at a 10 % expert budget: the same kernels on the same bytes, bit for bit
    total = sum(f.stat().st_size for f in tiny_k3_dir.glob("*.safetensors"))
    small, small_choices, stats = trained_gradients(tiny_k3_dir, cfg, tokens, weights, monkeypatch, total // 10)
    assert stats.tiers["fast"].evictions > 0 and stats.graph.released > 0 and stats.graph.refetched > 0
    assert all(torch.equal(small_choices[k], choices[k]) for k in choices)
    assert all(torch.equal(small[n], got[n]) for n in got)
