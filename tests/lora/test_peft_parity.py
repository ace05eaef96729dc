"""PEFT parity on Kimi Linear: adapters moeswap saves load with `peft` onto transformers' KimiLinearForCausalLM and
give moeswap's logits; adapters PEFT saves load into moeswap with PEFT's logits; LoRA gradients agree.

Targets: every dense Linear kind (KDA and MLA projections, the dense MLP, shared experts, lm_head); and routed
experts, which transformers stores fused as 3-D parameters (experts.gate_up_proj / down_proj) and PEFT adapts with
`target_parameters` (lora.fused_experts maps them onto moeswap's per-expert LoRA; moeswap's own per-expert routed
LoRA has no PEFT form for this port). B is random: PEFT starts it at zero, which would make every comparison
trivially equal."""

from __future__ import annotations

import json
import logging
import shutil
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

# the tiny transformers Kimi Linear of the model parity tests (4 KDA + 1 MLA layers, a dense first layer,
# 8 routed experts and a shared one)
from models.test_kimi_linear_parity import _reference_model as _reference  # noqa: E402
from moeswap.cli import main  # noqa: E402
from moeswap.lora import LoRAConfig, attach_lora, fingerprint, load_adapter, save_adapter, trainable_parameters  # noqa: E402
from moeswap.models.loader import LoadOptions, load_model  # noqa: E402
from moeswap.text.tokenizer import load_tokenizer  # noqa: E402
from moeswap.tiny.tokenizer import build_tiny_tokenizer  # noqa: E402
from numerics import assert_within_rounding  # noqa: E402

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


def peft_model(adapter_dir=None, seed: int = 1, **lora):
    """transformers' model with a PEFT LoRA: loaded from `adapter_dir`, or made by get_peft_model with random B
    (`lora`: LoraConfig's fields, default r 4, alpha 8, TARGETS)."""
    ref = _reference()
    if adapter_dir is not None:
        return peft.PeftModel.from_pretrained(ref, adapter_dir).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' reference-kernel notices
        model = peft.get_peft_model(ref, peft.LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": TARGETS,
                                                            **lora}))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.eval()


def n_lora_modules(model) -> int:
    return sum(1 for name, _ in model.named_modules() if name.endswith(".lora_A"))


def test_moeswap_adapter_loads_in_peft(base, tmp_path, tokens, randomize_b, caplog):
    model, _ = load_model(base, LoadOptions(dtype="float32"))
    targets = attach_lora(model, LoRAConfig(r=4, alpha=8, target_modules=TARGETS),
                          generator=torch.Generator().manual_seed(0))
    randomize_b(model)
    save_adapter(model, tmp_path / "adapter", base_model="tiny-kimi-linear", base_fingerprint=fingerprint(base))
    with warnings.catch_warnings(record=True) as seen, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        theirs = peft_model(tmp_path / "adapter")
    # PEFT says nothing: no "Unexpected keyword arguments [...] upgrade PEFT" (warnings.warn) nor a logged word
    assert [str(w.message) for w in seen if "peft" in w.filename.replace("\\", "/").split("/")] == []
    assert [r.getMessage() for r in caplog.records if r.name.split(".")[0] == "peft"] == []
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


FUSED = ["experts.gate_up_proj", "experts.down_proj"]  # transformers' fused routed experts (3-D parameters)


@pytest.fixture(scope="module")
def fused_adapter(tmp_path_factory):
    """PEFT's target_parameters LoRA of every MoE layer's fused routed experts (random B), saved; and the
    PEFT model it came from."""
    theirs = peft_model(seed=3, target_modules=[], target_parameters=FUSED)
    path = tmp_path_factory.mktemp("fused") / "adapter"
    theirs.save_pretrained(path)
    return path, theirs


def test_peft_fused_expert_adapter_gives_peft_logits(base, fused_adapter, tokens):
    """Each expert's slice of PEFT's fused factors (lora.fused_experts) applied as moeswap's per-expert LoRA:
    PEFT's logits to within its own fp32 rounding (tests/numerics.py), which the adapter moves by far more."""
    path, theirs = fused_adapter
    model, _ = load_model(base, LoadOptions(dtype="float32"))
    cfg = load_adapter(model, path, base_dir=base)
    assert cfg.target_parameters == tuple(FUSED) and cfg.target_modules == ()
    lora = [b.expert_lora for b in model.moe_blocks()]
    assert len(lora) == 4 and all(x.projections == ("w1", "w2", "w3") and x.rank == 4 for x in lora)
    exact_ref = _reference().double()
    exact_ref.set_experts_implementation("eager")  # torch._grouped_mm takes no float64
    exact_model = peft.PeftModel.from_pretrained(exact_ref, path).eval()
    with torch.no_grad():
        got, want, exact = model(tokens), theirs(tokens).logits, exact_model(tokens).logits
        plain = _reference()(tokens).logits
    assert_within_rounding(got, want, exact)
    assert (want - plain).abs().max().item() > 0.5  # the adapter changes the logits: the check is not vacuous


def test_generate_with_a_peft_fused_expert_adapter(base, fused_adapter, tmp_path, capsys):
    """`moeswap generate --lora` takes PEFT's target_parameters adapter and gives PEFT's greedy tokens."""
    path, theirs = fused_adapter
    model_dir = tmp_path / "model"
    shutil.copytree(base, model_dir)
    build_tiny_tokenizer(model_dir, 320)  # generate reads text: the tiny tokenizer, within the model's vocab
    prompt = "the quick brown fox"
    ids = load_tokenizer(model_dir).encode(prompt, add_bos=False)
    code = main(["generate", str(model_dir), "--prompt", prompt, "--json", "--max-tokens", "12", "--ignore-eos",
                 "--lora", str(path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    with torch.no_grad():
        want = theirs.generate(input_ids=torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12,
                               do_sample=False)[0, len(ids):].tolist()
        plain = _reference().generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12,
                                      do_sample=False)[0, len(ids):].tolist()
    assert json.loads(out)["tokens"] == want != plain


def test_a_fused_expert_adapter_that_does_not_fit_is_one_line(base, fused_adapter, tmp_path):
    """A fused pair of the wrong width, or for a module with no routed experts, is refused by name before the
    model is touched."""
    from safetensors.torch import load_file, save_file

    path, _ = fused_adapter
    key = "base_model.model.model.layers.1.mlp.experts.lora_B.weight"
    for case, edit, fragment in [
        ("narrow", lambda t: {**t, key: t[key][:-1].contiguous()}, "fit neither gate_up_proj [8, 64, 64]"),
        ("elsewhere", lambda t: {k.replace("layers.1.mlp.experts", "layers.0.mlp.experts"): v for k, v in t.items()},
         "model.layers.0.mlp.experts: target_parameters LoRA of a module that is no routed-expert set"),
    ]:
        bad = tmp_path / case
        shutil.copytree(path, bad)
        save_file(edit(load_file(bad / "adapter_model.safetensors")), bad / "adapter_model.safetensors")
        model, _ = load_model(base, LoadOptions(dtype="float32"))
        with pytest.raises(ValueError) as err:
            load_adapter(model, bad)
        assert "\n" not in str(err.value) and fragment in str(err.value), str(err.value)
        assert all(b._modules.get("expert_lora") is None for b in model.moe_blocks())
