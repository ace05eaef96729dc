"""`moeswap inspect --verify MODEL`: reads a checkpoint's every byte and reports what no trained model
holds: non-finite values in any tensor (each routed expert and quantised weight decoded through its
codec, float tensors checked in chunks: memory stays about one expert), MX scale bytes outside
2^-40..2^40 or the NaN code, and each file's SHA-256 compared with the checksum lists beside the
checkpoint (`*.sha256` and `SHA256SUMS` in sha256sum's format, or `manifest.json`).
Entry points: `verify(model_dir, progress) -> dict`, `format_verify(dict) -> str`, `read_checksums`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import torch

from moeswap.config import load_config
from moeswap.formats import compressed_tensors as ct
from moeswap.formats.checkpoint import Checkpoint, CheckpointError, TensorInfo, pread_into
from moeswap.formats.files import escape_reason
from moeswap.weights.stored import Declared, group_modules, storage_of

# A block's E8M0 scale is 2^(floor(log2 amax) - emax), emax 2 for FP4 and 8 for E4M3 elements. Trained
# weights have block maxima of about 2^-20 to 2^10, so their scales lie within 2^-28..2^8; the window
# below leaves 2^12 and more on each side and still catches a flip of either top bit of a typical byte
# (0x78 = 2^-7 becomes 0xF8 = 2^121 or 0x38 = 2^-71). Byte 0 is allowed on an all-zero block: that is
# how compressed-tensors (and mx.block_exponents) store one. 0xFF is E8M0's NaN.
SCALE_RANGE = (127 - 40, 127 + 40)  # allowed scale bytes, inclusive: 2^-40 .. 2^40
CHUNK_BYTES = 64 << 20  # float tensors are checked this many bytes at a time
HASH_CHUNK = 8 << 20
CHECKSUM_NAMES = ("SHA256SUMS", "sha256sums.txt", "manifest.json")  # and any *.sha256
_SUM_LINE = re.compile(r"\\?([0-9a-fA-F]{64}) [ *](.+)")  # sha256sum: "<hex>  <name>" ("\" escapes the name)
_BSD_LINE = re.compile(r"\\?SHA256 \((.+)\) = ([0-9a-fA-F]{64})")  # sha256sum --tag / BSD
_HEX = re.compile(r"(?:sha256:)?([0-9a-fA-F]{64})")


def verify(model_dir: str | os.PathLike, progress: bool = False) -> dict:
    """Everything `inspect --verify` reports; `ok` is False when any problem was found."""
    from tqdm import tqdm

    root = Path(model_dir)
    load_config(root)  # fails as every command does on a bad config.json
    raw = json.loads((root / "config.json").read_text(encoding="utf-8"))
    declared = Declared.from_config(raw, str(root / "config.json"))
    expected, lists = read_checksums(root)
    listed_problems = []
    for name, wants in sorted(expected.items()):
        if not _inside(root, name):
            listed_problems += [{"name": name, "listed_in": src, "problem": "not a path inside the model directory"}
                                for _, src in wants]
        elif not (root / name).is_file():
            listed_problems += [{"name": name, "listed_in": src, "problem": "missing"} for _, src in wants]
    report: dict = {"path": str(root), "checksum_lists": lists, "files": [], "listed": listed_problems,
                    "nonfinite": [], "bad_scales": [], "errors": [], "tensors": 0, "modules_decoded": 0,
                    "scale_range": [f"2^{SCALE_RANGE[0] - 127}", f"2^{SCALE_RANGE[1] - 127}"]}
    with Checkpoint.open(root) as ckpt:
        files = _files_to_hash(root, ckpt, expected, {entry["file"] for entry in lists})
        modules, others = group_modules(ckpt.names())
        work: dict[Path, list[tuple[str, object]]] = {}  # file -> (kind, what) to decode after hashing it
        for module, tensors in modules.items():
            work.setdefault(ckpt.info(min(tensors.values(), key=lambda n: ckpt.info(n).offset)).file, []).append(
                ("module", (module, tensors)))
        for name in others:
            work.setdefault(ckpt.info(name).file, []).append(("tensor", name))
        total = sum(f.stat().st_size for f in files) + ckpt.total_bytes
        fds: dict[Path, int] = {}
        with tqdm(total=total, unit="B", unit_scale=True, desc="verify", disable=not progress) as bar:
            try:
                for file in files + sorted(set(work) - set(files)):
                    if file in files:  # hashed first: its tensors are then read from the page cache
                        report["files"].append(_check_file(root, file, expected, bar.update))
                    for kind, what in work.get(file, ()):
                        if kind == "module":
                            _check_module(ckpt, declared, *what, report, fds, bar.update)
                        else:
                            _check_tensor(ckpt, ckpt.info(what), report, fds, bar.update)
            finally:
                for fd in fds.values():
                    os.close(fd)
        report["tensors"] = len(ckpt)
    report["problems"] = _problem_counts(report)
    report["ok"] = not any(report["problems"].values())
    return report


# -- tensors --------------------------------------------------------------------------------------


def _check_module(ckpt: Checkpoint, declared: Declared, module: str, tensors: dict[str, str], report: dict,
                  fds: dict, advance: Callable[[int], object]) -> None:
    infos = {suffix: ckpt.info(name) for suffix, name in tensors.items()}
    try:
        weight = storage_of(ckpt, module, tensors, declared)
        if weight.kind == "float":
            _check_tensor(ckpt, infos["weight"], report, fds, advance)
            report["modules_decoded"] += 1
            return
        if weight.kind in ("mxfp4", "mxfp8"):
            stored = {suffix: ckpt.read(name) for suffix, name in tensors.items()}
            decoded = ct.decode_weight(weight.kind, stored, torch.float32)
            _check_scales(stored["weight_scale"], decoded, infos["weight_scale"], report)
        else:
            decoded = weight.read_float(ckpt, torch.float32, declared)
    except ValueError as err:  # CheckpointError included: a module no reader can decode
        report["errors"].append({"module": module, "file": infos[next(iter(infos))].file.name, "error": str(err)})
        advance(sum(i.nbytes for i in infos.values()))
        return
    report["modules_decoded"] += 1
    _record_nonfinite(report, f"{module} ({weight.kind}, decoded)", infos[next(iter(infos))].file,
                      *_nonfinite(decoded), decoded.numel())
    advance(sum(i.nbytes for i in infos.values()))


def _check_tensor(ckpt: Checkpoint, info: TensorInfo, report: dict, fds: dict,
                  advance: Callable[[int], object]) -> None:
    """A stored tensor as it is (float: checked chunk by chunk; other dtypes hold no non-finite values)."""
    if not info.dtype.is_floating_point:
        advance(info.nbytes)
        return
    if info.file not in fds:
        fds[info.file] = os.open(info.file, os.O_RDONLY)
    step = CHUNK_BYTES // info.dtype.itemsize * info.dtype.itemsize
    nan = inf = 0
    for start in range(0, info.nbytes, step):
        buf = torch.empty(min(step, info.nbytes - start), dtype=torch.uint8)
        if pread_into(fds[info.file], memoryview(buf.numpy()), info.offset + start) < len(buf):
            raise CheckpointError(f"{info.file}: tensor {info.name!r}: file shrank while being verified")
        n, i = _nonfinite(buf.view(info.dtype))
        nan, inf = nan + n, inf + i
        advance(len(buf))
    _record_nonfinite(report, info.name, info.file, nan, inf, info.nbytes // info.dtype.itemsize)


def _nonfinite(t: torch.Tensor) -> tuple[int, int]:
    """(NaN count, infinity count)."""
    values = t.float() if t.element_size() == 1 else t  # torch has no isnan/isinf for 8-bit floats
    return int(torch.isnan(values).sum()), int(torch.isinf(values).sum())


def _record_nonfinite(report: dict, what: str, file: Path, nan: int, inf: int, numel: int) -> None:
    if nan or inf:
        report["nonfinite"].append({"tensor": what, "file": file.name, "nan": nan, "inf": inf, "values": numel})


def _check_scales(scale: torch.Tensor, decoded: torch.Tensor, info: TensorInfo, report: dict) -> None:
    s = scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale
    low, high = SCALE_RANGE
    outside = (s < low) | (s > high)
    zero_block = decoded.reshape(*s.shape, -1).abs().amax(dim=-1) == 0  # NaN blocks compare False
    bad = outside & ~((s == 0) & zero_block)
    count = int(bad.sum())
    if count:
        at = [int(i) for i in bad.nonzero()[0]]
        byte = int(s[tuple(at)])
        report["bad_scales"].append({
            "tensor": info.name, "file": info.file.name, "count": count, "nan_codes": int((s == 0xFF).sum()),
            "blocks": s.numel(), "first_block": at, "first_byte": byte,
            "first_scale": "NaN" if byte == 0xFF else f"2^{byte - 127}"})


# -- files ----------------------------------------------------------------------------------------


def _files_to_hash(root: Path, ckpt: Checkpoint, expected: dict, lists: set[str]) -> list[Path]:
    """Every regular file at the top of the model directory (and the listed files below it), the
    checkpoint's shards included, but not the checksum lists themselves, nor links that resolve outside."""
    files = {p for p in root.iterdir() if p.is_file() and p.name not in lists and _inside(root, p.name)}
    files |= {root / name for name in expected if _inside(root, name) and (root / name).is_file()}
    files |= set(ckpt.files())
    return sorted(files)


