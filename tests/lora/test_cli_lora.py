"""`moeswap generate --lora` and `moeswap merge`: the adapter's tokens and logits, and bad input as one line, exit 2."""

from __future__ import annotations

import shutil

import pytest
import torch

from moeswap.cli import main
from moeswap.lora import LoRAConfig, attach_lora, detach_lora, fingerprint, load_adapter, lora_modules, save_adapter
from moeswap.lora.merge import REPORT_NAME
from moeswap.models.loader import LoadOptions, load_model
from moeswap.text.tokenizer import load_tokenizer

PROMPT = "the quick brown fox"
TARGETS = ("q_proj", "kv_b_proj", "o_proj", "gate_proj", "down_proj", "routed_expert_up_proj", "lm_head")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, *fragments: str) -> None:
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moeswap: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"


def make_adapter(base, out, randomize_b, scale: float = 0.1):
    model, _ = load_model(base, LoadOptions())
    attach_lora(model, LoRAConfig(r=4, alpha=8, target_modules=TARGETS), generator=torch.Generator().manual_seed(0))
    randomize_b(model, scale=scale)
    save_adapter(model, out, base_fingerprint=fingerprint(base))
    return out


@pytest.fixture
def k3_adapter(tiny_k3_dir, tmp_path, randomize_b):
    return make_adapter(tiny_k3_dir, tmp_path / "adapter", randomize_b)


def test_generate_with_an_adapter(capsys, tiny_k3_dir, k3_adapter, greedy_oracle, strict_json):
    code, out, err = run(capsys, "generate", str(tiny_k3_dir), "--prompt", PROMPT, "--json", "--max-tokens", "6",
                         "--ignore-eos", "--lora", f"style={k3_adapter}")
    assert code == 0, err
    got = strict_json(out)
    model, _ = load_model(tiny_k3_dir, LoadOptions())
    ids = load_tokenizer(tiny_k3_dir).encode(PROMPT, add_bos=False)
    base_tokens = greedy_oracle(model, ids, 6)
    load_adapter(model, k3_adapter)
    assert got["tokens"] == greedy_oracle(model, ids, 6) != base_tokens
    assert got["lora"] == str(k3_adapter)
    assert got["native_decode_steps"] == 0  # the C decode step does not know LoRA: the modules run
    code, out, _ = run(capsys, "generate", str(tiny_k3_dir), "--prompt", PROMPT, "--json", "--max-tokens", "6",
                       "--ignore-eos", "--lora", str(k3_adapter))
    assert code == 0 and strict_json(out)["tokens"] == got["tokens"]  # PATH alone, as NAME=PATH


@pytest.mark.parametrize("flags, fragments", [
    (["--lora", "{tmp}/nothing"], ["{tmp}/nothing: expected an adapter directory"]),
    (["--lora", "a=x", "--lora", "b=y"], ["--lora: generate applies one adapter, got 2"]),
])
def test_generate_bad_lora(capsys, tiny_k3_dir, tmp_path, flags, fragments):
    flags = [f.format(tmp=tmp_path) for f in flags]
    fragments = [f.format(tmp=tmp_path) for f in fragments]
    code, _, err = run(capsys, "generate", str(tiny_k3_dir), "--prompt", PROMPT, *flags)
    assert_one_line_error(code, err, *fragments)


def test_generate_refuses_an_adapter_for_another_base(capsys, tiny_linear_dir, k3_adapter):
    code, _, err = run(capsys, "generate", str(tiny_linear_dir), "--prompt", PROMPT, "--lora", str(k3_adapter))
    assert_one_line_error(code, err, "was made for a different base model")


def logits(path, tokens, adapter=None):
    model, _ = load_model(path, LoadOptions(dtype="float32"))
    if adapter is not None:
        load_adapter(model, adapter)
    with torch.no_grad():
        return model(tokens)


