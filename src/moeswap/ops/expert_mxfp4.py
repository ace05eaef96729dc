"""expert_mxfp4: a routed expert y = w2 · act(w1 x, w3 x) computed straight from MXFP4 bytes.

Implementations, all with the signature of `reference`:
  reference   decode each matrix to fp32, matmul, drop it (plain torch; the parity oracle);
  torch_rows  the same in row chunks of ~1 MB, so no whole decoded matrix is ever allocated;
  cpu_c       mxfp4_cpu.c: decodes 32-weight blocks into registers and multiplies them there (AVX-512,
              AVX2 or portable C), JIT-compiled with the system C compiler at first use and cached.
`select()` picks the best available one (cpu_c on CPU tensors when it builds, else torch_rows);
MOESWAP_EXPERT_KERNEL=<name> forces one. Shapes: T tokens, I expert input width, F expert width.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from moeswap.formats import mx, mxfp4
from moeswap.ops.activation import glu

SOURCE = Path(__file__).with_name("mxfp4_cpu.c")
ENV_KERNEL = "MOESWAP_EXPERT_KERNEL"
ENV_CACHE = "MOESWAP_CACHE_DIR"
ROW_CHUNK_BYTES = 1 << 20  # decoded fp32 bytes per chunk in torch_rows: stays in L2


def reference(w, x_TI: torch.Tensor, act: str, situ_betas: tuple[float, float]) -> torch.Tensor:
    """Decode every matrix exactly (fp32), cast to x's dtype, multiply: the semantics all others match."""

    def full(name: str) -> torch.Tensor:
        return mxfp4.decode(getattr(w, f"{name}_packed"), getattr(w, f"{name}_scale"), torch.float32).to(x_TI.dtype)

    h_TF = glu(act, x_TI @ full("w1").T, x_TI @ full("w3").T, situ_betas)
    return h_TF @ full("w2").T


def torch_rows(w, x_TI: torch.Tensor, act: str, situ_betas: tuple[float, float]) -> torch.Tensor:
    """reference, decoding ~1 MB of rows at a time into the output's columns."""

    def linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        out = torch.empty(*x.shape[:-1], packed.shape[0], dtype=x.dtype, device=x.device)
        rows = max(1, ROW_CHUNK_BYTES // (packed.shape[1] * 8))
        for r in range(0, packed.shape[0], rows):
            chunk = mxfp4.decode(packed[r : r + rows], scale[r : r + rows], torch.float32).to(x.dtype)
            torch.matmul(x, chunk.T, out=out[..., r : r + rows])
        return out

    h_TF = glu(act, linear(x_TI, w.w1_packed, w.w1_scale), linear(x_TI, w.w3_packed, w.w3_scale), situ_betas)
    return linear(h_TF, w.w2_packed, w.w2_scale)


def cpu_c(w, x_TI: torch.Tensor, act: str, situ_betas: tuple[float, float]) -> torch.Tensor:
    """The C kernel, one call per expert: fp32 products and sums, the activation in fp32 (libm tanh/exp),
    the result cast to x's dtype. For bf16 inputs this skips the reference's bf16 rounding of the gate,
    up and hidden activations, so it is a little closer to exact than the reference, not bit-equal."""
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError(f"the MXFP4 CPU kernel is not available here: {_build_error}")
    x32 = x_TI.reshape(-1, x_TI.shape[-1]).to(torch.float32).contiguous()
    return kernel.expert(x32, w, act, situ_betas).to(x_TI.dtype).reshape(x_TI.shape)


Impl = Callable[..., torch.Tensor]
IMPLEMENTATIONS: dict[str, Impl] = {"reference": reference, "torch_rows": torch_rows, "cpu_c": cpu_c}


def available() -> dict[str, bool]:
    return {"reference": True, "torch_rows": True, "cpu_c": _kernel() is not None}


def select(name: str | None = None) -> Impl:
    """The implementation to use: `name`, else $MOESWAP_EXPERT_KERNEL, else the fastest available
    (cpu_c, then torch_rows). A name that is unknown or cannot run here is an error, not a fallback."""
    name = name or os.environ.get(ENV_KERNEL) or None
    if name is None:
        return _dispatch
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"unknown expert kernel {name!r} (from {ENV_KERNEL} or the caller); "
                         f"expected one of {', '.join(IMPLEMENTATIONS)}")
    if not available()[name]:
        raise RuntimeError(f"expert kernel {name!r} was asked for but is not available here: {_build_error}")
    return IMPLEMENTATIONS[name]