def _check_file(root: Path, file: Path, expected: dict, advance: Callable[[int], object]) -> dict:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
            advance(len(chunk))
    name = file.relative_to(root).as_posix() if file.is_relative_to(root) else str(file)
    got = digest.hexdigest()
    wants = expected.get(name, [])
    entry = {"name": name, "bytes": file.stat().st_size, "sha256": got}
    if not wants:
        return {**entry, "status": "unlisted"}
    wrong = [src for want, src in wants if want != got]
    return {**entry, "status": "mismatch" if wrong else "ok", "listed_in": [src for _, src in wants],
            "expected": next((want for want, _ in wants if want != got), got)}


def _inside(root: Path, name: str) -> bool:
    """A relative path that stays inside the directory, links resolved (formats.files' rule)."""
    return not name.startswith("~") and escape_reason(root, name) is None


def read_checksums(root: Path) -> tuple[dict[str, list[tuple[str, str]]], list[dict]]:
    """({file name relative to root: [(sha256, list it came from), ...]}, [{file, entries}]) from the
    checksum lists beside a checkpoint: `*.sha256` / SHA256SUMS in sha256sum's output (`<hex>  <name>`,
    `<hex> *<name>` or `SHA256 (<name>) = <hex>`; a bare `<hex>` in `<name>.sha256`), or a manifest.json
    mapping names to digests (an object, or a list of {"path"|"name"|"filename", "sha256"} entries)."""
    expected: dict[str, list[tuple[str, str]]] = {}
    lists = []
    for path in sorted(root.iterdir()):
        if not path.is_file() or not (path.suffix == ".sha256" or path.name in CHECKSUM_NAMES) \
                or not _inside(root, path.name):  # a list that links outside is never read: errors quote it
            continue
        entries = _manifest_json(path) if path.name == "manifest.json" else _sha256sum(path)
        if entries is None:  # a manifest.json that lists no checksums is some other tool's file
            continue
        for name, digest in entries:
            name = name[2:] if name.startswith("./") else name
            expected.setdefault(name, []).append((digest.lower(), path.name))
        lists.append({"file": path.name, "entries": len(entries)})
    return expected, lists