def test_merge_k3(capsys, tiny_k3_dir, k3_adapter, tmp_path, strict_json):
    """K3's dense weights are bf16: merged in bf16, each weight rounded once (what the report says)."""
    out = tmp_path / "merged"
    code, stdout, err = run(capsys, "merge", str(tiny_k3_dir), str(k3_adapter), str(out), "--json")
    assert code == 0, err
    report = strict_json(stdout)
    assert report == strict_json((out / REPORT_NAME).read_text())
    model, _ = load_model(tiny_k3_dir, LoadOptions())
    load_adapter(model, k3_adapter)
    assert report["merged_tensors"] == len(lora_modules(model))
    assert all(r["dtype"] == "bfloat16" for r in report["tensors"])
    assert 0 < report["max_abs_rounding"] <= max(r["max_abs_update"] for r in report["tensors"]) / 100
    tokens = torch.randint(3, 500, (2, 21), generator=torch.Generator().manual_seed(7))
    base, adapted, merged = logits(tiny_k3_dir, tokens), logits(tiny_k3_dir, tokens, k3_adapter), logits(out, tokens)
    # the checkpoint holds what merging in memory gives (each weight W + s B A rounded to bf16 once) ...
    model, _ = load_model(tiny_k3_dir, LoadOptions(dtype="float32"))
    load_adapter(model, k3_adapter)
    detach_lora(model, merge=True)
    with torch.no_grad():
        assert torch.equal(merged, model(tokens))
    # ... and without that rounding (fp32 weights) merging is the adapter's function; this random tiny model
    # amplifies perturbations ~10x a layer, so the bf16 rounding alone moves its logits visibly
    model, _ = load_model(tiny_k3_dir, LoadOptions(dtype="float32", dense_weights="compute"))
    load_adapter(model, k3_adapter)
    detach_lora(model, merge=True)
    with torch.no_grad():
        assert (model(tokens) - adapted).abs().max() <= 1e-3 * (adapted - base).abs().max()
    for name in ("config.json", "tokenizer.json"):
        assert (out / name).read_bytes() == (tiny_k3_dir / name).read_bytes()


def test_merge_fp32_checkpoint(capsys, tmp_path, randomize_b, strict_json):
    """A checkpoint stored in fp32 (transformers' Kimi Linear): the merged model gives the adapter's logits,
    routed experts included."""
    transformers = pytest.importorskip("transformers")  # noqa: F841
    from models.test_kimi_linear_parity import _reference_model

    base = tmp_path / "base"
    _reference_model().save_pretrained(base)
    model, _ = load_model(base, LoadOptions(dtype="float32"))
    targets = ("q_proj", "f_b_proj", "kv_b_proj", "shared_experts.up_proj", "gate_proj", "w1", "w2", "w3")
    attach_lora(model, LoRAConfig(r=4, alpha=8, target_modules=targets), generator=torch.Generator().manual_seed(0))
    randomize_b(model)
    save_adapter(model, tmp_path / "adapter", base_fingerprint=fingerprint(base))
    code, out, err = run(capsys, "merge", str(base), str(tmp_path / "adapter"), str(tmp_path / "merged"), "--json")
    assert code == 0, err
    report = strict_json(out)
    assert report["merged_expert_weights"] > 0 and {e["format"] for e in report["experts"]} == {"float"}
    tokens = torch.randint(3, 320, (2, 40), generator=torch.Generator().manual_seed(1))
    base_logits, merged = logits(base, tokens), logits(tmp_path / "merged", tokens)
    adapted = logits(base, tokens, tmp_path / "adapter")
    assert (merged - adapted).abs().max() <= 1e-4 and (adapted - base_logits).abs().max() > 0.5


def test_merge_writes_its_own_model_card(capsys, tiny_k3_dir, k3_adapter, tmp_path, strict_json):
    """The base's README.md describes the base: the merge writes a card of its own (base, adapter, date, what
    was merged, the report's counts), keeping only the base card's license lines."""
    import datetime

    import yaml

    base = tmp_path / "base"
    shutil.copytree(tiny_k3_dir, base)
    (base / "README.md").write_text("---\nlicense: other\nlicense_name: tiny-license\npipeline_tag: text-generation\n"
                                    "---\n# The tiny base\n\nThis card is about the base model.\n")
    before = datetime.datetime.now(datetime.timezone.utc).date()
    code, stdout, err = run(capsys, "merge", str(base), str(k3_adapter), str(tmp_path / "merged"), "--json")
    after = datetime.datetime.now(datetime.timezone.utc).date()
    assert code == 0, err
    report = strict_json(stdout)
    card = (tmp_path / "merged" / "README.md").read_text()
    assert "the base model" not in card and "The tiny base" not in card
    front = yaml.safe_load(card.split("---\n")[1])
    assert front == {"license": "other", "license_name": "tiny-license"}
    assert any(f"on {d.isoformat()} (UTC)" in card for d in {before, after})
    assert f"Base model: `{base}`" in card and f"Adapter: `{k3_adapter}` (LoRA r=4, alpha=8" in card
    assert f"Merged: {report['merged_tensors']} dense weight tensors" in card and report["merged_tensors"] > 0
    # a base without a card: the merge's card, no front matter
    run(capsys, "merge", str(tiny_k3_dir), str(k3_adapter), str(tmp_path / "merged2"))
    assert (tmp_path / "merged2" / "README.md").read_text().startswith("# A base model with a LoRA adapter merged in\n")


