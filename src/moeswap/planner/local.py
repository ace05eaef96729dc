"""`--hardware local`: measure this machine in a few seconds and save it as a catalog file.

Measures memory copy bandwidth, matmul FLOP/s per dtype, disk read speed and memory size, on the CPU
or on a CUDA device, and the engine: on a GPU the weight-streaming (GEMV) bandwidth and per-kernel
time under graph replay; on a CPU moeswap's own kernels, per-op cost and op counts (local_cpu.py).
Writes [accelerator|storage|host|link|engine|system].local entries whose sources say how each
number was measured. Entry points: `measure`, `load_or_measure`, `write_toml`.
"""

from __future__ import annotations

import datetime as _dt
import mmap
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .errors import PlanError
from .hardware import builtin_catalog
from .local_cpu import engine_fields, fit_line

DEFAULT_PATH = Path("~/.cache/moeswap/hardware-local.toml")


def _best(fn, repeats: int = 3) -> float:
    """Fastest of `repeats` timed calls (after one warm-up): the machine is shared and noisy."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _sync(device: str):
    import torch

    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def _copy_gbs(device: str, nbytes: int) -> float:
    import torch

    sync = _sync(device)
    a = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    b = torch.empty_like(a)

    def run():
        b.copy_(a)
        sync()

    return 2 * nbytes / _best(run) / 1e9  # read + write


def _gemv_fit(max_bytes: int) -> tuple[float, float]:
    """Decode-style matmuls ([4 x 4096] @ bf16 weight) at several sizes on the GPU, each inside a
    replayed CUDA graph, fitted as t = t0 + bytes / bw.

    Returns (t0 in microseconds, bw in GB/s): the fixed time of a bandwidth-bound kernel and the
    rate at which it streams weights.
    """
    import torch

    k = 4096
    points = []
    for frac in (1 / 256, 1 / 16, 1 / 4, 1):
        n = max(64, int(max_bytes * frac) // (2 * k))
        w = torch.randn(k, n, dtype=torch.bfloat16, device="cuda")
        x = torch.randn(4, k, dtype=torch.bfloat16, device="cuda")
        reps = 20 if frac < 1 / 8 else 4
        torch.matmul(x, w)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                torch.matmul(x, w)

        def run(g=g):
            g.replay()
            torch.cuda.synchronize()
        points.append((k * n * 2, _best(run) / reps))
        del w
    t0, slope = fit_line(points)
    return t0 * 1e6, 1 / slope / 1e9


def _matmul_tflops(device: str, dtype_name: str, n: int) -> float | None:
    import torch

    sync = _sync(device)
    try:
        if dtype_name == "fp8":
            if device != "cuda" or not hasattr(torch, "float8_e4m3fn"):
                return None
            a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
            b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()
            one = torch.ones((), device=device)

            def run():
                torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
                sync()
        else:
            dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
            a = torch.randn(n, n, dtype=dt, device=device)
            b = torch.randn(n, n, dtype=dt, device=device)

            def run():
                torch.matmul(a, b)
                sync()
        return 2 * n**3 / _best(run) / 1e12
    except (RuntimeError, TypeError):
        return None  # dtype not supported here


def _op_overhead_us() -> float:
    """Time of one tiny kernel inside a replayed CUDA graph."""
    import torch

    x = torch.randn(1, 7168, device="cuda", dtype=torch.bfloat16)
    ops = 200
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            y = x
            for _ in range(ops):
                y = y * 1.0001
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = x
        for _ in range(ops):
            y = y * 1.0001

    def run():
        g.replay()
        torch.cuda.synchronize()
    return _best(run, 5) / ops * 1e6


def _h2d_gbs(nbytes: int) -> float:
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    b = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def run():
        b.copy_(a, non_blocking=True)
        torch.cuda.synchronize()

    return nbytes / _best(run) / 1e9


def _disk_read_gbs(folder: Path, nbytes: int) -> tuple[float, str]:
    """Sequential read of a fresh file, bypassing the page cache with O_DIRECT where the filesystem allows."""
    folder.mkdir(parents=True, exist_ok=True)
    chunk = 8 << 20
    fd, name = tempfile.mkstemp(dir=folder, prefix=".moeswap-disk-")
    try:
        block = os.urandom(1 << 20) * (chunk >> 20)
        with os.fdopen(fd, "wb") as f:
            for _ in range(nbytes // chunk):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT requires
        how = "O_DIRECT sequential read"
        try:
            rfd = os.open(name, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        except OSError:
            rfd, how = os.open(name, os.O_RDONLY), "buffered read after posix_fadvise(DONTNEED); may include page cache"
        try:
            if "buffered" in how and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(rfd, 0, 0, os.POSIX_FADV_DONTNEED)
            t = time.perf_counter()
            total = 0
            while True:
                try:
                    n = os.readv(rfd, [buf])
                except OSError:  # O_DIRECT refused at read time: fall back once
                    os.close(rfd)
                    rfd, how = os.open(name, os.O_RDONLY), "buffered read; may include page cache"
                    t, total = time.perf_counter(), 0
                    continue
                if n <= 0:
                    break
                total += n
            dt = time.perf_counter() - t
        finally:
            os.close(rfd)
        return total / dt / 1e9, how
    finally:
        os.unlink(name)


def _ram_bytes() -> int:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:  # a container's memory limit is what we actually get
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return total


def measure(device: str = "cpu", disk_dir: Path | None = None, quick: bool = False) -> dict[str, Any]:
    """Measure this machine; returns {kind: {id: fields + 'source'}} ready for `write_toml`."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise PlanError("--device cuda: no CUDA device is visible to torch on this machine")
    gpu = device == "cuda"
    mb = 1 << 20
    size = (2048 if gpu else (64 if quick else 256)) * mb
    when = _dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    who = (torch.cuda.get_device_name() if gpu else platform.processor() or platform.machine())
    tag = f"[measured] moeswap planner local on {platform.node()} ({who}), {when}, torch {torch.__version__}, " \
          f"{torch.get_num_threads()} threads"
    copy = _copy_gbs(device, size)
    n_mm = 8192 if gpu else (512 if quick else 1024)
    flops = {d: _matmul_tflops(device, d, n_mm) for d in ("bf16", "fp32", "fp8")}
    disk, disk_how = _disk_read_gbs(disk_dir or Path(tempfile.gettempdir()), (64 if quick else 256) * mb)
    free_tb = _disk_free(disk_dir or Path(tempfile.gettempdir())) / 1e12

    accel: dict[str, Any] = {"name": f"local {'GPU' if gpu else 'CPU'}: {who}", "vendor": "local"}
    src: dict[str, str] = {}
    mem = torch.cuda.mem_get_info()[1] if gpu else _ram_bytes()
    accel["memory_gb"] = round(mem / 1e9, 2)
    src["memory_gb"] = f"{tag}: {'cudaMemGetInfo total' if gpu else 'physical RAM or cgroup limit'}"
    accel["mem_bw_gbs"] = round(copy, 2)
    src["mem_bw_gbs"] = f"{tag}: tensor copy of {size // mb} MiB, read+write bytes / best time"
    for d, v in flops.items():
        if v:
            accel[f"{d}_tflops"] = round(v, 4)
            src[f"{d}_tflops"] = f"{tag}: {n_mm}^3 {d} matmul, best of 3"
    if "bf16_tflops" not in accel and "fp32_tflops" in accel:
        accel["bf16_tflops"] = accel["fp32_tflops"]
        src["bf16_tflops"] = f"{tag}: bf16 matmul unavailable; fp32 rate used"
    accel["source"] = src

    engine = _gpu_engine(size, copy, tag) if gpu else _cpu_engine(copy, accel["bf16_tflops"], tag)

    out: dict[str, Any] = {
        "accelerator": {"local": accel},
        "storage": {"local": {"name": f"local disk ({disk_how})", "read_gbs": round(disk, 3),
                              "capacity_tb": round(free_tb, 3),
                              "source": {"read_gbs": f"{tag}: {disk_how} of {(64 if quick else 256)} MiB",
                                         "capacity_tb": f"{tag}: free space where the file was written"}}},
        "engine": {"local": engine},
    }
    system = {"name": f"this machine ({who})", "accelerator": "local", "scale_up_link": "none",
              "scale_out_link": "none", "host_link": "none", "host": "none", "storage": "local", "engine": "local",
              "node_devices": 1, "scale_up_devices": 1, "drives_per_node": 1,
              "source": {k: f"{tag}: one device" for k in ("node_devices", "scale_up_devices", "drives_per_node")}}
    if gpu:
        cpu_copy = _copy_gbs("cpu", 256 * mb)
        out["host"] = {"local": {"name": f"this machine's CPU RAM ({platform.processor() or platform.machine()})",
                                 "memory_gb": round(_ram_bytes() / 1e9, 2), "mem_bw_gbs": round(cpu_copy, 2),
                                 "mem_efficiency": 1.0,
                                 "source": {"memory_gb": f"{tag}: physical RAM or cgroup limit",
                                            "mem_bw_gbs": f"{tag}: CPU tensor copy, read+write / time",
                                            "mem_efficiency": f"{tag}: bandwidth above is already achieved, not peak"}}}
        out["link"] = {"local-host": {"name": "host to device copy", "gbs": round(_h2d_gbs(512 * mb), 2),
                                      "latency_us": 10.0,
                                      "source": {"gbs": f"{tag}: pinned 512 MiB host-to-device copy",
                                                 "latency_us": "[assumption] DMA setup + completion"}}}
        system.update(host="local", host_link="local-host")
    out["system"] = {"local": system}
    return out


