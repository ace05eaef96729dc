"""`moeswap inspect --verify`: a sound checkpoint passes (exit 0, strict JSON); a planted NaN, a planted bad
scale byte, a wrong or missing checksum are each found, named and fail the run (exit 2 with a summary)."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from moeswap.cli import main
from moeswap.formats import mxfp4
from moeswap.formats.checkpoint import Checkpoint, TensorInfo
from moeswap.verify import SCALE_RANGE, _check_scales, read_checksums, verify

DENSE = "language_model.model.layers.1.self_attn.q_proj.weight"
EXPERT = "language_model.model.layers.2.block_sparse_moe.experts.5.w3"


def info(model: Path, name: str) -> TensorInfo:
    with Checkpoint.open(model) as ckpt:
        return ckpt.info(name)


def plant(model: Path, name: str, at: int, data: bytes) -> TensorInfo:
    """Overwrites bytes of tensor `name` at byte `at` of its data, in place."""
    i = info(model, name)
    with open(i.file, "r+b") as f:
        f.seek(i.offset + at)
        f.write(data)
    return i


def strict_json(text: str) -> dict:
    def refuse(constant):
        raise AssertionError(f"not strict JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def sha256sum_list(model: Path) -> str:
    """sha256sum's own output for the model's files (hashlib in its format where the tool is missing)."""
    names = sorted(p.name for p in model.iterdir() if p.is_file())
    if shutil.which("sha256sum"):
        return subprocess.run(["sha256sum", *names], cwd=model, capture_output=True, text=True, check=True).stdout
    return "".join(f"{hashlib.sha256((model / n).read_bytes()).hexdigest()}  {n}\n" for n in names)


def test_a_sound_checkpoint_passes(tiny_k3_dir, capsys):
    assert main(["inspect", str(tiny_k3_dir), "--verify", "--json"]) == 0
    out = capsys.readouterr()
    v = strict_json(out.out)["verify"]
    assert v["ok"] and not any(v["problems"].values()) and out.err == ""
    with Checkpoint.open(tiny_k3_dir) as ckpt:
        assert v["tensors"] == len(ckpt)
        shards = {f.name for f in ckpt.files()}
    assert {f["name"] for f in v["files"]} == {p.name for p in tiny_k3_dir.iterdir()} >= shards
    for f in v["files"]:
        assert f["sha256"] == hashlib.sha256((tiny_k3_dir / f["name"]).read_bytes()).hexdigest()
        assert f["status"] == "unlisted"
    # 16 experts x 3 projections x 5 MoE layers decoded from MXFP4, and every dense weight
    assert v["modules_decoded"] > 240

    assert main(["inspect", str(tiny_k3_dir), "--verify"]) == 0
    text = capsys.readouterr().out
    assert text.rstrip().endswith(f"{tiny_k3_dir}: verified: {len(v['files'])} files, {v['tensors']} tensors; "
                                  f"no problems found")


def test_checksums_in_sha256sum_format(tiny_k3_dir, copy_model, capsys):
    model = copy_model(tiny_k3_dir)
    listing = sha256sum_list(model)
    (model / "SHA256SUMS").write_text(listing)
    v = verify(model)
    assert v["ok"] and v["checksum_lists"] == [{"file": "SHA256SUMS", "entries": len(listing.splitlines())}]
    assert {f["status"] for f in v["files"]} == {"ok"} and "SHA256SUMS" not in {f["name"] for f in v["files"]}

    shard = "model-00002-of-00003.safetensors"
    good = hashlib.sha256((model / shard).read_bytes()).hexdigest()
    wrong = "0" * 64
    (model / "SHA256SUMS").write_text(listing.replace(good, wrong))
    assert main(["inspect", str(model), "--verify"]) == 2
    out = capsys.readouterr()
    assert f"  {good}  {shard}  [MISMATCH: SHA256SUMS says {wrong}]" in out.out
    assert out.err == f"moeswap: error: {model}: verification failed: 1 checksum mismatch(es)\n"


def test_other_checksum_lists(tiny_k3_dir, copy_model):
    model = copy_model(tiny_k3_dir)
    shard = "model-00001-of-00003.safetensors"
    digest = hashlib.sha256((model / shard).read_bytes()).hexdigest()
    config = hashlib.sha256((model / "config.json").read_bytes()).hexdigest()
    (model / f"{shard}.sha256").write_text(digest.upper() + "\n")  # a bare digest names <file>.sha256's file
    (model / "manifest.json").write_text(json.dumps({"files": [
        {"path": "./config.json", "sha256": "sha256:" + config},
        {"path": "tokenizer.json", "sha256": "f" * 64},  # wrong
        {"path": "gone.safetensors", "sha256": "a" * 64},  # missing
        {"path": "../outside", "sha256": "b" * 64}]}))  # never read
    expected, lists = read_checksums(model)
    assert expected[shard] == [(digest, f"{shard}.sha256")] and expected["config.json"] == [(config, "manifest.json")]
    v = verify(model)
    status = {f["name"]: f["status"] for f in v["files"]}
    assert status[shard] == status["config.json"] == "ok" and status["tokenizer.json"] == "mismatch"
    assert [(e["name"], e["problem"]) for e in v["listed"]] == [
        ("../outside", "not a path inside the model directory"), ("gone.safetensors", "missing")]
    assert v["problems"] == {"nonfinite": 0, "bad_scales": 0, "undecodable": 0, "checksum_mismatches": 1,
                             "listed_files_missing": 2}
    (model / "SHA256SUMS").write_text("not a checksum\n")
    with pytest.raises(ValueError, match=r"SHA256SUMS, line 1: expected '<sha256 hex>  <file name>'"):
        verify(model)


def test_planted_nan_in_a_dense_weight(tiny_k3_dir, copy_model, capsys):
    model = copy_model(tiny_k3_dir)
    nan = torch.tensor([float("nan")], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    i = plant(model, DENSE, 2 * 7, nan)
    assert main(["inspect", str(model), "--verify", "--json"]) == 2
    out = capsys.readouterr()
    v = strict_json(out.out)["verify"]
    assert v["nonfinite"] == [{"tensor": DENSE, "file": i.file.name, "nan": 1, "inf": 0, "values": i.nbytes // 2}]
    assert v["problems"]["nonfinite"] == 1 and sum(v["problems"].values()) == 1
    assert out.err == f"moeswap: error: {model}: verification failed: 1 tensor(s) with non-finite values\n"


def test_planted_scale_bytes(tiny_k3_dir, copy_model, capsys):
    model = copy_model(tiny_k3_dir)
    scale = info(model, EXPERT + ".weight_scale")  # [64, 1] for w3 [64, 32]: byte at [3, 0] is offset 3
    original = (scale.file.read_bytes()[scale.offset + 3])
    assert SCALE_RANGE[0] <= original <= SCALE_RANGE[1]
    plant(model, EXPERT + ".weight_scale", 3, b"\xf8")  # 2^121: a flipped top bit; decodes finite
    v = verify(model)
    assert v["bad_scales"] == [{"tensor": EXPERT + ".weight_scale", "file": scale.file.name, "count": 1,
                                "nan_codes": 0, "blocks": scale.nbytes, "first_block": [3, 0], "first_byte": 0xF8,
                                "first_scale": "2^121"}]
    assert v["nonfinite"] == [] and not v["ok"]

    plant(model, EXPERT + ".weight_scale", 3, b"\xff")  # E8M0 NaN: a bad scale and 32 NaN weights
    assert main(["inspect", str(model), "--verify"]) == 2
    out = capsys.readouterr()
    assert (f"  scale out of range: {EXPERT}.weight_scale in {scale.file.name}: 1 of {scale.nbytes} blocks (1 NaN "
            f"code 0xFF); first at block [3, 0]: byte 0xff = NaN") in out.out
    assert f"  non-finite: {EXPERT} (mxfp4, decoded) in {scale.file.name}: 32 of 2,048 values (32 NaN, 0 infinite)" \
        in out.out
    assert out.err.endswith("verification failed: 1 tensor(s) with non-finite values, 1 with out-of-range scale "
                            "bytes\n")


def test_scale_window_against_the_encoder():
    """Bytes the encoder writes for plausible weights pass; a zero block's byte 0 passes; scales for blocks
    whose largest weight is below 2^-38 or above 2^42 do not."""
    w = torch.randn(4, 128, generator=torch.Generator().manual_seed(0)) * 0.02
    w[0, :32] = 0  # an all-zero block: scale byte 0
    w[1, :32] = 2.0 ** -45  # scale 2^(-45 - 2): below the window
    w[2, 32:64] = 2.0 ** 42  # scale 2^40: the last allowed
    w[3, 64:96] = 2.0 ** 44  # scale 2^42
    packed, scale = mxfp4.encode(w)
    report = {"bad_scales": []}
    _check_scales(scale, mxfp4.decode(packed, scale, torch.float32), TensorInfo("s", Path("f"), torch.uint8,
                                                                               (4, 4), 0, 16), report)
    (bad,) = report["bad_scales"]
    assert scale[0, 0] == 0 and scale[2, 1] == SCALE_RANGE[1] and scale[1, 0] == 127 - 47 and scale[3, 2] == 127 + 42
    assert bad["count"] == 2 and bad["first_block"] == [1, 0] and bad["first_scale"] == "2^-47"


def test_inspect_says_what_ends_a_completion_and_a_chat_answer(capsys, tiny_k3_dir, copy_model):
    """The end-of-sequence ids and the chat template's end of turn, which a chat answer also stops at where the
    checkpoint's ids leave it out (generation_config.json names <|end_of_msg|> only here)."""
    from moeswap.text.tokenizer import load_tokenizer

    model = copy_model(tiny_k3_dir)
    tok = load_tokenizer(model)
    eos, end = tok.special_to_id["<|end_of_msg|>"], tok.special_to_id["<|im_end|>"]
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    assert main(["inspect", str(model), "--json"]) == 0
    t = json.loads(capsys.readouterr().out)["tokens"]
    assert t["end_of_sequence"] == [{"id": eos, "text": "<|end_of_msg|>"}]
    assert (t["chat_template"], t["turn_end"]) == ("built-in", {"id": end, "text": "<|im_end|>"})
    assert [x["id"] for x in t["chat_stops"]] == [eos, end]
    assert main(["inspect", str(model)]) == 0
    assert "so a chat answer ends at <|end_of_msg|> (%d), <|im_end|> (%d)" % (eos, end) in capsys.readouterr().out
