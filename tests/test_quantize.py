"""`moeswap quantize`: bf16, block-FP8 and MXFP4 sources become MXFP4/MXFP8 checkpoints that moeswap and
compressed-tensors both load and decode to the same bits; block-FP8 experts from bf16, INT4 and block-FP8
sources; the error report; failures leave nothing."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from moeswap.cli import main
from moeswap.config import load_config
from moeswap.formats import compressed_tensors as ct
from moeswap.formats import fp8_block, mxfp4
from moeswap.formats.checkpoint import INDEX_NAME, Checkpoint, CheckpointError
from moeswap.models.loader import LoadOptions, load_model
from moeswap.quantize import REPORT_NAME, QuantizeOptions, compare_models, quantize

EXPERT = "model.layers.1.block_sparse_moe.experts.3.w2"


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.fixture(scope="module")
def linear_mxfp4(tiny_linear_dir, tmp_path_factory):
    return quantize(tiny_linear_dir, tmp_path_factory.mktemp("q") / "lin4", QuantizeOptions("mxfp4", "even"))


@pytest.fixture(scope="module")
def linear_mxfp8(tiny_linear_dir, tmp_path_factory):
    return quantize(tiny_linear_dir, tmp_path_factory.mktemp("q") / "lin8", QuantizeOptions("mxfp8", "rceil"))


def test_bf16_to_mxfp4_writes_a_valid_checkpoint(tiny_linear_dir, linear_mxfp4):
    out = Path(linear_mxfp4["destination"])
    cfg = load_config(out)
    assert cfg.quant.format == "mxfp4-pack-quantized" and cfg.quant.group_size == 32
    assert not cfg.quant.is_ignored(EXPERT) and cfg.quant.is_ignored("model.layers.1.self_attn.q_proj")
    src, dst = Checkpoint.open(tiny_linear_dir), Checkpoint.open(out)
    assert sorted(f.name for f in dst.files()) == sorted(f.name for f in src.files())  # same shards
    assert (out / "tokenizer.json").read_bytes() == (tiny_linear_dir / "tokenizer.json").read_bytes()
    index = json.loads((out / INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == dst.total_bytes < src.total_bytes
    packed, scale = mxfp4.encode(src.get(EXPERT + ".weight"), "even")
    assert torch.equal(dst.get(EXPERT + ".weight_packed"), packed)
    assert torch.equal(dst.get(EXPERT + ".weight_scale"), scale)
    dense = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(bits(dst.get(dense)), bits(src.get(dense)))  # everything else is copied as is

    summary = linear_mxfp4["summary"]
    report = json.loads((out / REPORT_NAME).read_text())
    assert summary["encoded"] == summary["expert_weights"] == len(report["tensors"]) == 5 * 16 * 3
    assert 0.05 < summary["mean_rel_error"] < summary["max_rel_error"] < 0.2  # MXFP4 on Gaussian weights
    row = next(r for r in report["tensors"] if r["name"] == EXPERT)
    w = src.get(EXPERT + ".weight").float()
    error = (mxfp4.decode(packed, scale, torch.float32) - w).norm() / w.norm()
    assert row["rel_error"] == pytest.approx(error.item(), rel=1e-6) and row["shape"] == [64, 64]


@pytest.mark.parametrize("which", ["linear_mxfp4", "linear_mxfp8"])
def test_output_loads_and_runs_in_moeswap(which, request):
    from moeswap.experts.source import ExpertIndex, load_expert
    from moeswap.ops.expert import ExpertWeights
    from moeswap.weights.registry import run_expert

    report = request.getfixturevalue(which)
    fmt = "mxfp8" if which.endswith("8") else "mxfp4"
    model, store = load_model(report["destination"], LoadOptions(dtype="float32"))
    with torch.no_grad():
        assert model(torch.arange(12).unsqueeze(0)).isfinite().all()
    with Checkpoint.open(report["destination"]) as ckpt:
        index = ExpertIndex()
        decoded = {}
        for proj in ("w1", "w2", "w3"):
            module = EXPERT.replace("w2", proj)
            stored = {s: ckpt.get(f"{module}.{s}") for s in ct.stored_names(fmt)}
            decoded[proj] = ct.decode_weight(fmt, stored, torch.float32)
            for suffix in stored:
                index.add(1, 3, proj, suffix, f"{module}.{suffix}")
        expert = load_expert(ckpt, index, 1, 3, torch.float32)
        assert torch.equal(expert.w2_IF, decoded["w2"]) and torch.equal(expert.w1_FI, decoded["w1"])
    # Whatever form the store keeps it in, the expert computes what its decoded weights do.
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    fetched = run_expert(store.fetch(1, [3])[0], x, "silu", (4.0, 25.0))
    expected = run_expert(ExpertWeights(decoded["w1"], decoded["w3"], decoded["w2"]), x, "silu", (4.0, 25.0))
    torch.testing.assert_close(fetched, expected, rtol=1e-5, atol=1e-6)


def _skeleton(ckpt: Checkpoint) -> nn.Module:
    """Linear modules named as in the checkpoint (what a transformers model would have), on meta."""
    root = nn.Module()
    modules: dict[str, dict[str, str]] = {}
    for name in ckpt.names():
        module, _, suffix = name.rpartition(".")
        modules.setdefault(module, {})[suffix] = name
    for module, tensors in modules.items():
        if "weight_packed" in tensors:
            out_dim, half = ckpt.info(tensors["weight_packed"]).shape
            shape = (out_dim, half * 2)
        elif "weight" in tensors and len(ckpt.info(tensors["weight"]).shape) == 2:
            shape = ckpt.info(tensors["weight"]).shape
        else:
            continue
        parent = root
        *path, leaf = module.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        parent.add_module(leaf, nn.Linear(shape[1], shape[0], bias=False, device="meta"))
    return root


@pytest.mark.parametrize("which", ["linear_mxfp4", "linear_mxfp8"])
def test_output_loads_in_compressed_tensors(which, request):
    """compressed-tensors parses the config, quantises exactly the routed experts of a model named like the
    checkpoint, and its own decompressor turns the written tensors into the weights moeswap decodes."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    out = Path(request.getfixturevalue(which)["destination"])
    config = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
    with Checkpoint.open(out) as ckpt:
        model = _skeleton(ckpt)
        apply_quantization_config(model, config, show_progress=False)
        quantised = {n: m for n, m in model.named_modules() if getattr(m, "quantization_scheme", None) is not None}
        linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        assert sorted(quantised) == sorted(n for n in linears if ".experts." in n)
        assert len(quantised) == 5 * 16 * 3
        compressor = BaseCompressor.get_value_from_registry(config.format)
        fmt = ct.short_name(config.format)
        for name in sorted(quantised)[::7]:
            stored = {s: ckpt.get(f"{name}.{s}") for s in ct.stored_names(fmt)}
            theirs = compressor.decompress(dict(stored), quantised[name].quantization_scheme)["weight"]
            assert torch.equal(bits(ct.decode_weight(fmt, stored, theirs.dtype)), bits(theirs)), name


