"""linear: y = x W^T where W may be kept narrower than x ("weight-only": bf16 weights, fp32 math).

On a CPU a decode step is bound by the bytes of weights it streams, and torch's bf16 GEMV with one row
runs far below memory bandwidth, so moeswap keeps bf16-stored dense weights in bf16 and computes in
fp32 (csrc/linear_bf16.c's bf16_linear: every weight widened exactly, fp32 sums; the same values as an fp32
copy of the weights, at half the bytes). Many rows (prefill) go to torch's GEMM on a widened copy.
The Linear layers whose stored weights the loader keeps as they are run through weights/ (their method's
`apply`: weights.floating for bf16, weights.fp8_block for block FP8), which calls this.
"""

from __future__ import annotations

import threading
from functools import partial

import torch
import torch.nn.functional as F

from moeswap.ops import cpu_kernels
from moeswap.ops.gemm_precision import gemm_in_bf16
from moeswap.ops.kernel_abi import constant

KERNEL_MAX_ROWS = constant("DENSE_KERNEL_MAX_ROWS")  # up to this many rows the kernel; above, GEMM (cpu_kernels.h)

def row_kernel_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear(x, weight)` runs csrc/linear_bf16.c, whose every output is one (row, token) sum in a
    fixed order: the same bits whatever rows of `weight` or tokens of `x` share the call. Elsewhere it runs
    torch's GEMM, where on MKL's AVX2 kernels an output can depend on the other rows of the weight (the
    matrix's N) as well as on the other tokens (docs/numerics.md)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (weight.dtype == torch.bfloat16 and x.dtype == torch.float32 and x.is_cpu and 0 < rows <= KERNEL_MAX_ROWS
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def gemm_input(x: torch.Tensor) -> torch.Tensor:
    """x, or on the CPU a contiguous copy of it where its rows might not start on a 64-byte boundary. On an
    AMD EPYC (Zen 4) MKL's GEMM gives other bits for a matrix whose rows are not 16-byte aligned (a column
    slice of a fused product, rows 290 floats apart) than for the same values aligned (measured 2026-12-07,
    scripts/gemm_split_bits.py, docs/numerics.md); a module's own output is aligned, so
    the copy gives a slice's product the bits of the unfused module's. The copy is [rows, in], the product's
    input: small beside the product it feeds."""
    if x.is_cpu and not torch.compiler.is_compiling() and (not x.is_contiguous() or x.data_ptr() % 64):
        return x.clone(memory_format=torch.contiguous_format)
    return x


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T in x's dtype, for a weight in x's dtype or (on the CPU) bf16 under fp32 x. torch's GEMM
    takes x with aligned rows (`gemm_input`)."""
    if weight.dtype == x.dtype:
        return F.linear(gemm_input(x), weight)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not (weight.dtype == torch.bfloat16 and x.dtype == torch.float32 and x.is_cpu):
        return F.linear(gemm_input(x), weight.to(x.dtype))
    if row_kernel_takes(x, weight):
        if torch.compiler.is_compiling():  # the kernel as a torch op: a ctypes call would break the graph
            run = torch.ops.moeswap.bf16_linear  # fp32 (see gemm_precision above)
        else:
            kernel = cpu_kernels.kernel()
            run = kernel.bf16_linear if kernel is not None else None
            if run is not None and gemm_in_bf16():
                if kernel.has_bf16_dot and x.shape[-1] % 32 == 0:
                    run = partial(kernel.bf16_linear, bf16_inputs=True)
                else:  # the same rounding of the inputs, on the fp32 kernel
                    x = x.to(torch.bfloat16).float()
        if run is not None:
            y = run(x.reshape(rows, x.shape[-1]), weight)
            return y.reshape(*x.shape[:-1], weight.shape[0])
    if gemm_in_bf16():  # llama.cpp's arithmetic: inputs rounded to bf16, products exact, fp32 sums and outputs
        x = x.to(torch.bfloat16).to(x.dtype)
    x = gemm_input(x)
    if (weight.numel() <= WIDEN_SCRATCH_MAX and not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return F.linear(x, _widened(weight))
    return F.linear(x, weight.to(x.dtype))


_scratch = threading.local()
WIDEN_SCRATCH_MAX = 16 << 20  # elements (64 MiB fp32): the buffer stays, so a 163840-row lm_head must not


def _widened(weight: torch.Tensor) -> torch.Tensor:
    """An fp32 copy of a bf16 CPU weight in a per-thread buffer reused by the next call: a fresh
    allocation of that size costs page faults, many times the copy (docs/benchmarks.md).
    The buffer is as large as the largest weight widened so far (at most WIDEN_SCRATCH_MAX elements);
    valid until the thread's next call, so only for products nothing keeps for backward."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < weight.numel():
        with torch.inference_mode(False):  # a normal tensor: writable in and out of inference mode
            buf = _scratch.buf = torch.empty(weight.numel(), dtype=torch.float32)
    return buf[:weight.numel()].view(weight.shape).copy_(weight)
