"""`init-tiny --size k3-slice` (tiny/k3_slice.py): Kimi K3's published config at its real widths, cut to a few
layers and experts. The oracle is K3's own config.json (tests/data/kimi_k3_config.json): every key but the cut
equals it; the full-width plan's every tensor passes the loader's checks against the model built on `meta`
(headers over sparse files: nothing is written); a slice with shrunk widths goes through the same writer and
loads, and its forward gives finite logits."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from moeswap import archs
from moeswap.cli import main
from moeswap.config import parse_config
from moeswap.engine.generate import GenerationConfig, generate
from moeswap.experts.source import ExpertIndex
from moeswap.formats.checkpoint import INDEX_NAME, Checkpoint
from moeswap.formats.mxfp4 import decode
from moeswap.formats.writer import DTYPE_NAMES, layout
from moeswap.models import build_model
from moeswap.models.loader import load_model
from moeswap.text.tokenizer import load_tokenizer
from moeswap.tiny import SIZES, tiny_config, write_tiny_model
from moeswap.tiny.k3_slice import k3_specials, plan, shards
from moeswap.tiny.tokenizer import build_tiny_tokenizer
from moeswap.tiny.values import random_bf16

PUBLISHED = json.loads((Path(__file__).parent / "data" / "kimi_k3_config.json").read_text())

# Keys a slice must change, and why. Everything else in text_config equals K3's.
CUT = {"num_hidden_layers", "num_experts", "linear_attn_config.kda_layers", "linear_attn_config.full_attn_layers"}
# Token ids: written from the slice's tokenizer (test_special_ids_are_k3s checks they come out as K3's).
TOKEN_IDS = {"bos_token_id", "eos_token_id", "pad_token_id"}
# The multimodal wrapper's keys for the vision tower, which a slice does not have (moeswap runs the text model).
NO_VISION = {"vision_config", "image_placeholder", "media_placeholder_token_id", "ignore_index"}


def flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "quantization_config":
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def test_config_equals_k3s_but_the_cut():
    mine = tiny_config("kimi_k3", "k3-slice")
    text, published = flat(mine.pop("text_config")), flat(PUBLISHED["text_config"])
    assert set(published) - set(text) == TOKEN_IDS
    assert set(text) - set(published) == set()
    assert {k: text[k] for k in set(text) - CUT} == {k: published[k] for k in set(text) - CUT}
    top = {k: v for k, v in PUBLISHED.items() if k != "text_config"}
    assert set(top) - set(mine) == TOKEN_IDS | NO_VISION
    assert mine == {k: top[k] for k in mine}
    assert text["num_hidden_layers"] == SIZES["k3-slice"]["layers"] == 4
    assert text["num_experts"] == SIZES["k3-slice"]["experts"]


@pytest.mark.parametrize("layers", [2, 3, 4, 5, 13])
def test_layer_pattern_is_k3s_first_layers_then_mla(layers):
    text = tiny_config("kimi_k3", "k3-slice", layers=layers)["text_config"]
    lac, k3 = text["linear_attn_config"], PUBLISHED["text_config"]["linear_attn_config"]
    # K3's own kinds for every layer but the last, which is MLA as K3's last layer is
    want_mla = [i for i in k3["full_attn_layers"] if i < layers] + [layers]
    assert lac["full_attn_layers"] == sorted(set(want_mla))
    assert lac["kda_layers"] == [i for i in k3["kda_layers"] if i < layers]
    cfg = parse_config(tiny_config("kimi_k3", "k3-slice", layers=layers))
    assert cfg.mlp_kinds[0] == "dense" and set(cfg.mlp_kinds[1:]) == {"moe"}


def test_layers_and_experts_are_checked():
    with pytest.raises(ValueError, match=r"^--layers 1: at least 2"):
        tiny_config("kimi_k3", "k3-slice", layers=1)
    with pytest.raises(ValueError, match=r"^--experts 15: at least the 16 experts"):
        tiny_config("kimi_k3", "k3-slice", experts=15)
    with pytest.raises(ValueError, match=r"^--size k3-slice is Kimi K3's own layout"):
        tiny_config("kimi_linear", "k3-slice")


def test_cli_refuses_a_bad_slice_in_one_line(tmp_path, capsys):
    assert main(["init-tiny", str(tmp_path / "m"), "--size", "k3-slice", "--experts", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--experts 3" in err[0]
    assert not (tmp_path / "m").exists()


def test_special_ids_are_k3s(tmp_path):
    vocab = PUBLISHED["text_config"]["vocab_size"]
    build_tiny_tokenizer(tmp_path, vocab, specials=k3_specials(vocab), lines=["a b c"])
    tok = load_tokenizer(tmp_path)
    assert tok.vocab_size == vocab
    assert tok.bos_id == PUBLISHED["bos_token_id"] == PUBLISHED["text_config"]["bos_token_id"]
    assert tok.eos_ids[0] == PUBLISHED["eos_token_id"] == PUBLISHED["text_config"]["eos_token_id"]
    assert vocab - 1 == PUBLISHED["pad_token_id"]  # model.py writes the top id as pad


def sparse_checkpoint(directory: Path, groups) -> Checkpoint:
    """Safetensors files with the plan's headers and holes for data: the loader's header checks run on them
    without a byte of the GBs being written."""
    weight_map = {}
    for i, group in enumerate(groups):
        file = directory / f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, dtype, shape in layout((t.name, t.dtype, t.shape) for t in group):
            n = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
            weight_map[name] = file.name
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(file, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            f.truncate(8 + len(raw) + offset)
    (directory / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return Checkpoint.open(directory)


def test_full_width_plan_passes_the_loaders_checks(tmp_path):
    """The default slice (4 layers x 304 experts, 26.4 GB) as the loader sees it: every dense tensor maps to a
    parameter of the model built on `meta` for its config and has its shape; every expert of every MoE layer
    is there with K3's MXFP4 shapes (ExpertIndex.validate, the loader's expert check)."""
    raw = tiny_config("kimi_k3", "k3-slice")
    cfg = parse_config(raw)
    units = plan(raw)
    ckpt = sparse_checkpoint(tmp_path, shards(units, 4_000_000_000))
    arch = archs.get("kimi_k3")
    params = {n: tuple(p.shape) for n, p in build_model(cfg, device="meta").named_parameters()}
    index, filled = ExpertIndex(), set()
    for name in ckpt.names():
        info = ckpt.info(name)
        target, match = arch.classify(name.removeprefix(cfg.weight_prefix))
        if target == "expert":
            index.add(*arch.expert_key(match), name)
            continue
        assert target in params and target not in filled, name
        assert tuple(arch.sanitize(target, torch.empty(info.shape, device="meta"), cfg).shape) == params[target]
        filled.add(target)
    assert filled == set(params)
    index.validate(ckpt, cfg)
    experts = [u for u in units if u[0].expert is not None]
    assert len(experts) == 3 * 304
    # K3's expert: 3 x (3072 x 3584 codes at 4 bits + a scale byte per 32), 17.55 MB
    assert {sum(t.nbytes for t in u) for u in experts} == {3 * (3072 * 3584 // 2 + 3072 * 3584 // 32)} == {17_547_264}
    # what --size k3-slice's help says: 16.0 GB of experts, 10.4 GB of dense weights
    assert sum(t.nbytes for u in experts for t in u) == 912 * 17_547_264 == 16_003_104_768
    assert sum(t.nbytes for u in units for t in u) == 26_396_336_960
    by_name = {t.name: t for u in units for t in u}
    assert by_name["language_model.model.embed_tokens.weight"].shape == (163840, 7168)
    assert by_name["language_model.model.layers.1.self_attn.A_log"].shape == (128,)  # K3's zero-padded [128]
    assert by_name["language_model.model.layers.3.self_attn.kv_b_proj.weight"].shape == (96 * 256, 512)


SHRUNK = dict(hidden=256, vocab=1024, heads=2, head_dim=64, kv_lora=64, q_lora=64, nope=32, rope=16, experts=8,
              top_k=2, expert_dim=64, latent=128, dense=256)


@pytest.fixture
def shrunk_slice(tmp_path, monkeypatch):
    """A k3-slice with small widths, written by the same code (write_tiny_model -> k3_slice.write_tensors)."""
    monkeypatch.setitem(SIZES, "k3-slice", {**SIZES["k3-slice"], **SHRUNK})
    return write_tiny_model(tmp_path / "slice", "kimi_k3", "k3-slice", 0, shard_bytes=100_000, layers=4)


def test_shrunk_slice_writes_the_plan_loads_and_runs(shrunk_slice, monkeypatch):
    raw = json.loads((shrunk_slice / "config.json").read_text())
    monkeypatch.setitem(SIZES, "k3-slice", {**SIZES["k3-slice"], **SHRUNK})
    units = plan(tiny_config("kimi_k3", "k3-slice", layers=4))
    ckpt = Checkpoint.open(shrunk_slice)
    written = {n: (ckpt.info(n).dtype, tuple(ckpt.info(n).shape), ckpt.info(n).file.name) for n in ckpt.names()}
    assert {n: v[:2] for n, v in written.items()} == {t.name: (t.dtype, t.shape) for u in units for t in u}
    assert len({v[2] for v in written.values()}) > 2
    for unit in units:  # a unit (an expert's six tensors) never spans two shards
        assert len({written[t.name][2] for t in unit}) == 1
    # the MXFP4 experts decode to weights of std ~ 1/sqrt(fan in): scale byte 127 + round(log2(1/(sqrt(in) *
    # rms(E2M1)))) +- 1, so within a factor 2^1.5 either way
    name = "language_model.model.layers.1.block_sparse_moe.experts.5.w2"
    w = decode(ckpt.read(name + ".weight_packed"), ckpt.read(name + ".weight_scale"), torch.float32)
    assert 2 ** -1.5 < w.std().item() * math.sqrt(w.shape[1]) < 2 ** 1.5
    model, _ = load_model(shrunk_slice)
    assert model.config.num_layers == raw["text_config"]["num_hidden_layers"] == 4
    tokens = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        logits = model(tokens)
    assert logits.shape[-1] == 1024 and torch.isfinite(logits).all()
    out = generate(model, [1, 2, 3], GenerationConfig(max_tokens=4, stop_ids=()))
    assert len(out.tokens) == 4


def test_slice_is_deterministic(shrunk_slice, tmp_path, monkeypatch):
    monkeypatch.setitem(SIZES, "k3-slice", {**SIZES["k3-slice"], **SHRUNK})
    again = write_tiny_model(tmp_path / "again", "kimi_k3", "k3-slice", 0, shard_bytes=100_000, layers=4)
    for f in sorted(shrunk_slice.iterdir()):
        assert f.read_bytes() == (again / f.name).read_bytes(), f.name


@pytest.mark.parametrize("std", [0.5 / math.sqrt(7168), 0.5 / math.sqrt(33792), 0.003, 0.1, 1.0])
def test_random_bf16_has_the_std_within_a_factor_2(std):
    """k3-slice's dense projections, drawn as bits: rms within a factor 2 of the asked std (the exponent is one
    of two neighbours), finite, half negative."""
    x = random_bf16((512, 1024), torch.Generator().manual_seed(0), std)
    exponents = set(((x.view(torch.int16) >> 7) & 0xFF).unique().tolist())
    assert x.dtype == torch.bfloat16 and len(exponents) == 2 and torch.isfinite(x).all()
    assert std / 2 <= x.float().pow(2).mean().sqrt().item() <= 2 * std
    assert abs((x < 0).float().mean().item() - 0.5) < 0.01  # 512K signs: 0.01 is 14 standard deviations