def _sha256sum(path: Path) -> list[tuple[str, str]]:
    entries = []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a sha256sum list (not UTF-8 text)") from None
    for number, line in enumerate(text.splitlines(), 1):
        line = line.rstrip("\r")
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if m := _SUM_LINE.fullmatch(line):
            digest, name = m[1], _unescape(m[2]) if line.startswith("\\") else m[2]
        elif m := _BSD_LINE.fullmatch(line):
            name, digest = _unescape(m[1]) if line.startswith("\\") else m[1], m[2]
        elif path.suffix == ".sha256" and _HEX.fullmatch(line.strip()):  # just the digest of <name>.sha256
            digest, name = _HEX.fullmatch(line.strip())[1], path.stem
        else:
            raise ValueError(f"{path}, line {number}: expected '<sha256 hex>  <file name>' (sha256sum's format), "
                             f"found {line[:80]!r}")
        entries.append((name, digest))
    return entries


def _unescape(name: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m[1] == "n" else m[1], name)


def _manifest_json(path: Path) -> list[tuple[str, str]] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise ValueError(f"{path}: expected a JSON manifest of file checksums, cannot parse it: {err}") from None
    if isinstance(data, dict) and isinstance(data.get("files"), (dict, list)):
        data = data["files"]
    entries = []
    if isinstance(data, dict):
        entries = [(name, m[1]) for name, value in data.items()
                   if isinstance(value, str) and (m := _HEX.fullmatch(value))]
        entries += [(name, m[1]) for name, value in data.items() if isinstance(value, dict)
                    and isinstance(value.get("sha256"), str) and (m := _HEX.fullmatch(value["sha256"]))]
    elif isinstance(data, list):
        for item in data:
            name = next((item[k] for k in ("path", "name", "filename") if isinstance(item, dict)
                         and isinstance(item.get(k), str)), None)
            digest = item.get("sha256") if isinstance(item, dict) else None
            if name is not None and isinstance(digest, str) and (m := _HEX.fullmatch(digest)):
                entries.append((name, m[1]))
    return entries or None


