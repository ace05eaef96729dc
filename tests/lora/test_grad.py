"""Gradients through the dense model path with LoRA: every target kind of a tiny K3 (KDA and MLA projections,
the dense MLP, shared experts, the latent projections, lm_head) against central finite differences of the
same model in float64; the frozen base gets none; activation checkpointing and decode steps under autograd.

Routed experts are served decoded to float64 by a test store (their autograd through the MXFP4 kernel is the
expert-format work's, tested there), and the routers' choices are held at those of the unperturbed model:
top-k is piecewise constant, and a near-tied choice flipping inside a finite difference would swamp it."""

from __future__ import annotations

import pytest
import torch

from moeswap.formats import mxfp4
from moeswap.lora import LoRAConfig, attach_lora, lora_modules, trainable_parameters
from moeswap.models import decoder
from moeswap.models.layers.moe import Router
from moeswap.ops.expert import ExpertWeights, MXFP4ExpertWeights
from numerics import assert_within_rounding

TARGETS = ("q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj", "g_proj", "o_proj", "q_a_proj",
           "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
           "shared_experts.gate_proj", "shared_experts.down_proj", "routed_expert_down_proj", "routed_expert_up_proj",
           "lm_head")


class DecodedStore:
    """The expert-store protocol over another store, each expert decoded to `dtype` (a differentiable torch path)."""

    def __init__(self, store, dtype, scale: float = 1.0):
        self.store, self.dtype, self.scale = store, dtype, scale

    def fetch(self, layer, ids):
        got = self.store.fetch(layer, ids)
        return [self._decode(got[i]) for i in range(len(ids))]

    def _decode(self, w):
        if isinstance(w, MXFP4ExpertWeights):
            full = [mxfp4.decode(getattr(w, f"{p}_packed"), getattr(w, f"{p}_scale"), torch.float32).to(self.dtype)
                    * self.scale for p in ("w1", "w3", "w2")]
            return ExpertWeights(*full)
        return ExpertWeights(*(t.to(self.dtype) * self.scale for t in (w.w1_FI, w.w3_FI, w.w2_IF)))


class HeldRouting:
    """Router.forward with each router's expert choice held at its first call's (the weights stay its own
    differentiable function of the input: the reference's formula with those ids)."""

    def __init__(self):
        self.ids: dict[int, torch.Tensor] = {}

    def __call__(self, router: Router, x_TD: torch.Tensor):
        ids_TK, w_TK = Router.reference(router, x_TD)
        held = self.ids.setdefault(id(router), ids_TK)
        if torch.equal(held, ids_TK):
            return ids_TK, w_TK
        logits_TE = x_TD.float() @ router.weight.float().T
        scores_TE = logits_TE.sigmoid() if router.scoring == "sigmoid" else logits_TE.softmax(-1)
        w_TK = scores_TE.gather(-1, held)
        if router.renormalize:
            w_TK = w_TK / (w_TK.sum(-1, keepdim=True) + 1e-20)
        return held, w_TK * router.scaling


@pytest.fixture
def k3_f64(load, tiny_k3_dir, randomize_b):
    model = load(tiny_k3_dir, dense_weights="compute").double()
    with torch.no_grad():  # KDA gates in their working range: this init saturates K3's sigmoid decay at 0
        for layer in model.model.layers:
            if layer.attn_kind == "kda":
                layer.self_attn.A_log.fill_(-1.0)
                layer.self_attn.dt_bias.zero_()
    for block in model.moe_blocks():
        block.store = DecodedStore(block.store, torch.float64)
    attach_lora(model, LoRAConfig(r=3, alpha=6, target_modules=TARGETS), generator=torch.Generator().manual_seed(0))
    randomize_b(model, scale=0.2)
    return model


def loss_fn(model, tokens, weights):
    return (model(tokens).double() * weights).sum()


