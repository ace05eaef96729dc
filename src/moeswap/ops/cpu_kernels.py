"""cpu_kernels: the entry to moeswap's C kernels (csrc/: one library built at first use by native_build,
-march=native and OpenMP, loaded with ctypes). `kernel()` returns the loaded `CpuKernels` (kernel_library), or
None where it cannot be built (a RuntimeWarning says why once; callers then take their plain-torch path);
`for_inference(*tensors)` the same for an eager call autograd need not see. What C and Python share is read
from the headers (kernel_abi); expert objects become pointers in kernel_experts; torch ops in kernel_ops.
"""

from __future__ import annotations

import functools
import os
import platform
import shutil
import subprocess
import threading
import warnings
from pathlib import Path

import torch

from moeswap.ops import kernel_ops, native_build  # noqa: F401  (kernel_ops: registers torch.ops.moeswap.*)
from moeswap.ops.kernel_abi import CSRC, HEADER, Abi, abi, ctype_of, parse_header  # noqa: F401  (re-exported)
from moeswap.ops.kernel_library import ACTS, FORMAT_CODES, CpuKernels, resident_format_code  # noqa: F401

_lock = threading.Lock()
_loaded: dict[str, CpuKernels | None] = {}
_build_error = "not built yet"


def build_error() -> str:
    return _build_error


def kernel_ready() -> bool:
    """Whether this machine's kernel is built and loaded (never builds it: safe while tracing)."""
    return _loaded.get(_key(isa_flags())) is not None


def _key(flags: tuple[str, ...] | None) -> str:
    return " ".join(flags) if flags is not None else "native"


# MOESWAP_KERNEL_ISA: the instruction-set level the kernels are built for (default: this CPU's best), so the
# numerics a user's CPU gets can be run on a wider one; each level needs these CPU flags
ISA_ENV = "MOESWAP_KERNEL_ISA"
ISA_LEVELS = {
    "native": (),
    "x86-64-v4": ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx2", "fma", "bmi2"),
    "x86-64-v3": ("avx2", "fma", "bmi2", "f16c", "movbe"),
    "x86-64-v2": ("sse4_2", "popcnt", "ssse3"),
    "x86-64": (),
}


def isa_flags() -> tuple[str, ...] | None:
    """The build flags MOESWAP_KERNEL_ISA names (None: this CPU's best); ValueError for a level this CPU lacks."""
    return _level_flags(os.environ.get(ISA_ENV, "native") or "native")


@functools.cache  # kernel() asks on every call (for_inference sits on per-step paths): resolved once per level
def _level_flags(level: str) -> tuple[str, ...] | None:
    if level not in ISA_LEVELS:
        raise ValueError(f"{ISA_ENV}={level!r}: expected one of {', '.join(ISA_LEVELS)}")
    if level == "native":
        return None
    if level not in supported_levels():
        missing = [f for f in ISA_LEVELS[level] if f not in cpu_flags()]
        why = f"this CPU lacks {', '.join(missing)}" if missing else "this CPU is not x86-64"
        raise ValueError(f"{ISA_ENV}={level}: {why}; levels it runs: {', '.join(supported_levels())}")
    return (f"-march={level}",)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (/proc/cpuinfo; empty where there is none)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((ln for ln in info.splitlines() if ln.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def supported_levels() -> list[str]:
    """The MOESWAP_KERNEL_ISA levels this CPU executes (x86-64 only; elsewhere just native)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return ["native"]
    have = cpu_flags()
    return [level for level, need in ISA_LEVELS.items() if all(f in have for f in need)]


def kernel(flags: tuple[str, ...] | None = None) -> CpuKernels | None:
    """The compiled kernel for `flags` (default: MOESWAP_KERNEL_ISA's level, else this machine's best),
    building it on first use."""
    global _build_error
    if flags is None:
        flags = isa_flags()
    key = _key(flags)
    if key in _loaded:
        return _loaded[key]
    with _lock:
        if key not in _loaded:
            try:
                _loaded[key] = CpuKernels(build(flags))
            except (OSError, RuntimeError, subprocess.SubprocessError) as err:
                _build_error = str(err)
                warnings.warn(f"moeswap: CPU kernels unavailable, using the plain torch paths: {err}",
                              RuntimeWarning, stacklevel=3)
                _loaded[key] = None
    return _loaded[key]


def for_inference(*tensors: torch.Tensor) -> CpuKernels | None:
    """The kernel, for an eager call on CPU tensors that autograd need not see; None where the caller
    should take its torch path (tracing, gradients wanted, another device, no kernel here)."""
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
        return None
    if not all(t.is_cpu for t in tensors):
        return None
    return kernel()


def build_variants(without_vbmi: bool = False) -> list[tuple[str, ...] | None]:
    """Kernel builds this machine can run, for tests: None (its best), then on x86-64 the AVX2 build where the
    CPU has AVX2 and FMA, and the portable one; without_vbmi: also the AVX-512 build without byte permutes
    (quant.c's other FP8 tile, as on Skylake-X) where the CPU has them."""
    builds: list[tuple[str, ...] | None] = [None]
    if platform.machine() in ("x86_64", "AMD64") and (shutil.which("cc") or shutil.which("gcc")):
        cpu = cpu_flags()
        if without_vbmi and {"avx512vbmi", "avx512bw"} <= cpu:
            builds.append(("-march=native", "-mno-avx512vbmi"))
        if {"avx2", "fma"} <= cpu:
            builds.append(("-march=native", "-mno-avx512f"))
        builds.append(("-march=x86-64",))
    return builds


def build(flags: tuple[str, ...] | None = None) -> Path:
    """The kernel library for `flags` (default: MOESWAP_KERNEL_ISA's level, else this CPU's best;
    native_build.build), built from every C file
    and header of csrc/, or found in the cache."""
    flags = isa_flags() if flags is None else flags
    return native_build.build("cpu_kernels", sorted(CSRC.glob("*.c")), sorted(CSRC.glob("*.h")), flags)
