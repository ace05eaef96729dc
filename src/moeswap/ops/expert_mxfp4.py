"""expert_mxfp4: a routed expert y = w2 · act(w1 x, w3 x) computed straight from MXFP4 bytes.

Implementations, all with the signature of `reference`:
  reference   decode each matrix to fp32, matmul, drop it (plain torch; the parity oracle);
  torch_rows  the same in row chunks of ~1 MB, so no whole decoded matrix is ever allocated;
  cpu_c       csrc/mxfp4.c: decodes 32-weight blocks into registers and multiplies them there (AVX-512,
              AVX2 or portable C; ops/cpu_kernels.py builds it);
  triton      ops/triton_mxfp4.py: the same in registers on CUDA tensors (needs triton and a GPU).
`select()` picks the best available one (cpu_c on CPU tensors when it builds, triton on CUDA tensors when
triton imports, else torch_rows); MOESWAP_EXPERT_KERNEL=<name> forces one. `grouped(device_type)` is cpu_c
(CPU) or triton (CUDA) for all experts of a layer step in one call (the MoE block uses it when it is the
selected path). Shapes: T tokens, I expert input width,
F expert width, P (token, expert) pairs.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Sequence

import torch

from moeswap.formats import mxfp4
from moeswap.ops import cpu_kernels, kernel_experts
from moeswap.ops.activation import glu, glu_reference
from moeswap.ops.expert import MXFP4ExpertWeights
from moeswap.ops.gemm_precision import gemm_in_bf16
from moeswap.ops.kernel_abi import constant

ENV_KERNEL = "MOESWAP_EXPERT_KERNEL"
ROW_CHUNK_BYTES = constant("ROW_CHUNK_BYTES")  # decoded fp32 bytes per chunk in torch_rows (cpu_kernels.h)
GEMM_MIN_TOKENS = constant("EXPERT_GEMM_MIN_ROWS")  # from here on an expert's tokens go to torch_rows (cpu_kernels.h)


def reference(w, x_TI: torch.Tensor, act: str, situ_betas: tuple[float, float]) -> torch.Tensor:
    """Decode every matrix exactly (fp32), cast to x's dtype, multiply: the semantics all others match."""

    def full(name: str) -> torch.Tensor:
        return mxfp4.decode(getattr(w, f"{name}_packed"), getattr(w, f"{name}_scale"), torch.float32).to(x_TI.dtype)

    h_TF = glu_reference(act, x_TI @ full("w1").T, x_TI @ full("w3").T, situ_betas)
    return h_TF @ full("w2").T