def layer_losses(model, tokens, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """<weights[i], output of decoder layer i> for every layer, then <weights[-1], logits>."""
    outs = []
    layer = model._layer

    def recording(*args, **kwargs):
        outs.append(layer(*args, **kwargs))
        return outs[-1]

    model._layer = recording
    try:
        outs.append(model(tokens))
    finally:
        del model._layer
    return [(o.double() * w).sum() for o, w in zip(outs, weights)]


def owner_layer(name: str, num_layers: int) -> int:
    return int(name.split(".")[2]) if name.startswith("model.layers.") else num_layers


@pytest.mark.slow
def test_every_target_kind_against_finite_differences(k3_f64, tokens, monkeypatch):
    """Each module's LoRA gradient of a loss on its own layer's output (lm_head's: on the logits), against
    central differences along a random direction. A loss further down would be as valid but useless: this
    random tiny model amplifies a perturbation ~10x per layer, past what fp32 internals let differences see."""
    model = k3_f64
    held = HeldRouting()
    monkeypatch.setattr(Router, "forward", lambda self, x: held(self, x))
    L = model.config.num_layers
    gen = torch.Generator().manual_seed(3)
    weights = [torch.randn(*tokens.shape, model.config.hidden_size, generator=gen, dtype=torch.float64)
               for _ in range(L)]
    weights.append(torch.randn(*tokens.shape, model.config.vocab_size, generator=gen, dtype=torch.float64))
    modules = lora_modules(model)
    kinds = {name.rpartition(".")[2] if "shared_experts" not in name else "shared." + name.rpartition(".")[2]
             for name in modules}
    assert len(kinds) == 20 and len(modules) == 68  # MLA has an output gate g_proj too
    eps = 5e-4
    for i in range(L + 1):
        in_layer = {n: m for n, m in modules.items() if owner_layer(n, L) == i}
        model.zero_grad()
        layer_losses(model, tokens, weights)[i].backward()
        for name, lora in in_layer.items():
            params = (lora.lora_A.weight, lora.lora_B.weight)
            dirs = [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params]
            analytic = sum((p.grad * d).sum() for p, d in zip(params, dirs)).item()

            def central(h: float, params=params, dirs=dirs, i=i) -> float:
                with torch.no_grad():
                    for p, d in zip(params, dirs):
                        p.add_(h * d)
                    plus = layer_losses(model, tokens, weights)[i].item()
                    for p, d in zip(params, dirs):
                        p.sub_(2 * h * d)
                    minus = layer_losses(model, tokens, weights)[i].item()
                    for p, d in zip(params, dirs):
                        p.add_(h * d)
                return (plus - minus) / (2 * h)

            # Richardson's extrapolation cancels the differences' h^2 error (this model is curved)
            numeric = (4 * central(eps / 2) - central(eps)) / 3
            # tolerance: the differences' noise floor (~0.03 here: norms, routing and KDA compute in fp32) plus
            # 1 %; a graph cut somewhere shows as a whole path's share of a derivative missing
            assert abs(analytic - numeric) <= 1e-2 * abs(numeric) + 0.05, (name, analytic, numeric)
            assert abs(numeric) > 0.3, name  # each module's LoRA moves the loss: the check is not vacuous
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen and all(model.get_parameter(n).grad is None for n in frozen)  # the base gets no gradient
    assert set(trainable_parameters(model)) == {n for n, p in model.named_parameters() if p.grad is not None}


def test_activation_checkpointing_gives_the_same_gradients(k3_f64, tokens, monkeypatch):
    model = k3_f64
    weights = torch.randn(*tokens.shape, model.config.vocab_size, generator=torch.Generator().manual_seed(3),
                          dtype=torch.float64)
    loss_fn(model, tokens, weights).backward()
    want = {n: p.grad.clone() for n, p in trainable_parameters(model).items()}
    model.zero_grad()
    calls = []

    def counting(fn, *args, **kwargs):
        calls.append(kwargs.get("use_reentrant"))
        return torch.utils.checkpoint.checkpoint(fn, *args, **kwargs)

    monkeypatch.setattr(decoder, "checkpoint", counting)
    model.gradient_checkpointing = True
    loss_fn(model, tokens, weights).backward()
    assert calls == [False] * model.config.num_layers
    for n, p in trainable_parameters(model).items():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-10, atol=1e-12)
    with torch.no_grad():  # no graph: no recomputation
        model(tokens)
    assert len(calls) == model.config.num_layers