def test_mxfp4_source_to_mxfp8_is_lossless_and_same_format_is_copied(tiny_k3_dir, tmp_path):
    report = quantize(tiny_k3_dir, tmp_path / "k3_8", QuantizeOptions("mxfp8"))
    assert report["summary"]["max_rel_error"] == 0.0 and report["summary"]["max_abs_error"] == 0.0
    raw = json.loads((tmp_path / "k3_8" / "config.json").read_text())
    assert raw["text_config"]["quantization_config"]["format"] == "mxfp8-quantized"  # where the source had it
    assert "quantization_config" not in raw
    quality = compare_models(tiny_k3_dir, tmp_path / "k3_8", tokens=16, generate_tokens=4)
    # Same weights; only the summation order differs (MXFP4 experts run in the CPU kernel, MXFP8 ones
    # in torch): fp32 rounding, ~1e-5 after 4 layers of random weights; a real format error is ~1e-2.
    assert quality["logit_rel_error"] < 1e-4 and quality["greedy_identical_prefix"] == 4

    report = quantize(tiny_k3_dir, tmp_path / "k3_4", QuantizeOptions("mxfp4", "floor"))
    assert report["summary"]["copied"] == report["summary"]["expert_weights"] > 0  # the shipped codes are kept
    src, dst = Checkpoint.open(tiny_k3_dir), Checkpoint.open(tmp_path / "k3_4")
    assert all(torch.equal(bits(src.get(n)), bits(dst.get(n))) for n in src.names())


