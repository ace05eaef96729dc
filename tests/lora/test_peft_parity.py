"""PEFT parity on Kimi Linear: adapters moeswap saves load with `peft` onto transformers' KimiLinearForCausalLM and
give moeswap's logits; adapters PEFT saves load into moeswap with PEFT's logits; LoRA gradients agree.

Targets: every dense Linear kind (KDA and MLA projections, the dense MLP, shared experts, lm_head). Routed experts
are out: transformers stores them fused as 3-D parameters (experts.gate_up_proj / down_proj), which PEFT reaches
by name only for architectures it has a conversion for (Mixtral, Qwen2-MoE), not Kimi Linear. B is random:
PEFT starts it at zero, which would make every comparison trivially equal."""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

# the tiny transformers Kimi Linear of the model parity tests (4 KDA + 1 MLA layers, a dense first layer,
# 8 routed experts and a shared one)
from models.test_kimi_linear_parity import _reference_model as _reference  # noqa: E402
from moeswap.lora import LoRAConfig, attach_lora, fingerprint, load_adapter, save_adapter, trainable_parameters  # noqa: E402
from moeswap.models.loader import LoadOptions, load_model  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "f_a_proj", "f_b_proj", "b_proj", "g_a_proj", "g_b_proj",
           "kv_a_proj_with_mqa", "kv_b_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
TOL = 1e-4  # as tests/models/test_kimi_linear_parity.py



@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi_linear_ref")
    _reference().save_pretrained(path)
    return path


@pytest.fixture
def tokens():
    return torch.randint(3, 320, (2, 40), generator=torch.Generator().manual_seed(1))


def peft_model(adapter_dir=None, seed: int = 1):
    """transformers' model with a PEFT LoRA: loaded from `adapter_dir`, or made by get_peft_model with random B."""
    ref = _reference()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # our `moeswap` config key; transformers' reference-kernel notices
        if adapter_dir is not None:
            return peft.PeftModel.from_pretrained(ref, adapter_dir).eval()
        model = peft.get_peft_model(ref, peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.eval()


def n_lora_modules(model) -> int:
    return sum(1 for name, _ in model.named_modules() if name.endswith(".lora_A"))


def test_moeswap_adapter_loads_in_peft(base, tmp_path, tokens, randomize_b):
    model, _ = load_model(base, LoadOptions(dtype="float32"))
    targets = attach_lora(model, LoRAConfig(r=4, alpha=8, target_modules=TARGETS),
                          generator=torch.Generator().manual_seed(0))
    randomize_b(model)
    save_adapter(model, tmp_path / "adapter", base_model="tiny-kimi-linear", base_fingerprint=fingerprint(base))
    theirs = peft_model(tmp_path / "adapter")
    assert n_lora_modules(theirs) == len(targets.linears) == 56  # every module found under transformers' names
    with torch.no_grad():
        got, want, plain = model(tokens), theirs(tokens).logits, _reference()(tokens).logits
    assert (got - want).abs().max().item() <= TOL
    assert (want - plain).abs().max().item() > 0.5  # the adapter changes the logits: the check is not vacuous


def test_peft_adapter_loads_in_moeswap(base, tmp_path, tokens):
    theirs = peft_model()
    theirs.save_pretrained(tmp_path / "adapter")  # with lm_head targeted PEFT also saves lm_head's base weight
    model, _ = load_model(base, LoadOptions(dtype="float32"))
    cfg = load_adapter(model, tmp_path / "adapter", base_dir=base)
    assert cfg.r == 4 and cfg.alpha == 8 and len(trainable_parameters(model)) == 0  # PEFT's is_trainable=False
    with torch.no_grad():
        got, want = model(tokens), theirs(tokens).logits
    assert (got - want).abs().max().item() <= TOL
    assert (want - _reference()(tokens).logits).abs().max().item() > 0.5


def test_lora_gradients_match_peft(base, tmp_path, tokens):
    theirs = peft_model()
    theirs.save_pretrained(tmp_path / "adapter")
    model, _ = load_model(base, LoadOptions(dtype="float32"))
    load_adapter(model, tmp_path / "adapter", trainable=True)
    weights = torch.randn(*tokens.shape, 320, generator=torch.Generator().manual_seed(2))
    theirs.train()  # dropout is 0: train mode changes nothing but what PEFT lets require grad
    (model(tokens) * weights).sum().backward()
    (theirs(tokens).logits * weights).sum().backward()
    mine = trainable_parameters(model)
    peft_grads = {n: p.grad for n, p in theirs.named_parameters() if p.requires_grad}
    assert len(mine) == len(peft_grads) == 112
    for name, grad in peft_grads.items():
        ours = (name.removeprefix("base_model.model.").replace(".default", "").replace("forget_gate.", "")
                .replace(".mlp.shared_experts.", ".block_sparse_moe.shared_experts."))
        g = mine[ours].grad
        assert g is not None and (g - grad).abs().max() <= 1e-3 * grad.abs().max() + 1e-6, name
