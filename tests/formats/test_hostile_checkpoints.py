"""A checkpoint is data: shard paths that leave the model directory (relative, absolute, through a symlink)
are refused before any file is touched, with a message that says nothing of what lies there; hostile
headers, index files and expert bytes give one-line errors that say what was expected. Through the CLI each
is `moeswap: error: ...` and exit code 2."""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeswap.cli import main
from moeswap.config import ConfigError, load_config
from moeswap.formats import mxfp4
from moeswap.formats.checkpoint import INDEX_NAME, Checkpoint, CheckpointError
from moeswap.models.loader import load_model
from open_spy import opened_paths

SECRET = b"secret-token-4242 (not a checkpoint)\n"  # what must never appear in an error


@pytest.fixture
def opened() -> list[Path]:
    """Every path opened through open / io.open / os.open while the test runs, resolved."""
    with opened_paths() as seen:
        yield seen


def tensors_a() -> dict[str, torch.Tensor]:
    return {"a.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3)}


def tensors_b() -> dict[str, torch.Tensor]:
    return {"b.weight": torch.ones(4, dtype=torch.bfloat16)}


@pytest.fixture
def layout(tmp_path) -> tuple[Path, Path]:
    """(model, outside): a sharded checkpoint, and beside it a directory holding a valid shard with the
    same tensor names (so reading it would succeed: a refusal can only come from its path) and a secret."""
    model, outside = tmp_path / "model", tmp_path / "outside"
    model.mkdir()
    outside.mkdir()
    save_file(tensors_a(), model / "model-00001-of-00002.safetensors")
    save_file(tensors_b(), model / "model-00002-of-00002.safetensors")
    write_index(model, {"a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors"})
    save_file(tensors_b(), outside / "secret.safetensors")
    (outside / "passwd").write_bytes(SECRET)
    return model, outside


def write_index(model: Path, weight_map: dict) -> None:
    (model / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def refused(model: Path, outside: Path, opened: list[Path], *fragments: str) -> str:
    opened.clear()  # what the test itself wrote is not the reader's doing
    with pytest.raises(CheckpointError) as caught:
        Checkpoint.open(model)
    message = str(caught.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    # neither the outside file's text nor its size (the test's own temporary paths may hold any digits)
    scrubbed = message.replace(str(model.parent), "")
    assert SECRET.decode().strip() not in scrubbed and not re.search(rf"(?<!\d){len(SECRET)}(?!\d)", scrubbed)
    assert not [p for p in opened if p.is_relative_to(outside.resolve())], "a file outside the model was opened"
    return message


# -- traversal ------------------------------------------------------------------------------------


@pytest.mark.parametrize("shard, reason", [
    ("../outside/secret.safetensors", "a path with a '..' part"),
    ("./../outside/secret.safetensors", "a path with a '..' part"),
    ("sub/../../outside/secret.safetensors", "a path with a '..' part"),
    ("sub/../model-00002-of-00002.safetensors", "a path with a '..' part"),  # stays inside, still refused
    ("model-00002-of-00002.safetensors\x00", "a name with control characters"),
    ("", "not a file name"),
])
def test_relative_traversal_is_refused(layout, opened, shard, reason):
    model, outside = layout
    write_index(model, {"a.weight": "model-00001-of-00002.safetensors", "b.weight": shard})
    refused(model, outside, opened, str(model / INDEX_NAME), "weight_map entry 'b.weight'", reason,
            "moeswap reads only files inside")


@pytest.mark.parametrize("target", ["valid shard", "secret", "missing", "os interface"])
def test_absolute_paths_are_refused_whatever_is_there(layout, opened, target):
    model, outside = layout
    shard = {"valid shard": str(model / "model-00002-of-00002.safetensors"),  # even one inside the model
             "secret": str(outside / "passwd"), "missing": str(outside / "nothing-here"),
             "os interface": "/proc/self/environ"}[target]
    write_index(model, {"a.weight": "model-00001-of-00002.safetensors", "b.weight": shard})
    message = refused(model, outside, opened, "weight_map entry 'b.weight'", "is an absolute path")
    assert message.replace(repr(shard), "PATH") == (
        f"{model / INDEX_NAME}: weight_map entry 'b.weight': PATH is an absolute path; moeswap reads only "
        f"files inside {model}")


@pytest.mark.parametrize("how", ["shard link", "directory link", "absolute link", "dangling link"])
def test_symlinks_that_resolve_outside_are_refused(layout, opened, how):
    model, outside = layout
    shard = "model-00002-of-00002.safetensors"
    (model / shard).unlink()
    if how == "shard link":
        (model / shard).symlink_to(Path("..") / "outside" / "secret.safetensors")
    elif how == "directory link":
        (model / "sub").symlink_to(outside, target_is_directory=True)
        shard = "sub/secret.safetensors"
    elif how == "absolute link":
        (model / shard).symlink_to(outside / "passwd")
    else:
        (model / shard).symlink_to(outside / "nothing-here")
    write_index(model, {"a.weight": "model-00001-of-00002.safetensors", "b.weight": shard})
    refused(model, outside, opened, "weight_map entry 'b.weight'", repr(shard),
            "is a link that resolves outside its directory")


def test_the_refusal_is_the_same_whether_the_target_exists_or_not(layout, opened):
    model, outside = layout
    messages = []
    for target in (outside / "passwd", outside / "nothing-here"):
        link = model / "model-00002-of-00002.safetensors"
        link.unlink(missing_ok=True)
        link.symlink_to(target)
        messages.append(refused(model, outside, opened))
    assert messages[0] == messages[1]


def test_single_shard_directory_link_outside_is_refused(tmp_path, opened):
    model, outside = tmp_path / "model", tmp_path / "outside"
    model.mkdir()
    outside.mkdir()
    save_file(tensors_a(), outside / "secret.safetensors")
    (model / "model.safetensors").symlink_to(outside / "secret.safetensors")
    refused(model, outside, opened, "'model.safetensors' is a link that resolves outside its directory")


def test_symlinks_inside_the_model_directory_are_followed(layout, opened):
    model, _ = layout
    (model / "alias.safetensors").symlink_to("model-00002-of-00002.safetensors")
    (model / "sub").mkdir()
    save_file(tensors_a(), model / "sub" / "a.safetensors")
    write_index(model, {"a.weight": "sub/a.safetensors", "b.weight": "alias.safetensors"})
    with Checkpoint.open(model) as ckpt:
        assert torch.equal(ckpt.read("a.weight"), tensors_a()["a.weight"])
        assert torch.equal(ckpt.read("b.weight"), tensors_b()["b.weight"])


def hf_cache_snapshot(root: Path, repo: str) -> Path:
    """The Hugging Face hub cache layout: snapshots/<rev>/<file> are links to ../../blobs/<hash>."""
    blobs, snapshot = root / repo / "blobs", root / repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, tensors in enumerate((tensors_a(), tensors_b())):
        save_file(tensors, blobs / f"blob{i}")
        (snapshot / f"model-0000{i + 1}-of-00002.safetensors").symlink_to(Path("../../blobs") / f"blob{i}")
    write_index(snapshot, {"a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors"})
    return snapshot


def test_hugging_face_cache_snapshots_may_link_into_their_own_blobs(tmp_path, opened):
    snapshot = hf_cache_snapshot(tmp_path, "models--org--name")
    with Checkpoint.open(snapshot) as ckpt:
        assert torch.equal(ckpt.read("b.weight"), tensors_b()["b.weight"])


def test_hugging_face_cache_snapshots_may_not_link_into_another_repository(tmp_path, opened):
    snapshot = hf_cache_snapshot(tmp_path, "models--org--name")
    other = hf_cache_snapshot(tmp_path, "models--someone--else")
    link = snapshot / "model-00002-of-00002.safetensors"
    link.unlink()
    link.symlink_to(Path("../../../models--someone--else/blobs/blob1"))
    refused(snapshot, other.parent.parent, opened, "is a link that resolves outside its directory")


def test_a_file_that_is_not_safetensors_is_described_by_what_was_expected(layout, opened):
    """The index may name any file inside the model; if it is not a checkpoint, the error must not echo
    its content (its first 8 bytes used to appear as a header length)."""
    model, _ = layout
    (model / "notes.txt").write_bytes(SECRET * 3)
    write_index(model, {"a.weight": "model-00001-of-00002.safetensors", "b.weight": "notes.txt"})
    with pytest.raises(CheckpointError) as caught:
        Checkpoint.open(model)
    message = str(caught.value)
    assert "truncated or not safetensors" in message and "header length of at most" in message
    assert str(int.from_bytes(SECRET[:8], "little")) not in message and "secret" not in message


def test_config_json_linked_from_outside_is_refused_without_reading_its_keys(tmp_path, opened):
    model, outside = tmp_path / "model", tmp_path / "outside"
    model.mkdir()
    outside.mkdir()
    (outside / "settings.json").write_text(json.dumps({"private_key_name": 1}))
    (model / "config.json").symlink_to(outside / "settings.json")
    opened.clear()
    with pytest.raises(ConfigError, match="config.json' is a link that resolves outside its directory") as caught:
        load_config(model)
    assert "private_key_name" not in str(caught.value)
    assert not [p for p in opened if p.is_relative_to(outside.resolve())]


@pytest.mark.parametrize("how", ["relative", "absolute", "symlink"])
def test_traversal_through_the_cli_is_one_line_and_exit_code_2(tiny_k3_dir, copy_model, tmp_path, capsys, opened, how):
    model = copy_model(tiny_k3_dir)
    outside = tmp_path / "outside"
    outside.mkdir()
    index = json.loads((model / INDEX_NAME).read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (model / victim).rename(outside / victim)  # a complete, valid shard: only its path can stop it
    entry = {"relative": f"../outside/{victim}", "absolute": str(outside / victim), "symlink": victim}[how]
    if how == "symlink":
        (model / victim).symlink_to(outside / victim)
    index["weight_map"] = {k: entry if v == victim else v for k, v in index["weight_map"].items()}
    (model / INDEX_NAME).write_text(json.dumps(index))
    for argv in (["inspect", str(model)], ["generate", str(model), "--prompt", "hi", "--max-tokens", "1"]):
        assert main(argv) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and err.startswith(f"moeswap: error: {model / INDEX_NAME}: weight_map entry")
    with pytest.raises(CheckpointError):
        load_model(model)
    assert not [p for p in opened if p.is_relative_to(outside.resolve())]


# -- headers and index files ----------------------------------------------------------------------


def write_raw(path: Path, header: object, data: bytes = b"", raw: bytes | None = None) -> Path:
    encoded = raw if raw is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)
    return path


def header_error(path: Path, *fragments: str) -> str:
    with pytest.raises(CheckpointError) as caught:
        Checkpoint.open(path)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(str(path))
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


def test_overlapping_byte_ranges(tmp_path):
    header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
              "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}
    path = write_raw(tmp_path / "x.safetensors", header, b"\0" * 12)
    header_error(path, "tensors 'a' and 'b' claim overlapping data_offsets")
    # empty tensors own no bytes, so they may sit anywhere in range
    header["b"] = {"dtype": "F32", "shape": [0, 3], "data_offsets": [4, 4]}
    assert Checkpoint.open(write_raw(path, header, b"\0" * 12)).info("b").nbytes == 0


@pytest.mark.parametrize("entry, fragment", [
    ({"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}, "unknown dtype ['F32']"),
    ({"dtype": {"F32": 1}, "shape": [1], "data_offsets": [0, 4]}, "unknown dtype"),
    ({"dtype": "F32", "shape": [2**62, 2**62], "data_offsets": [0, 4]}, f"needs {2**126} bytes"),
    ({"dtype": "F32", "shape": [2**63, 0], "data_offsets": [0, 0]}, "below 2^63"),
    ({"dtype": "F32", "shape": [1] * 65, "data_offsets": [0, 4]}, "at most 64"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}, "data_offsets as [begin, end]"),
    ({"dtype": "F32", "shape": [1.0], "data_offsets": [0, 4]}, "non-negative ints"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [0, 4.0]}, "data_offsets as [begin, end]"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [2**70, 2**70 + 4]}, "file truncated"),
])
def test_hostile_entries(tmp_path, entry, fragment):
    header_error(write_raw(tmp_path / "x.safetensors", {"w": entry}, b"\0" * 4), "'w'", fragment)


def test_tensor_name_with_control_characters(tmp_path):
    path = write_raw(tmp_path / "x.safetensors", {"w\nx": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, b"\0")
    header_error(path, "'w\\nx'", "without control characters")


@pytest.mark.parametrize("raw, fragment", [
    (b"[" * 100_000 + b"]" * 100_000, "nesting too deep"),
    (b'{"w": 1' + b"7" * 5000 + b"}", "expected JSON"),
    (b'{"w": "\xff\xfe"}', "not UTF-8 (at header offset 7)"),
])
def test_header_json_that_is_hostile(tmp_path, raw, fragment):
    message = header_error(write_raw(tmp_path / "x.safetensors", None, raw=raw), "corrupt safetensors header", fragment)
    assert "0xff" not in message and "255" not in message


def test_header_length_of_all_ones(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"\xff" * 64)
    message = header_error(path, "expected its first 8 bytes to give a JSON header length of at most 56 bytes")
    assert str(2**64 - 1) not in message


@pytest.mark.parametrize("content, fragment", [
    (b"[" * 100_000, "nested too deeply"),
    (b'{"weight_map": {"a": "\xc3"}}', "not UTF-8 text: invalid byte at offset 22"),
    (b'{"weight_map": {"a": ' + b"1" * 5000 + b"}}", "not valid JSON (Exceeds the limit"),
    (b'{"weight_map": {"a\\nb": "x.safetensors"}}', "'a\\nb' -> 'x.safetensors'"),
])
def test_index_files_that_are_hostile(tmp_path, content, fragment):
    (tmp_path / INDEX_NAME).write_bytes(content)
    header_error(tmp_path, INDEX_NAME, fragment)


def test_index_that_is_a_directory(tmp_path):
    (tmp_path / INDEX_NAME).mkdir()
    header_error(tmp_path, f"{INDEX_NAME}: expected a JSON file, found a directory")


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_shard_that_is_not_a_regular_file_is_never_opened(tmp_path, opened, kind):
    shard = tmp_path / "model-00001-of-00001.safetensors"
    os.mkfifo(shard) if kind == "fifo" else shard.mkdir()  # a FIFO would block the reader forever
    write_index(tmp_path, {"a.weight": shard.name})
    header_error(tmp_path, "which is a directory or special file")
    assert shard.resolve() not in opened


def test_single_shard_that_is_a_fifo_is_never_opened(tmp_path, opened):
    os.mkfifo(tmp_path / "model.safetensors")
    header_error(tmp_path / "model.safetensors", "expected a .safetensors file or a checkpoint directory")
    header_error(tmp_path, "expected a safetensors file, found a directory or special file")
    assert (tmp_path / "model.safetensors").resolve() not in opened


# -- expert bytes ---------------------------------------------------------------------------------


def set_bytes(info, offset: int, value: bytes) -> None:
    with open(info.file, "r+b") as f:
        f.seek(info.offset + offset)
        f.write(value)


@pytest.mark.parametrize("byte", [0xFD, 0xFE, 0xFF])
def test_mxfp4_scale_bytes_that_decode_to_inf_or_nan_name_the_tensor(tiny_k3_dir, copy_model, byte):
    model_dir = copy_model(tiny_k3_dir)
    _, store = load_model(model_dir)
    name = store.index.names(2, 5)["w2"]["weight_scale"]
    info = store.ckpt.info(name)
    row, block = 3, 1
    assert info.shape[1] > block
    set_bytes(info, row * info.shape[1] + block, bytes([byte]))
    with pytest.raises(CheckpointError) as caught:
        store.fetch(2, [5])[0]
    message = str(caught.value)
    assert message.startswith(f"{name} in {info.file} (layer 2 expert 5 w2): ")
    assert "first at row 3 block 1" in message and "expected E8M0 bytes of at most 252" in message
    assert ("NaN scale bytes" if byte == 0xFF else "decode to ±Inf") in message
    assert "\n" not in message


def test_the_largest_accepted_scale_byte_decodes_to_finite_weights(tiny_k3_dir, copy_model):
    model_dir = copy_model(tiny_k3_dir)
    _, store = load_model(model_dir)
    info = store.ckpt.info(store.index.names(1, 0)["w1"]["weight_scale"])
    set_bytes(info, 0, bytes([mxfp4.MAX_SCALE_BYTE]))
    set_bytes(store.ckpt.info(store.index.names(1, 0)["w1"]["weight_packed"]), 0, b"\x77" * 16)  # all ±6: the largest
    w = store.fetch(1, [0])[0]
    decoded = mxfp4.decode(w.w1_packed, w.w1_scale, torch.float32)
    assert decoded[0, 0] == 6 * 2.0 ** (mxfp4.MAX_SCALE_BYTE - 127) and torch.isfinite(decoded).all()
    one_more = mxfp4.decode(w.w1_packed[:1, :16], torch.tensor([[mxfp4.MAX_SCALE_BYTE + 1]], dtype=torch.uint8))
    assert torch.isinf(one_more.float()).all()  # why the bound is where it is


def test_non_finite_float_expert_names_the_tensor(tiny_linear_dir, copy_model):
    model_dir = copy_model(tiny_linear_dir)
    _, store = load_model(model_dir)
    name = store.index.names(1, 3)["w2"]["weight"]
    info = store.ckpt.info(name)
    assert info.dtype == torch.bfloat16
    set_bytes(info, 2 * (info.shape[1] + 2), torch.tensor([float("inf")], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes())
    with pytest.raises(CheckpointError) as caught:
        store.fetch(1, [3])[0]
    assert str(caught.value).startswith(f"{name} in {info.file} (layer 1 expert 3 w2): holds non-finite weights "
                                        f"(NaN or Inf), first at [1, 2]")


def test_unchanged_checkpoint_reads_the_same_after_the_checks(tiny_k3_dir):
    """The checks refuse bad bytes only: every expert of the tiny model still reads as stored."""
    _, store = load_model(tiny_k3_dir)
    names = store.index.names(3, 7)
    w = store.fetch(3, [7])[0]
    for proj in ("w1", "w2", "w3"):
        stored = load_file(store.ckpt.info(names[proj]["weight_scale"]).file)
        assert torch.equal(getattr(w, f"{proj}_scale"), stored[names[proj]["weight_scale"]])


def test_inspect_verify_reads_nothing_through_links_outside(tiny_k3_dir, copy_model, tmp_path, opened):
    """verify hashes every file of the model directory and reads its checksum lists: a link to a file
    outside is neither hashed nor read (a list's parse error would quote the file's first line)."""
    from moeswap.verify import verify

    model, outside = copy_model(tiny_k3_dir), tmp_path / "outside"
    outside.mkdir()
    (outside / "passwd").write_bytes(SECRET)
    (model / "notes.txt").symlink_to(outside / "passwd")
    (model / "SHA256SUMS").symlink_to(outside / "passwd")
    (model / "sub").symlink_to(outside, target_is_directory=True)
    (model / "manifest.json").write_text(json.dumps({"files": [{"path": "sub/passwd", "sha256": "b" * 64}]}))
    opened.clear()
    report = verify(model)
    assert not [p for p in opened if p.is_relative_to(outside.resolve())]
    assert "notes.txt" not in {f["name"] for f in report["files"]} and "secret" not in json.dumps(report)
    assert [(e["name"], e["problem"]) for e in report["listed"]] == [("sub/passwd", "not a path inside the model directory")]


@pytest.mark.parametrize("what", ["config.json", "tokenizer.json", "a directory"])
def test_quantize_copies_nothing_from_outside_the_source(tiny_k3_dir, copy_model, tmp_path, opened, capsys, what):
    """quantize reads the source's config.json and copies its side files into the output: a link to a
    file outside is refused before any work, so no other file's bytes reach the new checkpoint."""
    model, outside = copy_model(tiny_k3_dir), tmp_path / "outside"
    outside.mkdir()
    (outside / "passwd").write_bytes(SECRET)
    name = {"config.json": "config.json", "tokenizer.json": "tokenizer.json", "a directory": "extras"}[what]
    if (model / name).exists():
        (model / name).unlink()
    (model / name).symlink_to(outside if what == "a directory" else outside / "passwd")
    opened.clear()
    assert main(["quantize", str(model), str(tmp_path / "out"), "--experts", "mxfp8"]) == 2
    err = capsys.readouterr().err
    assert err == (f"moeswap: error: {model}: {name!r} is a link that resolves outside its directory; "
                   f"moeswap reads only files inside {model}\n")
    assert not (tmp_path / "out").exists()
    assert not [p for p in opened if p.is_relative_to(outside.resolve())]


def test_quantize_config_json_that_is_a_directory_or_deep(tiny_k3_dir, copy_model, tmp_path, capsys):
    model = copy_model(tiny_k3_dir)
    (model / "config.json").write_bytes(b"[" * 100_000)
    assert main(["quantize", str(model), str(tmp_path / "out"), "--experts", "mxfp8"]) == 2
    assert capsys.readouterr().err == (f"moeswap: error: {model / 'config.json'}: not valid JSON for a model file "
                                       f"(nested too deeply to parse)\n")
    (model / "config.json").unlink()
    (model / "config.json").mkdir()
    assert main(["quantize", str(model), str(tmp_path / "out"), "--experts", "mxfp8"]) == 2
    assert capsys.readouterr().err.endswith("config.json: expected a JSON file, found a directory\n")