def _block_fp8_copy(src: Path, dst: Path) -> list[str]:
    """A DeepSeek-style copy of a bf16 model: every projection (not embeddings, norms or the head) as block
    FP8 with weight_scale_inv, and `quant_method: fp8` in config.json. Returns the converted modules."""
    dst.mkdir()
    converted = []
    with Checkpoint.open(src) as ckpt:
        weight_map = json.loads((src / INDEX_NAME).read_text())["weight_map"]
        for file in ckpt.files():
            shard = {}
            for name in (n for n in ckpt.names() if ckpt.info(n).file == file):
                t = ckpt.get(name)
                if name.endswith("proj.weight") or ".experts." in name:
                    q, scale_inv = fp8_block.encode(t)
                    shard[name], shard[name + "_scale_inv"] = q, scale_inv
                    weight_map[name + "_scale_inv"] = file.name
                    converted.append(name.removesuffix(".weight"))
                else:
                    shard[name] = t.clone()
            save_file(shard, str(dst / file.name), metadata={"format": "pt"})
    (dst / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    (dst / "config.json").write_text(json.dumps(config))
    for extra in ("tokenizer.json", "tokenizer_config.json"):
        (dst / extra).write_bytes((src / extra).read_bytes())
    return converted


def test_block_fp8_source(tiny_linear_dir, tmp_path):
    converted = _block_fp8_copy(tiny_linear_dir, tmp_path / "fp8")
    report = quantize(tmp_path / "fp8", tmp_path / "out", QuantizeOptions("mxfp4"))
    dense = [m for m in converted if ".experts." not in m]
    assert sorted(report["dequantized_to_bf16"]) == sorted(dense)
    assert {r["source"] for r in report["tensors"]} == {"fp8_block"}
    src, dst = Checkpoint.open(tmp_path / "fp8"), Checkpoint.open(tmp_path / "out")
    name = "model.layers.1.self_attn.q_proj"
    assert name + ".weight_scale_inv" not in dst
    expected = fp8_block.decode(src.get(name + ".weight"), src.get(name + ".weight_scale_inv"), dtype=torch.bfloat16)
    assert torch.equal(bits(dst.get(name + ".weight")), bits(expected))
    w = fp8_block.decode(src.get(EXPERT + ".weight"), src.get(EXPERT + ".weight_scale_inv"), dtype=torch.float32)
    assert torch.equal(dst.get(EXPERT + ".weight_packed"), mxfp4.encode(w)[0])
    model, _ = load_model(tmp_path / "out", LoadOptions(dtype="float32"))
    with torch.no_grad():
        assert model(torch.arange(8).unsqueeze(0)).isfinite().all()


def test_cli(tiny_linear_dir, tmp_path, capsys, strict_json):
    assert main(["quantize", str(tiny_linear_dir), str(tmp_path / "o"), "--experts", "mxfp8", "--mode", "floor",
                 "--eval-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "routed experts as mxfp8-quantized (floor)" in out and "relative error" in out and "top-1 agreement" in out
    report = strict_json((tmp_path / "o" / REPORT_NAME).read_text())
    assert report["quality"]["tokens"] == 8
    for name in ("config.json", INDEX_NAME):
        strict_json((tmp_path / "o" / name).read_text())
    assert main(["quantize", str(tiny_linear_dir), str(tmp_path / "j"), "--experts", "mxfp4", "--json"]) == 0
    printed = strict_json(capsys.readouterr().out)
    assert printed["summary"] == strict_json((tmp_path / "j" / REPORT_NAME).read_text())["summary"]
    with pytest.raises(SystemExit) as exit_info:
        main(["quantize", str(tiny_linear_dir), str(tmp_path / "p"), "--experts", "nvfp4"])
    assert exit_info.value.code == 2 and "invalid choice: 'nvfp4'" in capsys.readouterr().err


def test_refusals(tiny_linear_dir, tmp_path, capsys):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    assert main(["quantize", str(tiny_linear_dir), str(tmp_path / "full"), "--experts", "mxfp4"]) == 2
    assert "exists and is not an empty directory" in capsys.readouterr().err
    assert (tmp_path / "full" / "x").read_text() == "keep me"
    with pytest.raises(ValueError, match="unknown compressed-tensors format 'nvfp4'"):
        quantize(tiny_linear_dir, tmp_path / "a", QuantizeOptions("nvfp4"))
    with pytest.raises(ValueError, match="scale mode must be one of even, floor, rceil"):
        quantize(tiny_linear_dir, tmp_path / "a", QuantizeOptions("mxfp4", "nearest"))
    with pytest.raises(ValueError, match=r"no routed-expert weights found \(module names matching 'nothing'"):
        quantize(tiny_linear_dir, tmp_path / "a", QuantizeOptions("mxfp4", expert_pattern="nothing"))
    with pytest.raises(FileNotFoundError, match="config.json: missing"):
        quantize(tmp_path / "full", tmp_path / "a")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]


def test_bad_expert_shape_and_mismatched_tensors(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    save_file({"experts.0.w1.weight": torch.zeros(8, 40, dtype=torch.bfloat16)}, str(src / "model.safetensors"))
    with pytest.raises(ValueError, match=r"experts.0.w1: shape \[8, 40\] cannot be stored as mxfp4-pack-quantized"):
        quantize(src, tmp_path / "out")
    save_file({"experts.0.w1.weight_packed": torch.zeros(8, 16, dtype=torch.uint8),
               "experts.0.w1.weight_scale": torch.zeros(8, 2, dtype=torch.uint8)}, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps({"quantization_config": ct.quantization_config("mxfp4", [])}))
    with pytest.raises(CheckpointError, match=r"experts.0.w1 in model.safetensors: cannot decode its mxfp4 weight: "
                                              r".*wrong group size"):
        quantize(src, tmp_path / "out", QuantizeOptions("mxfp8"))
    assert not (tmp_path / "out").exists()


def test_failure_midway_leaves_no_output(tiny_linear_dir, tmp_path, monkeypatch):
    calls = []

    def failing(fmt, w, mode="even"):
        calls.append(1)
        if len(calls) == 50:
            raise RuntimeError("disk on fire")
        return original(fmt, w, mode)

    original = ct.encode_weight
    monkeypatch.setattr(ct, "encode_weight", failing)
    with pytest.raises(RuntimeError, match="disk on fire"):
        quantize(tiny_linear_dir, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []  # neither the destination nor the temporary sibling


def test_mxfp8_experts_against_a_config_that_says_mxfp4(linear_mxfp8, copy_model):
    broken = copy_model(Path(linear_mxfp8["destination"]))
    raw = json.loads((broken / "config.json").read_text())
    raw["quantization_config"] = ct.quantization_config("mxfp4", raw["quantization_config"]["ignore"])
    (broken / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"stored as MXFP8 \(mxfp8-quantized\) but config.json's "
                                              r"quantization_config says format mxfp4-pack-quantized"):
        load_model(broken)


# -- interrupted, racing, disk full, non-finite sources ------------------------------------------------

# `moeswap quantize SRC DST --experts mxfp4` in a process that touches READY and stops at the 20th expert
# weight, its first shard half written: a kill there is a kill mid-write.
_STOPPED_QUANTIZE = """
import sys, time
from pathlib import Path
from moeswap.cli import main
from moeswap.formats import compressed_tensors as ct

original, calls = ct.encode_weight, []
def stopping(fmt, w, mode="even"):
    calls.append(1)
    if len(calls) == 20:
        Path(sys.argv[3]).touch()
        time.sleep(300)
    return original(fmt, w, mode)
ct.encode_weight = stopping
sys.exit(main(["quantize", sys.argv[1], sys.argv[2], "--experts", "mxfp4"]))
"""


def _stopped_quantize(src: Path, dst: Path, ready: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _STOPPED_QUANTIZE, str(src), str(dst), str(ready)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)
    return proc


def _same_files(a: Path, b: Path, skip=(REPORT_NAME,)) -> None:
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
    for file in a.iterdir():
        if file.name not in skip:
            assert file.read_bytes() == (b / file.name).read_bytes(), file.name


def test_sigterm_mid_write_leaves_nothing(tiny_linear_dir, tmp_path):
    parent = tmp_path / "w"
    proc = _stopped_quantize(tiny_linear_dir, parent / "out", tmp_path / "ready")
    staging = [p for p in parent.iterdir()]
    assert len(staging) == 1 and any(staging[0].iterdir())  # writing, not yet renamed
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and "Traceback" not in err, err
    assert list(parent.iterdir()) == []  # neither the destination nor the staging directory


def test_sigkill_mid_write_then_a_second_run(tiny_linear_dir, linear_mxfp4, tmp_path):
    parent = tmp_path / "w"
    proc = _stopped_quantize(tiny_linear_dir, parent / "out", tmp_path / "ready")
    proc.kill()
    proc.communicate(timeout=60)
    (stale,) = parent.iterdir()
    assert stale.name.startswith(".out.staging-") and not (parent / "out").exists()

    quantize(tiny_linear_dir, parent / "out", QuantizeOptions("mxfp4", "even"))
    assert [p.name for p in parent.iterdir()] == ["out"]  # the dead run's staging directory is gone
    _same_files(parent / "out", Path(linear_mxfp4["destination"]))  # and the output is complete


def test_disk_full_is_one_line_and_leaves_nothing(tiny_linear_dir, tmp_path, monkeypatch, capsys):
    from moeswap.formats import writer

    calls = []

    def full(f, tensor):
        calls.append(1)
        if len(calls) == 30:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return original(f, tensor)

    original = writer._write_bytes
    monkeypatch.setattr(writer, "_write_bytes", full)
    dst = tmp_path / "w" / "out"
    assert main(["quantize", str(tiny_linear_dir), str(dst), "--experts", "mxfp4"]) == 2
    err = capsys.readouterr().err
    assert err == (f"moeswap: error: no space left on device writing {dst / 'model-00001-of-00003.safetensors'}; "
                   f"free some space and run again (the partial output was removed)\n")
    assert list((tmp_path / "w").iterdir()) == []


def test_racing_writers_never_mix(tiny_linear_dir, tmp_path, monkeypatch):
    """While this quantize writes, another one finishes the same destination first: this one fails with a
    clear error and the winner's output is left as it was (a rename never merges directories)."""
    dst = tmp_path / "out"
    winner = quantize(tiny_linear_dir, tmp_path / "winner", QuantizeOptions("mxfp8"))
    calls = []

    def other_process_finishes(fmt, w, mode="even"):
        calls.append(1)
        if len(calls) == 10:
            os.rename(winner["destination"], dst)
        return original(fmt, w, mode)

    original = ct.encode_weight
    monkeypatch.setattr(ct, "encode_weight", other_process_finishes)
    with pytest.raises(FileExistsError, match=f"{dst} was created by another process while this one was writing"):
        quantize(tiny_linear_dir, dst, QuantizeOptions("mxfp4"))
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert load_config(dst).quant.format == "mxfp8-quantized"  # all of the winner's, nothing of the loser's


@pytest.mark.slow
def test_two_processes_racing(tiny_linear_dir, tmp_path):
    """Two real `moeswap quantize` to one destination: each ends with success or a one-line error, and the
    destination is one complete checkpoint."""
    dst = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "moeswap", "quantize", str(tiny_linear_dir), str(dst),
                               "--experts", fmt], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for fmt in ("mxfp4", "mxfp8")]
    results = [(p.wait(timeout=300), p.communicate()[1]) for p in procs]
    assert sorted(code for code, _ in results) == [0, 2], results
    err = next(e for code, e in results if code == 2)
    assert len(err.strip().splitlines()) == 1 and err.startswith("moeswap: error: ") and "Traceback" not in err
    assert ("was created by another process while this one was writing" in err
            or "exists and is not an empty directory" in err)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    fmt = json.loads((dst / REPORT_NAME).read_text())["format"]
    load_model(dst, LoadOptions(dtype="float32"))  # complete: every tensor there and consistent
    assert load_config(dst).quant.format == fmt


@pytest.mark.parametrize("where", ["dense", "expert"])
def test_non_finite_source_is_refused_naming_the_tensor(tiny_linear_dir, copy_model, tmp_path, capsys, where):
    src = copy_model(tiny_linear_dir)
    name = "model.layers.1.self_attn.q_proj.weight" if where == "dense" else EXPERT + ".weight"
    with Checkpoint.open(src) as ckpt:
        info = ckpt.info(name)
    with open(info.file, "r+b") as f:  # bf16 NaN, then bf16 -Inf, in the stored bytes
        f.seek(info.offset + 2 * 5)
        f.write(torch.tensor([float("nan"), float("-inf")], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes())
    dst = tmp_path / "w" / "out"
    assert main(["quantize", str(src), str(dst), "--experts", "mxfp4"]) == 2
    err = capsys.readouterr().err
    numel = info.nbytes // 2
    assert err == (f"moeswap: error: {src}: tensor {name!r} has 2 non-finite values (1 NaN, 1 infinite) of "
                   f"{numel:,}; the source checkpoint is damaged: re-download or re-convert it (nothing was "
                   f"written)\n")
    assert list((tmp_path / "w").iterdir()) == []


def test_non_finite_mx_source_is_refused(tiny_k3_dir, copy_model, tmp_path):
    """An MXFP4 source decodes to NaN where a scale byte is 0xFF: refused whether the experts are re-encoded
    (to MXFP8) or copied (to MXFP4)."""
    src = copy_model(tiny_k3_dir)
    module = "language_model.model.layers.2.block_sparse_moe.experts.5.w3"
    with Checkpoint.open(src) as ckpt:
        info = ckpt.info(module + ".weight_scale")
    with open(info.file, "r+b") as f:
        f.seek(info.offset + 3)
        f.write(b"\xff")
    for fmt in ("mxfp8", "mxfp4"):
        with pytest.raises(CheckpointError, match=rf"tensor '{module}' \(decoded from mxfp4\) has 32 non-finite "
                                                  rf"values \(32 NaN, 0 infinite\)"):
            quantize(src, tmp_path / fmt, QuantizeOptions(fmt))
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_experts_to_block_fp8_from_bf16_int4_and_block_fp8(tmp_path):
    """--experts fp8: a bf16 DeepSeek-V3 gets block-FP8 experts that are fp8_block.encode of its weights, DeepSeek's
    quantization_config, and loads as FP8 experts kept in their bytes whose logits stay near the source's;
    an INT4 source converts from its decoded values; a block-FP8 source is copied byte for byte, its block-FP8
    dense weights too."""
    from moeswap.ops.expert import FP8ExpertWeights
    from moeswap.tiny import write_tiny_model

    src = write_tiny_model(tmp_path / "bf16", "deepseek_v3", "tiny", seed=0)
    report = quantize(src, tmp_path / "fp8", QuantizeOptions("fp8"))
    assert report["format"] == "fp8 block 128x128" and report["summary"]["copied"] == 0
    assert 0 < report["summary"]["max_rel_error"] < 0.05 and not report["dequantized_to_bf16"]
    cfg = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "fp8" and cfg["weight_block_size"] == [128, 128]
    name = "model.layers.1.mlp.experts.2.down_proj"
    with Checkpoint.open(src) as a, Checkpoint.open(tmp_path / "fp8") as b:
        q, s = fp8_block.encode(a.read(name + ".weight"))
        assert torch.equal(bits(b.read(name + ".weight")), bits(q)) and torch.equal(b.read(name + ".weight_scale_inv"), s)
        dense = "model.layers.1.self_attn.q_a_proj.weight"
        assert torch.equal(bits(b.read(dense)), bits(a.read(dense)))  # non-expert weights as they were
    # the experts computed from their bytes give the logits of the same experts decoded (the weights' error
    # itself is the report's; a random tiny model's routing magnifies it in the logits)
    logits = []
    for decoded in (False, True):
        model, store = load_model(tmp_path / "fp8", LoadOptions(dtype="float32", decoded_experts=decoded))
        assert isinstance(store.fetch(1, [2])[0], FP8ExpertWeights) != decoded
        with torch.no_grad():
            logits.append(model(torch.arange(10).unsqueeze(0)))
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5 * logits[1].abs().max().item())

    int4_src = write_tiny_model(tmp_path / "int4", "deepseek_v3", "tiny", seed=0, quant="int4")
    report = quantize(int4_src, tmp_path / "int4-fp8", QuantizeOptions("fp8"))
    assert {r["source"] for r in report["tensors"]} == {"int4"} and report["summary"]["encoded"] > 0
    with Checkpoint.open(int4_src) as a, Checkpoint.open(tmp_path / "int4-fp8") as b:
        w = ct.decode_weight("int4", {k: a.read(f"{name}.{k}") for k in ct.stored_names("int4")}, torch.float32)
        assert torch.equal(bits(b.read(name + ".weight")), bits(fp8_block.encode(w)[0]))

    fp8_src = write_tiny_model(tmp_path / "ds-fp8", "deepseek_v3", "tiny", seed=0, quant="fp8")
    report = quantize(fp8_src, tmp_path / "copy", QuantizeOptions("fp8"))
    assert report["summary"]["encoded"] == 0 and not report["dequantized_to_bf16"]
    with Checkpoint.open(fp8_src) as a, Checkpoint.open(tmp_path / "copy") as b:
        assert sorted(a.names()) == sorted(b.names())
        assert all(torch.equal(bits(a.read(n)), bits(b.read(n))) for n in a.names())


def test_the_output_gets_a_card_of_its_own(tiny_linear_dir, copy_model, tmp_path):
    """The source's README.md describes the source: DST gets a card of its own (source, date, formats, the
    report's counts and errors), keeping only the source card's license lines; a source without a card gets
    one without front matter."""
    import datetime

    import yaml

    src = copy_model(tiny_linear_dir)
    (src / "README.md").write_text("---\nlicense: apache-2.0\ntags: [moe]\n---\n# The tiny source\n\nAbout it.\n")
    before = datetime.datetime.now(datetime.timezone.utc).date()
    report = quantize(src, tmp_path / "q", QuantizeOptions("mxfp4", "even", dense="int8"))
    after = datetime.datetime.now(datetime.timezone.utc).date()
    card = (tmp_path / "q" / "README.md").read_text()
    assert "The tiny source" not in card and "About it" not in card
    assert yaml.safe_load(card.split("---\n")[1]) == {"license": "apache-2.0"}
    assert any(f"on {d.isoformat()} (UTC)" in card for d in {before, after})
    s, d = report["summary"], report["dense"]["summary"]
    assert f"Source model: `{src}`" in card
    assert f"Routed experts: {report['format']}, {s['encoded']} of {s['expert_weights']} weight tensors" in card
    assert f"largest {s['max_rel_error']:.3g}" in card and s["encoded"] > 0
    assert f"Dense weights: {report['dense']['format']}, {d['encoded']} tensors encoded" in card and d["encoded"] > 0
    plain = quantize(tiny_linear_dir, tmp_path / "p", QuantizeOptions("mxfp4", "even"))
    card = (tmp_path / "p" / "README.md").read_text()
    assert not card.startswith("---") and "Dense weights" not in card and plain["summary"]["encoded"] > 0