def _dispatch(w, x_TI: torch.Tensor, act: str, situ_betas: tuple[float, float]) -> torch.Tensor:
    if x_TI.device.type == "cpu" and w.w1_packed.device.type == "cpu" and _kernel() is not None:
        return cpu_c(w, x_TI, act, situ_betas)
    return torch_rows(w, x_TI, act, situ_betas)


def best_name() -> str:
    """What select() runs on CPU tensors (for reports)."""
    name = os.environ.get(ENV_KERNEL)
    return name or ("cpu_c" if _kernel() is not None else "torch_rows")


# -- the C kernel -------------------------------------------------------------------------------------

_lock = threading.Lock()
_loaded: dict[str, _Kernel | None] = {}
_build_error = "not built yet"


class _Kernel:
    def __init__(self, path: Path):
        self.path = path
        self.lib = ctypes.CDLL(str(path))
        self.lib.moeswap_mxfp4_linear.restype = ctypes.c_int
        self.lib.moeswap_mxfp4_linear.argtypes = [
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        self.lib.moeswap_mxfp4_expert.restype = ctypes.c_int
        self.lib.moeswap_mxfp4_expert.argtypes = [
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, *[ctypes.c_void_p] * 6, ctypes.c_int,
            ctypes.c_float, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
        self.lib.moeswap_mxfp4_isa.restype = ctypes.c_int
        self.isa = {512: "avx512", 256: "avx2", 0: "portable"}[self.lib.moeswap_mxfp4_isa()]

    def linear(self, x_TI: torch.Tensor, mats: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """x fp32 contiguous [T, I]; each (packed [O, I/2], scale [O, I/32]) -> y fp32 [T, O]."""
        T, I = x_TI.shape
        mats = [_checked(p, s, I) for p, s in mats]
        outs = [torch.empty(T, p.shape[0], dtype=torch.float32) for p, _ in mats]
        n = len(mats)
        ptrs = lambda ts: (ctypes.c_void_p * n)(*[t.data_ptr() for t in ts])  # noqa: E731
        status = self.lib.moeswap_mxfp4_linear(
            x_TI.data_ptr(), T, I, n, ptrs([p for p, _ in mats]), ptrs([s for _, s in mats]),
            (ctypes.c_int64 * n)(*[p.shape[0] for p, _ in mats]), ptrs(outs), max(1, torch.get_num_threads()))
        if status:
            raise RuntimeError(f"MXFP4 kernel failed with status {status} (x {tuple(x_TI.shape)})")
        return outs

    def expert(self, x_TI: torch.Tensor, w, act: str, situ_betas: tuple[float, float]) -> torch.Tensor:
        """x fp32 contiguous [T, I] -> w2 · act(w1 x, w3 x), fp32 [T, I]."""
        if act not in _ACTS:
            raise ValueError(f"unknown activation {act!r}")
        T, I = x_TI.shape
        p1, s1 = _checked(w.w1_packed, w.w1_scale, I)
        p3, s3 = _checked(w.w3_packed, w.w3_scale, I)
        F = p1.shape[0]
        p2, s2 = _checked(w.w2_packed, w.w2_scale, F)
        if p3.shape[0] != F or p2.shape[0] != I:
            raise ValueError(f"MXFP4 expert: w1 {tuple(p1.shape)}, w3 {tuple(p3.shape)} and w2 {tuple(p2.shape)} "
                             f"packed shapes do not form an expert of input width {I}")
        y = torch.empty(T, I, dtype=torch.float32)
        status = self.lib.moeswap_mxfp4_expert(
            x_TI.data_ptr(), T, I, F, p1.data_ptr(), s1.data_ptr(), p3.data_ptr(), s3.data_ptr(), p2.data_ptr(),
            s2.data_ptr(), _ACTS[act], float(situ_betas[0]), float(situ_betas[1]), y.data_ptr(),
            max(1, torch.get_num_threads()))
        if status:
            raise RuntimeError(f"MXFP4 kernel failed with status {status} (x {tuple(x_TI.shape)})")
        return y


_ACTS = {"silu": 0, "situ": 1}


def _checked(packed: torch.Tensor, scale: torch.Tensor, in_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 contiguous [O, in/2] and [O, in/32] on the CPU, or a ValueError naming the shapes."""
    if scale.dtype == torch.float8_e8m0fnu:
        scale = scale.view(torch.uint8)
    if (packed.dtype != torch.uint8 or scale.dtype != torch.uint8 or packed.ndim != 2
            or packed.shape[1] * 2 != in_dim or packed.device.type != "cpu"):
        raise ValueError(f"MXFP4 kernel: packed {tuple(packed.shape)} {packed.dtype} / scale {tuple(scale.shape)} "
                         f"{scale.dtype} do not fit input width {in_dim} (expected CPU uint8 [O, {in_dim // 2}] "
                         f"and [O, {in_dim // 32}])")
    mx.check_blocks("MXFP4", packed, scale, mx.BLOCK // 2, "packed")
    return packed.contiguous(), scale.contiguous()


def _kernel(flags: tuple[str, ...] | None = None) -> _Kernel | None:
    """The compiled kernel for `flags` (default: this machine's best), building it on first use."""
    global _build_error
    key = " ".join(flags) if flags is not None else "native"
    if key in _loaded:
        return _loaded[key]
    with _lock:
        if key not in _loaded:
            try:
                _loaded[key] = _Kernel(build(flags))
            except (OSError, RuntimeError, subprocess.SubprocessError) as err:
                _build_error = str(err)
                warnings.warn(f"moeswap: MXFP4 CPU kernel unavailable, experts use the torch path: {err}",
                              RuntimeWarning, stacklevel=3)
                _loaded[key] = None
    return _loaded[key]


def build(flags: tuple[str, ...] | None = None) -> Path:
    """Compile mxfp4_cpu.c into the cache (once per source, compiler, flags and CPU) and return the path.
    Default flags: this CPU's instruction set (-march=native, else -mcpu=native, else none), with OpenMP
    when the compiler has it (without, the kernel runs on one thread)."""
    if not SOURCE.is_file():
        raise RuntimeError(f"{SOURCE} is missing from this installation")
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not compiler:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    candidates = [tuple(flags)] if flags is not None else [("-march=native",), ("-mcpu=native",), ()]
    source = SOURCE.read_bytes()
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    except OSError as err:
        raise RuntimeError(f"cannot run the C compiler {compiler!r}: {err}") from None
    key = b"\0".join([source, version.encode(), repr(candidates).encode(), _cpu_id().encode()])
    out = _cache_dir() / f"mxfp4_cpu-{hashlib.sha256(key).hexdigest()[:16]}.so"
    if out.is_file():
        return out
    tmp = out.with_name(f"{out.stem}.{os.getpid()}.{threading.get_ident()}.tmp.so")
    errors = []
    for candidate in candidates:
        for openmp in (["-fopenmp"], []):
            command = [compiler, "-O3", "-std=c11", "-shared", "-fPIC", *candidate, *openmp, str(SOURCE), "-lm",
                       "-o", str(tmp)]
            result = subprocess.run(command, capture_output=True, text=True, timeout=300)
            if result.returncode == 0:
                os.replace(tmp, out)  # atomic: concurrent builders all end with a whole file
                return out
            errors.append(result.stderr.strip()[-2000:])
    tmp.unlink(missing_ok=True)
    raise RuntimeError(f"compiling {SOURCE.name} with {compiler} failed: {errors[0]}")


def _cache_dir() -> Path:
    root = os.environ.get(ENV_CACHE) or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "moeswap")
    path = Path(root).expanduser() / "kernels"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=path, delete=True)
        probe.close()
    except OSError:
        path = Path(tempfile.gettempdir()) / f"moeswap-kernels-{os.getuid() if hasattr(os, 'getuid') else 0}"
        path.mkdir(parents=True, exist_ok=True)
    return path


def _cpu_id() -> str:
    """-march=native output depends on the CPU: a shared cache must not hand one machine's build to another."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        model = next((line for line in info.splitlines() if line.startswith("model name")), "")
        flags = next((line for line in info.splitlines() if line.startswith("flags")), "")
        return model + flags
    except OSError:
        return platform.machine() + platform.processor()