def quantize_int8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x with each 32-column block rounded to int8 steps of its own scale d = max|x| / 127 (round half to
    even; d kept to fp16's 11 significant bits, as llama.cpp's Q8_0 stores it; a block with a non-finite
    value becomes NaN): the activations `reference_int8` multiplies."""
    blocks = x.float().unflatten(-1, (-1, 32))
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    bits = (amax / 127.0).view(torch.int32)
    d = ((bits + 0x0FFF + ((bits >> 13) & 1)) & ~0x1FFF).view(torch.float32)
    q = (blocks * inv).round().clamp(-127, 127) * d
    return q.masked_fill(~blocks.isfinite().all(-1, keepdim=True), float("nan")).flatten(-2)


def reference_int8(w, x_TI: torch.Tensor, act: str, situ_betas: tuple[float, float]) -> torch.Tensor:
    """What the int8-activation kernel computes (llama.cpp's arithmetic for MXFP4 weights): the input of
    every matrix rounded by `quantize_int8_blocks`, products and sums in fp32 (exact in the kernel's integers)."""
    def full(name: str) -> torch.Tensor:
        return mxfp4.decode(getattr(w, f"{name}_packed"), getattr(w, f"{name}_scale"), torch.float32)

    x = quantize_int8_blocks(x_TI)
    h_TF = glu_reference(act, x @ full("w1").T, x @ full("w3").T, situ_betas)
    return (quantize_int8_blocks(h_TF) @ full("w2").T).to(x_TI.dtype)


def torch_rows(w, x_TI: torch.Tensor, act: str, situ_betas: tuple[float, float]) -> torch.Tensor:
    """reference, decoding ~1 MB of rows at a time into the output's columns. Under
    `gemm_precision("bf16")` on the CPU, from GEMM_MIN_TOKENS tokens on, the inputs are rounded to bf16 and
    multiply the decoded rows (exact in bf16: E2M1 times a power of two) with fp32 sums and outputs, as the
    dense layers' GEMMs then do."""
    rows = x_TI.numel() // x_TI.shape[-1] if x_TI.shape[-1] else 0
    bf16 = rows >= GEMM_MIN_TOKENS and x_TI.dtype == torch.float32 and x_TI.device.type == "cpu" and gemm_in_bf16()
    h_TF = glu(act, rows_linear(x_TI, w.w1_packed, w.w1_scale, bf16), rows_linear(x_TI, w.w3_packed, w.w3_scale, bf16),
               situ_betas)
    return rows_linear(h_TF, w.w2_packed, w.w2_scale, bf16)


def rows_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bf16: bool = False) -> torch.Tensor:
    """x @ W^T for one MXFP4 matrix, decoding ~1 MB of W's rows at a time into the output's columns (x fp32
    or bf16; bf16: an fp32 x is rounded to bf16 first, see torch_rows)."""
    out = torch.empty(*x.shape[:-1], packed.shape[0], dtype=x.dtype, device=x.device)
    rows = max(1, ROW_CHUNK_BYTES // (packed.shape[1] * 8))
    if bf16:
        x = x.to(torch.bfloat16).to(x.dtype)
    for r in range(0, packed.shape[0], rows):
        chunk = decode_rows(packed[r : r + rows], scale[r : r + rows], rows, x.dtype)
        torch.matmul(x, chunk.T, out=out[..., r : r + rows])
    return out


_scratch = threading.local()  # per thread: a chunk buffer reused across calls (fresh ones page-fault)


def decode_rows(packed: torch.Tensor, scale: torch.Tensor, max_rows: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows of an MXFP4 matrix in `dtype` (fp32, or bf16: exact too), in a per-thread scratch buffer (valid
    until this thread's next call)."""
    kernel = cpu_kernels.kernel() if packed.device.type == "cpu" else None
    if kernel is None:
        return mxfp4.decode(packed, scale, torch.float32).to(dtype)
    size = max_rows * packed.shape[1] * 2
    name = f"buf_{dtype}"
    buf = getattr(_scratch, name, None)
    if buf is None or buf.numel() < size:
        buf = torch.empty(size, dtype=dtype)
        setattr(_scratch, name, buf)
    return kernel.mxfp4_decode(packed, scale, out=buf[: packed.shape[0] * packed.shape[1] * 2], dtype=dtype)


def cpu_c(w, x_TI: torch.Tensor, act: str, situ_betas: tuple[float, float]) -> torch.Tensor:
    """The C kernel, one call per expert: fp32 products and sums, the activation in fp32 (the kernel's own
    vectorized tanh/exp, a few ulp from torch's), the result cast to x's dtype. For bf16 inputs this skips
    the reference's bf16 rounding of the gate, up and hidden activations, so it is a little closer to
    exact than the reference, not bit-equal."""
    kernel = cpu_kernels.kernel()
    if kernel is None:
        raise RuntimeError(f"the MXFP4 CPU kernel is not available here: {cpu_kernels.build_error()}")
    x32 = x_TI.reshape(-1, x_TI.shape[-1]).to(torch.float32).contiguous()
    return kernel_experts.expert(kernel, x32, w, act, situ_betas).to(x_TI.dtype).reshape(x_TI.shape)


def triton(w, x_TI: torch.Tensor, act: str, situ_betas: tuple[float, float]) -> torch.Tensor:
    """ops/triton_mxfp4.py on CUDA tensors: fp32 sums of exact products, each projection's output in x's
    dtype (as the reference rounds it), the activation in torch."""
    from moeswap.ops import triton_mxfp4

    return triton_mxfp4.expert(w, x_TI, act, situ_betas)


def _triton_available() -> bool:
    from moeswap.ops import triton_mxfp4  # imports triton: only asked for where CUDA tensors are about

    return triton_mxfp4.available()


Impl = Callable[..., torch.Tensor]
IMPLEMENTATIONS: dict[str, Impl] = {"reference": reference, "torch_rows": torch_rows, "cpu_c": cpu_c,
                                    "triton": triton}


def available() -> dict[str, bool]:
    """Which implementations can run here (triton: on CUDA tensors only)."""
    return {"reference": True, "torch_rows": True, "cpu_c": cpu_kernels.kernel() is not None,
            "triton": torch.cuda.is_available() and _triton_available()}


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
        why = ("it needs the triton package and a CUDA device" if name == "triton" else cpu_kernels.build_error())
        raise RuntimeError(f"expert kernel {name!r} was asked for but is not available here: {why}")
    return IMPLEMENTATIONS[name]


def _dispatch(w, x_TI: torch.Tensor, act: str, situ_betas: tuple[float, float]) -> torch.Tensor:
    """cpu_c for the few tokens of decode; from GEMM_MIN_TOKENS tokens on (prefill) torch_rows, whose
    GEMM on decoded rows (decoded by the C kernel) outruns decoding in registers. CUDA tensors: triton
    where it is available, else torch_rows."""
    if x_TI.is_cuda and w.w1_packed.is_cuda and _triton_ready():
        return triton(w, x_TI, act, situ_betas)
    rows = x_TI.numel() // x_TI.shape[-1] if x_TI.shape[-1] else 0
    if (rows < GEMM_MIN_TOKENS and x_TI.device.type == "cpu" and w.w1_packed.device.type == "cpu"
            and cpu_kernels.kernel() is not None):
        return cpu_c(w, x_TI, act, situ_betas)
    return torch_rows(w, x_TI, act, situ_betas)


@functools.cache
def _triton_ready() -> bool:
    """available()["triton"], once per process (the dispatch asks it at every CUDA expert call)."""
    return _triton_available()


def best_name() -> str:
    """What select() runs on CPU tensors (for reports)."""
    name = os.environ.get(ENV_KERNEL)
    return name or ("cpu_c" if cpu_kernels.kernel() is not None else "torch_rows")


def grouped(device_type: str = "cpu") -> Callable[..., None] | None:
    """The one-call-per-layer-step form of what select() runs on tensors of this device type: cpu_c (MXFP4, or
    bf16 experts) on the CPU, triton (MXFP4 experts, `group_kind`) on CUDA; else None:
    fn(h_TI, experts, tokens_P, offsets, weights_P, act, situ_betas, out_TI, int8_activations=False) adds
    each expert's weighted output to out (fp32 [T, I]) for its tokens (int8_activations: see reference_int8;
    the CPU kernel's alone)."""
    name = os.environ.get(ENV_KERNEL)
    if device_type == "cuda":
        if name not in (None, "", "triton") or not _triton_ready():
            return None
        from moeswap.ops import triton_mxfp4

        return triton_mxfp4.grouped_experts
    if device_type != "cpu":
        return None
    kernel = cpu_kernels.kernel() if name in (None, "", "cpu_c") else None
    if kernel is None:
        return None

    def run(h_TI: torch.Tensor, experts: Sequence, tokens_P: torch.Tensor, offsets: Sequence[int],
            weights_P: torch.Tensor, act: str, situ_betas: tuple[float, float], out_TI: torch.Tensor,
            int8_activations: bool = False) -> None:
        x32 = h_TI.to(torch.float32).contiguous()
        kernel_experts.moe(kernel, x32, experts, tokens_P, offsets, weights_P.to(torch.float32), act, situ_betas,
                           out_TI, int8_activations)

    return run




def group_kind(w, device_type: str) -> str | None:
    """Which grouped kernel of `grouped(device_type)` runs expert w: kernel_experts.grouped_kind on the CPU;
    "mxfp4" for MXFP4 experts on CUDA (triton); None: it runs on its own."""
    if device_type == "cpu":
        return kernel_experts.grouped_kind(w)
    if device_type == "cuda" and isinstance(w, MXFP4ExpertWeights) and w.w1_packed.is_cuda:
        return "mxfp4"
    return None