def _gpu_engine(size: int, copy: float, tag: str) -> dict[str, Any]:
    """The default profile with the fixed time per kernel and the GEMV streaming efficiency measured."""
    gemv_t0, stream = _gemv_fit(size // 2)
    op_us = _op_overhead_us()
    engine = _base_engine("default")
    engine["name"] = f"{engine['name']} (kernel time and streaming efficiency measured here)"
    # The fixed time per kernel is the larger of a tiny op and a weight-streaming matmul's intercept.
    engine["kernel_us"] = round(max(op_us, gemv_t0), 3)
    engine["source"]["kernel_us"] = (f"{tag}: max(tiny op {op_us:.2f} us, intercept {gemv_t0:.2f} us of "
                                     f"[4 x 4096] @ W matmul time vs bytes), kernels in a replayed CUDA graph")
    engine["mem_efficiency"] = round(min(1.0, stream / copy), 3)
    engine["source"]["mem_efficiency"] = (f"{tag}: slope of [4 x 4096] @ bf16 W time vs bytes = {stream:.0f} GB/s, "
                                          f"over the {copy:.0f} GB/s copy rate")
    return engine


def _cpu_engine(copy: float, bf16_tflops: float, tag: str) -> dict[str, Any]:
    """The moeswap-cpu profile with its rates, per-op time and op counts measured on moeswap's own
    CPU kernels and engine (local_cpu.py): generic torch matmuls and tiny ops miss both the C kernels
    and the Python around each eager op."""
    fields, sources = engine_fields(copy, bf16_tflops, tag)
    engine = _base_engine("moeswap-cpu")
    engine["name"] = f"{engine['name']} (its kernels, per-op time and op counts measured here)"
    engine.update(fields)
    engine["source"].update(sources)
    return engine


def _disk_free(folder: Path) -> float:
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


def _base_engine(name: str) -> dict[str, Any]:
    e = builtin_catalog().get("engine", name)
    return {**e.fields, "source": dict(e.sources)}


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


FINGERPRINT_LINE = "# moeswap engine measured: "


def engine_fingerprint() -> str:
    """What the measured engine rates depend on besides the machine: moeswap's version and the source of
    its engine (ops, models, engine). A saved measurement with another fingerprint is measured again: a
    step's kernel and glue times change with the code (docs/benchmarks.md)."""
    import hashlib

    import moeswap

    root = Path(moeswap.__file__).parent
    digest = hashlib.sha256(moeswap.__version__.encode())
    for sub in ("ops", "models", "engine"):
        for f in sorted((root / sub).rglob("*")):
            if f.suffix in (".py", ".c"):
                digest.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    return f"{moeswap.__version__}+{digest.hexdigest()[:12]}"


WRITTEN_LINE = "# Written by `moeswap plan --hardware local`; every number says how it was measured."


def saved_fingerprint(path: Path) -> str | None:
    """The fingerprint in a file `write_toml` wrote ("" from a moeswap that wrote none), or None for a
    file it did not write (hand-made: never measured over)."""
    with open(path, encoding="utf-8") as f:
        head = [line.rstrip("\n") for _, line in zip(range(2), f)]
    if not head or head[0] != WRITTEN_LINE:
        return None
    return head[1][len(FINGERPRINT_LINE):].strip() if len(head) > 1 and head[1].startswith(FINGERPRINT_LINE) else ""


def write_toml(data: dict[str, Any], path: Path) -> None:
    lines = [WRITTEN_LINE, FINGERPRINT_LINE + engine_fingerprint(), ""]
    for kind, entries in data.items():
        for eid, fields in entries.items():
            lines.append(f"[{kind}.{eid}]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in fields.items() if k != "source"]
            lines.append(f"[{kind}.{eid}.source]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in fields.get("source", {}).items()]
            lines.append("")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


def load_or_measure(catalog, path: str | Path | None = None, remeasure: bool = False, device: str = "cpu"):
    """Add the saved local file to `catalog`, measuring (and saving) first if it is missing or asked for."""
    p = Path(path or DEFAULT_PATH).expanduser()
    stale = p.exists() and not remeasure and saved_fingerprint(p) not in (None, engine_fingerprint())
    if stale:
        print(f"moeswap plan: {p} was measured with another moeswap build; measuring again (~15 s)",
              file=sys.stderr)
    if remeasure or stale or not p.exists():
        write_toml(measure(device, disk_dir=p.parent), p)
    return catalog.add_file(p)
