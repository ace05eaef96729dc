"""A base model's fingerprint: enough to tell that an adapter (or a training run) was made for this base.

Hashes config.json's bytes, the tensor table (names, dtypes, shapes: not the shard layout, so a re-sharded
copy of the same weights matches) and a few sampled tensors, chosen by position in the sorted table and
read only at their first and last SAMPLE_BYTES. Deterministic, small, reads a few hundred KiB at most.
Entry points: `fingerprint(model_dir) -> dict` and `check_same_base(recorded, model_dir, what)`.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from moeswap import jsonio
from moeswap.formats.checkpoint import Checkpoint, pread_into
from moeswap.formats.files import confined

VERSION = 1
SAMPLES = 4  # tensors hashed
SAMPLE_BYTES = 64 << 10  # from each end of a sampled tensor


def fingerprint(model_dir: str | os.PathLike) -> dict:
    """{"version", "digest", "config_sha256", "tensors_sha256", "tensor_count", "samples": {name: sha256}};
    `digest` covers all of it (two bases are the same when their digests are)."""
    root = Path(model_dir)
    config = confined(root, "config.json", ValueError, str(root))
    if not config.is_file():
        raise FileNotFoundError(f"{config}: missing; a model directory needs its config.json")
    with Checkpoint.open(root) as ckpt:
        names = ckpt.names()
        table = [[n, str(ckpt.info(n).dtype).removeprefix("torch."), list(ckpt.info(n).shape)] for n in names]
        picks = sorted({round(i * (len(names) - 1) / (SAMPLES - 1)) for i in range(SAMPLES)}) if names else []
        samples = {names[i]: _sample_hash(ckpt, names[i]) for i in picks}
    result = {
        "version": VERSION,
        "config_sha256": hashlib.sha256(config.read_bytes()).hexdigest(),
        "tensors_sha256": hashlib.sha256(jsonio.dumps(table, separators=(",", ":")).encode()).hexdigest(),
        "tensor_count": len(names),
        "samples": samples,
    }
    result["digest"] = hashlib.sha256(jsonio.dumps(result, sort_keys=True).encode()).hexdigest()
    return result


def check_same_base(recorded: object, model_dir: str | os.PathLike, what: str) -> None:
    """ValueError unless `recorded` (a fingerprint saved with `what`) is the fingerprint of `model_dir`."""
    if not isinstance(recorded, dict) or not isinstance(recorded.get("digest"), str):
        raise ValueError(f"{what}: its base fingerprint is malformed (expected an object with a digest)")
    if recorded.get("version") != VERSION:
        raise ValueError(f"{what}: base fingerprint version {recorded.get('version')!r}; this moeswap writes {VERSION}")
    here = fingerprint(model_dir)
    if here["digest"] == recorded["digest"]:
        return
    differs = [label for key, label in (("config_sha256", "config.json"), ("tensors_sha256", "tensor names/shapes"),
                                         ("samples", "sampled tensor bytes")) if here.get(key) != recorded.get(key)]
    raise ValueError(f"{what} was made for a different base model than {model_dir} "
                     f"({', '.join(differs) or 'fingerprint'} differ)")


def _sample_hash(ckpt: Checkpoint, name: str) -> str:
    info = ckpt.info(name)
    h = hashlib.sha256(f"{info.nbytes}:".encode())
    spans = [(0, info.nbytes)] if info.nbytes <= 2 * SAMPLE_BYTES else \
        [(0, SAMPLE_BYTES), (info.nbytes - SAMPLE_BYTES, SAMPLE_BYTES)]
    fd = os.open(info.file, os.O_RDONLY)
    try:
        for start, length in spans:
            buf = bytearray(length)
            if pread_into(fd, memoryview(buf), info.offset + start) < length:
                raise ValueError(f"{info.file}: ends inside tensor {name}")
            h.update(buf)
    finally:
        os.close(fd)
    return h.hexdigest()