def test_merge_bad_input(capsys, tiny_k3_dir, k3_adapter, tmp_path):
    out = tmp_path / "out"
    code, _, err = run(capsys, "merge", str(tiny_k3_dir), str(tmp_path / "none"), str(out))
    assert_one_line_error(code, err, "expected an adapter directory")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "adapter_config.json").write_text("{not json")
    (tmp_path / "bad" / "adapter_model.safetensors").write_bytes(b"")
    code, _, err = run(capsys, "merge", str(tiny_k3_dir), str(tmp_path / "bad"), str(out))
    assert_one_line_error(code, err, "adapter_config.json")
    assert not out.exists()
    # a NaN in the adapter is named, tensor and file, before anything is merged (it used to reach the JSON writer)
    from safetensors.torch import load_file, save_file

    nan = tmp_path / "nan"
    shutil.copytree(k3_adapter, nan)
    tensors = load_file(nan / "adapter_model.safetensors")
    name = sorted(tensors)[0]
    tensors[name][0, 0] = float("nan")
    save_file(tensors, nan / "adapter_model.safetensors")
    code, _, err = run(capsys, "merge", str(tiny_k3_dir), str(nan), str(out))
    assert_one_line_error(code, err, f"{nan / 'adapter_model.safetensors'}: {name} holds NaN or Inf values")
    assert not out.exists()