# -- report ---------------------------------------------------------------------------------------


def _problem_counts(r: dict) -> dict[str, int]:
    return {"nonfinite": len(r["nonfinite"]), "bad_scales": len(r["bad_scales"]), "undecodable": len(r["errors"]),
            "checksum_mismatches": sum(f["status"] == "mismatch" for f in r["files"]),
            "listed_files_missing": len(r["listed"])}


PROBLEM_WORDS = {"nonfinite": "tensor(s) with non-finite values", "bad_scales": "with out-of-range scale bytes",
                 "undecodable": "undecodable", "checksum_mismatches": "checksum mismatch(es)",
                 "listed_files_missing": "listed file(s) missing"}


def summary_line(r: dict) -> str:
    found = [f"{n} {PROBLEM_WORDS[k]}" for k, n in r["problems"].items() if n]
    if not found:
        return f"{r['path']}: verified: {len(r['files'])} files, {r['tensors']} tensors; no problems found"
    return f"{r['path']}: verification failed: {', '.join(found)}"


def format_verify(r: dict) -> str:
    lines = [f"verify: {r['tensors']} tensors ({r['modules_decoded']} weights decoded), {len(r['files'])} files; "
             f"MX scales allowed {r['scale_range'][0]}..{r['scale_range'][1]}"]
    for e in r["nonfinite"]:
        lines.append(f"  non-finite: {e['tensor']} in {e['file']}: {e['nan'] + e['inf']:,} of {e['values']:,} "
                     f"values ({e['nan']:,} NaN, {e['inf']:,} infinite)")
    for e in r["bad_scales"]:
        lines.append(f"  scale out of range: {e['tensor']} in {e['file']}: {e['count']:,} of {e['blocks']:,} blocks "
                     f"({e['nan_codes']:,} NaN code 0xFF); first at block {e['first_block']}: byte "
                     f"{e['first_byte']:#04x} = {e['first_scale']}")
    for e in r["errors"]:
        lines.append(f"  cannot decode: {e['error']}")
    for e in r["listed"]:
        lines.append(f"  {e['name']} (listed in {e['listed_in']}): {e['problem']}")
    lists = ", ".join(entry["file"] for entry in r["checksum_lists"]) or "none beside the checkpoint"
    lines.append(f"SHA-256 (checksum lists: {lists}):")
    for f in r["files"]:
        note = {"ok": "ok", "unlisted": "not listed",
                "mismatch": f"MISMATCH: {', '.join(f.get('listed_in', []))} says {f.get('expected')}"}[f["status"]]
        lines.append(f"  {f['sha256']}  {f['name']}  [{note}]")
    lines.append(summary_line(r))
    return "\n".join(lines)
