"""Oracle parity: a tiny Kimi Linear made and saved by transformers, loaded by moeswap (fp32)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moeswap.engine.generate import GenerationConfig, generate  # noqa: E402
from moeswap.models.loader import LoadOptions, load_model  # noqa: E402


def _reference_model(seed: int = 0):
    cfg = transformers.KimiLinearConfig(
        vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=5,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, num_local_experts=8, num_experts_per_tok=3, n_shared_experts=1, first_k_dense_replace=1,
        linear_attn_config={"kda_layers": [1, 2, 3, 5], "full_attn_layers": [4], "num_heads": 4, "head_dim": 16,
                            "short_conv_kernel_size": 4},
        initializer_range=0.08, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = transformers.KimiLinearForCausalLM(cfg).eval()
    with torch.no_grad():  # make routing and gates informative rather than near-uniform
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.normal_(0, 0.05)
            elif name.endswith(("o_norm.weight", "layernorm.weight", "norm.weight")):
                p.normal_(1.0, 0.1)
    return model


@pytest.fixture(scope="module")
def saved_reference(tmp_path_factory):
    ref = _reference_model()
    path = tmp_path_factory.mktemp("kimi_linear_ref")
    ref.save_pretrained(path)
    return ref, path


def test_logits_match_transformers(saved_reference):
    ref, path = saved_reference
    model, _ = load_model(path, LoadOptions(dtype="float32"))
    tokens = torch.randint(3, 320, (1, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(tokens).logits
        got = model(tokens)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-4
    assert want.std() > 0.05  # the comparison is not between two near-constant outputs


def test_greedy_tokens_match_transformers(saved_reference):
    ref, path = saved_reference
    model, _ = load_model(path, LoadOptions(dtype="float32"))
    prompt = torch.randint(3, 320, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ref.generate(prompt, max_new_tokens=32, do_sample=False, min_new_tokens=32)[0, 16:].tolist()
    got = generate(model, prompt[0].tolist(), GenerationConfig(max_tokens=32, stop_ids=())).tokens
    assert got == want
    assert len(set(want)) > 3  # greedy output is not one repeated token