@pytest.mark.parametrize("linked", ["adapter_config.json", "adapter_model.safetensors"])
def test_an_adapter_file_linked_out_of_its_directory_is_one_line_for_merge_and_generate(capsys, tiny_k3_dir,
                                                                                        k3_adapter, tmp_path, linked):
    """A valid file, moved out and linked back: only its place can stop it (the model directories' rule)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.move(k3_adapter / linked, elsewhere / linked)
    (k3_adapter / linked).symlink_to(elsewhere / linked)
    out = tmp_path / "merged"
    code, _, err = run(capsys, "merge", str(tiny_k3_dir), str(k3_adapter), str(out))
    assert_one_line_error(code, err, f"'{linked}' is a link that resolves outside")
    assert not out.exists()
    code, out_text, err = run(capsys, "generate", str(tiny_k3_dir), "--prompt", PROMPT, "--max-tokens", "1",
                              "--lora", str(k3_adapter))
    assert_one_line_error(code, err, f"'{linked}' is a link that resolves outside")
    assert out_text == ""


EXPERT_TARGETS = ("q_proj", "o_proj", "w1", "w3")  # w2 left alone: its tensors must come through unchanged


@pytest.fixture
def k3_expert_adapter(tiny_k3_dir, tmp_path, randomize_b):
    """Dense and routed-expert LoRA (per-expert A and B, all nonzero) on the tiny K3."""
    model, _ = load_model(tiny_k3_dir, LoadOptions())
    attach_lora(model, LoRAConfig(r=4, alpha=8, target_modules=EXPERT_TARGETS),
                generator=torch.Generator().manual_seed(0))
    randomize_b(model, scale=0.5)
    return save_adapter(model, tmp_path / "expert_adapter", base_fingerprint=fingerprint(tiny_k3_dir))


def test_generate_with_routed_expert_lora(capsys, tiny_k3_dir, k3_expert_adapter, greedy_oracle, strict_json):
    code, out, err = run(capsys, "generate", str(tiny_k3_dir), "--prompt", PROMPT, "--json", "--max-tokens", "6",
                         "--ignore-eos", "--lora", str(k3_expert_adapter))
    assert code == 0, err
    model, _ = load_model(tiny_k3_dir, LoadOptions())
    ids = load_tokenizer(tiny_k3_dir).encode(PROMPT, add_bos=False)
    load_adapter(model, k3_expert_adapter)
    assert all(b.expert_lora.projections == ("w1", "w3") for b in model.moe_blocks())
    assert strict_json(out)["tokens"] == greedy_oracle(model, ids, 6)
    tokens = torch.tensor([ids])
    with torch.no_grad():
        adapted = model(tokens)
        for b in model.moe_blocks():
            b.detach_expert_lora()
        assert (model(tokens) - adapted).abs().max() > 0.1  # the experts' part of the adapter acts


def test_merge_routed_experts_requantises_them(capsys, tiny_k3_dir, k3_expert_adapter, tmp_path, strict_json):
    """Each adapted MXFP4 expert weight in the merged checkpoint is the project's codec applied to the decoded
    weight plus its update (an independent computation here, bit for bit); the report's errors are those of
    that re-encoding; what the adapter does not touch is copied bit for bit."""
    from safetensors import safe_open

    from moeswap.formats import compressed_tensors as ct
    from moeswap.formats import mxfp4
    from moeswap.formats.checkpoint import Checkpoint

    out = tmp_path / "merged"
    code, stdout, err = run(capsys, "merge", str(tiny_k3_dir), str(k3_expert_adapter), str(out), "--json")
    assert code == 0, err
    report = strict_json(stdout)
    with Checkpoint.open(tiny_k3_dir) as ckpt:
        dense = [n for n in ckpt.names() if n.endswith(("q_proj.weight", "o_proj.weight"))]
    assert report["merged_tensors"] == len(dense) and report["merged_expert_weights"] == 5 * 16 * 2
    assert [(r["layer"], r["projection"], r["format"]) for r in report["experts"]] == [
        (f"model.layers.{i}.block_sparse_moe", p, "mxfp4") for i in range(1, 6) for p in ("w1", "w3")]
    with safe_open(k3_expert_adapter / "adapter_model.safetensors", "pt") as f:
        lora = {k: f.get_tensor(k) for k in f.keys()}
    prefix = "language_model.model.layers.{l}.block_sparse_moe.experts.{e}.{p}"
    with Checkpoint.open(tiny_k3_dir) as base, Checkpoint.open(out) as merged:
        for p in ("w1", "w3"):
            worst, total, count = 0.0, 0.0, 0
            for e in range(16):
                name = prefix.format(l=2, e=e, p=p)
                stored = {s: base.read(f"{name}.{s}") for s in ("weight_packed", "weight_scale")}
                W = mxfp4.decode(stored["weight_packed"], stored["weight_scale"], torch.float32)
                A, B = (lora[f"base_model.model.{name}.lora_{x}.weight"] for x in "AB")
                delta = (B @ A) * (8 / 4)
                want = ct.encode_weight("mxfp4", W + delta)
                for s in ("weight_packed", "weight_scale"):
                    assert torch.equal(merged.read(f"{name}.{s}"), want[s].view(stored[s].dtype)), (name, s)
                got = mxfp4.decode(want["weight_packed"], want["weight_scale"], torch.float64)
                error = (got - (W.double() + delta.double())).abs()
                worst, total, count = max(worst, error.max().item()), total + error.sum().item(), count + error.numel()
            row = next(r for r in report["experts"] if r["layer"] == "model.layers.2.block_sparse_moe"
                       and r["projection"] == p)
            assert row["max_abs_error"] == pytest.approx(worst, rel=1e-12)
            assert row["mean_abs_error"] == pytest.approx(total / count, rel=1e-9)
        for name in base.names():
            if not any(f".{p}." in name for p in ("q_proj", "o_proj", "w1", "w3")):
                assert torch.equal(merged.read(name), base.read(name)), name  # w2, norms, routers ...


def test_merge_into_deepseek_v3_gives_the_adapters_logits(capsys, tmp_path, randomize_b, strict_json):
    """DeepSeek-V3 saved by transformers (fp32; routed experts under mlp.experts.E.{gate,up,down}_proj): an
    adapter on MLA, the dense MLP, shared and routed experts merges into those published names."""
    transformers = pytest.importorskip("transformers")  # noqa: F841
    from models.test_deepseek_v3_parity import _reference_model

    base = tmp_path / "base"
    _reference_model().save_pretrained(base)
    model, _ = load_model(base, LoadOptions(dtype="float32"))
    targets = ("q_b_proj", "kv_b_proj", "kv_a_proj_with_mqa", "shared_experts.up_proj", "gate_proj", "w1", "w2")
    attach_lora(model, LoRAConfig(r=4, alpha=8, target_modules=targets), generator=torch.Generator().manual_seed(0))
    randomize_b(model)
    save_adapter(model, tmp_path / "adapter", base_fingerprint=fingerprint(base))
    code, out, err = run(capsys, "merge", str(base), str(tmp_path / "adapter"), str(tmp_path / "merged"), "--json")
    assert code == 0, err
    report = strict_json(out)
    assert report["merged_expert_weights"] == 3 * 16 * 2 and {e["format"] for e in report["experts"]} == {"float"}
    tokens = torch.randint(3, 320, (2, 40), generator=torch.Generator().manual_seed(1))
    base_logits, merged = logits(base, tokens), logits(tmp_path / "merged", tokens)
    adapted = logits(base, tokens, tmp_path / "adapter")
    assert (merged - adapted).abs().max() <= 1e-4 and (adapted - base_logits).abs().max() > 0.5
