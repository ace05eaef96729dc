"""GEMM precision: the one switch between moeswap's exact fp32 matmuls and llama.cpp's bf16-input arithmetic,
as a context variable the model sets per forward and the matmul paths read (ops.linear, the expert kernels).
Torch-free, so the load options can name its choices. Entry points: `gemm_precision(name)`, `gemm_in_bf16()`.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

GEMM_PRECISIONS = ("fp32", "bf16")

# "bf16": CPU matmuls with bf16 weights round their inputs to bf16 and keep fp32 sums and outputs. More than
# ops.linear.KERNEL_MAX_ROWS rows (prefill) run torch's fp32 GEMM on the rounded inputs (each product of two
# bf16 values is exact in fp32; torch's bf16 GEMM would round the outputs to bf16, which llama.cpp does not);
# fewer (decode batches) run the kernel's AVX-512 BF16 dot products where the build has them (fp32 sums;
# faster than the fp32 kernel at many rows: docs/benchmarks.md), else the fp32 kernel on the rounded inputs. llama.cpp's arithmetic class (it rounds the inputs of bf16 matmuls to bf16);
# opt-in, the exact fp32 path is the default. Set per forward by the model. Compiled decode steps keep
# the fp32 kernel: reading this ContextVar would break their graphs.
_gemm_precision: ContextVar[str] = ContextVar("moeswap_gemm_precision", default="fp32")


@contextmanager
def gemm_precision(precision: str):
    """Within this block, many-row CPU matmuls with bf16 weights run in `precision` (see above)."""
    if precision not in GEMM_PRECISIONS:
        raise ValueError(f"GEMM precision {precision!r}: expected one of {', '.join(GEMM_PRECISIONS)}")
    token = _gemm_precision.set(precision)
    try:
        yield
    finally:
        _gemm_precision.reset(token)


def gemm_in_bf16() -> bool:
    return _gemm_precision.get() == "bf16"