def test_decode_steps_under_autograd(load, tiny_k3_dir, randomize_b, float64_twin):
    """A prefill then decode tokens with state, LoRA attached and grad on (the torch paths, state copied where
    autograd keeps it) give the logits of the same steps without grad (the C kernels) to fp32 rounding (the
    bound: tests/numerics.py), and backpropagate."""
    config = LoRAConfig(r=2, target_modules=("q_proj", "q_a_proj", "kv_b_proj", "b_proj"))
    model = load(tiny_k3_dir)
    attach_lora(model, config, generator=torch.Generator().manual_seed(0))
    randomize_b(model)
    seq = torch.randint(3, 500, (1, 9), generator=torch.Generator().manual_seed(2))

    def run(model):
        state = model.make_state(1)
        outs = [model(seq[:, :6], state)]
        outs += [model(seq[:, t:t + 1], state) for t in range(6, 9)]
        return torch.cat(outs, dim=1)

    with torch.no_grad():
        want = run(model)
        exact = run(float64_twin(tiny_k3_dir, model, config))
    got = run(model)
    assert got.requires_grad
    assert_within_rounding(want, got.detach(), exact)  # the torch paths (grad on) are the reference here
    got[:, -1].sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in trainable_parameters(model).values())


def test_mla_expanded_form_equals_the_absorbed_one(load, tiny_k3_dir, randomize_b, tokens):
    """With dropout on kv_b_proj's LoRA input while training, MLA forms per-head keys and values per token
    (the update cannot be folded into the absorbed matrices); with dropout that drops nothing it equals the
    absorbed form."""
    model = load(tiny_k3_dir)
    attach_lora(model, LoRAConfig(r=2, dropout=1e-9, target_modules=("kv_b_proj",)),
                generator=torch.Generator().manual_seed(0))
    randomize_b(model, scale=0.5)
    with torch.no_grad():
        absorbed = model.eval()(tokens)
        model.train()
        mla = model.model.layers[3].self_attn
        assert not mla.kv_b_proj.foldable
        expanded = model(tokens)
    torch.testing.assert_close(expanded, absorbed, rtol=1e-4, atol=1e-4)


def test_deepseek_v3_lora_under_autograd_and_in_the_expanded_form(load, randomize_b, tokens, tmp_path):
    """LoRA on a tiny DeepSeek-V3 (RoPE MLA, dense first layer, shared experts): decode steps with grad on
    give the no-grad logits and backpropagate to every adapter; with kv_b_proj's input dropout in training
    (per-head keys and values from the rotated cache) the expanded form equals the absorbed one."""
    from moeswap.tiny import write_tiny_model

    path = write_tiny_model(tmp_path / "ds", "deepseek_v3", "tiny", seed=0)
    model = load(path)
    targets = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "mlp.gate_proj",
               "shared_experts.down_proj")
    attach_lora(model, LoRAConfig(r=2, target_modules=targets), generator=torch.Generator().manual_seed(0))
    randomize_b(model)
    seq = torch.randint(3, 500, (1, 9), generator=torch.Generator().manual_seed(2))

    def run():
        state = model.make_state(1)
        outs = [model(seq[:, :6], state)] + [model(seq[:, t:t + 1], state) for t in range(6, 9)]
        return torch.cat(outs, dim=1)

    with torch.no_grad():
        want = run()
    got = run()
    assert got.requires_grad
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    got[:, -1].sum().backward()
    grads = trainable_parameters(model)
    assert len(grads) == 2 * (5 * 6 + 1 + 5) and all(p.grad is not None and p.grad.abs().sum() > 0
                                                      for p in grads.values())

    expanded_model = load(path)
    attach_lora(expanded_model, LoRAConfig(r=2, dropout=1e-9, target_modules=("kv_b_proj",)),
                generator=torch.Generator().manual_seed(0))
    randomize_b(expanded_model, scale=0.5)
    with torch.no_grad():
        absorbed = expanded_model.eval()(tokens)
        expanded_model.train()
        assert not expanded_model.model.layers[1].self_attn.kv_b_proj.foldable
        expanded = expanded_model(tokens)
    torch.testing.assert_close(expanded, absorbed, rtol=1e-4, atol=1e-4)
