"""expert_quant: routed experts computed straight from their block-FP8 or INT4 bytes (ops.expert's
FP8ExpertWeights and Int4ExpertWeights), as expert_mxfp4 does for MXFP4. For a kept expert `w`:
  reference    decode each matrix with the format's own decoder (formats/fp8_block.decode, formats/int4.decode),
               matmul: the oracle;
  rows_linear  x W^T decoding ~1 MB of W's rows at a time (the same decoder), for prefill (GEMM_MIN_TOKENS
               tokens or more), other devices, other scale dtypes and widths the kernel does not take;
  forward      csrc/quant.c (one call of the grouped kernel for the expert) for decode-sized inputs, else
               rows_linear; project_forward / project_backward for one matrix under autograd.
$MOESWAP_EXPERT_KERNEL other than cpu_c (expert_mxfp4's names) takes rows_linear, as it does for MXFP4.
The kernel's products are the decoder's weights; results differ from `reference` only in summation order,
and each (row, token) sum runs in one order whatever the batch. Shapes: T tokens, I expert input width,
F expert width, O/N one matrix's output/input width.
"""

from __future__ import annotations

import os

import torch

from moeswap.formats import fp8_block, int4
from moeswap.ops import cpu_kernels, kernel_experts
from moeswap.ops.activation import glu, glu_reference
from moeswap.ops.expert import is_fp8, kernel_kind
from moeswap.ops.expert import quant_parts as parts
from moeswap.ops.expert import quant_shape as shape
from moeswap.ops.expert_mxfp4 import ENV_KERNEL, GEMM_MIN_TOKENS
from moeswap.ops.kernel_abi import constant

ROW_CHUNK_BYTES = constant("ROW_CHUNK_BYTES")  # decoded fp32 bytes per chunk of rows_linear / project_backward


def group_kind(w) -> str | None:
    """"fp8" or "int4" where csrc/quant.c runs this expert (ops.expert.kernel_kind), else None."""
    return kernel_kind(w)


def kind(w) -> str:
    """The kernel's name for this form (cpu_kernels.FORMAT_CODES)."""
    return "fp8" if is_fp8(w) else "int4"


def decode_rows(w, proj: str, r0: int, r1: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows [r0, r1) of one matrix as `dtype` (through fp32, which holds every decoded weight exactly); FP8: r0 a
    multiple of the 128-row block."""
    q, s = parts(w, proj)
    if is_fp8(w):
        rows = fp8_block.BLOCK[0]
        out = fp8_block.decode(q[r0:r1], s[r0 // rows : -(-r1 // rows)], fp8_block.BLOCK, torch.float32)
    else:
        out = int4.decode(q[r0:r1], s[r0:r1], (r1 - r0, shape(w, proj)[1]), torch.float32)
    return out if dtype == torch.float32 else out.to(dtype)


def weight(w, proj: str, dtype: torch.dtype) -> torch.Tensor:
    return decode_rows(w, proj, 0, shape(w, proj)[0], dtype)


def _chunk(w, proj: str) -> int:
    rows = max(1, ROW_CHUNK_BYTES // (shape(w, proj)[1] * 4))
    if is_fp8(w):  # whole scale blocks
        rows = -(-rows // fp8_block.BLOCK[0]) * fp8_block.BLOCK[0]
    return rows


def reference(w, x_TI: torch.Tensor, act: str, situ_betas: tuple[float, float]) -> torch.Tensor:
    """Decode every matrix (the format's decoder, fp32), cast to x's dtype, multiply: what all paths match."""
    h_TF = glu_reference(act, x_TI @ weight(w, "w1", x_TI.dtype).T, x_TI @ weight(w, "w3", x_TI.dtype).T, situ_betas)
    return h_TF @ weight(w, "w2", x_TI.dtype).T


def rows_linear(w, proj: str, x: torch.Tensor) -> torch.Tensor:
    """x @ W^T decoding a chunk of W's rows at a time into the output's columns (any float x)."""
    O = shape(w, proj)[0]
    out = torch.empty(*x.shape[:-1], O, dtype=x.dtype, device=x.device)
    step = _chunk(w, proj)
    for r in range(0, O, step):
        chunk = decode_rows(w, proj, r, min(O, r + step), x.dtype).to(x.device)
        out[..., r : r + step] = torch.matmul(x, chunk.T)
    return out


def project_backward(w, proj: str, dy: torch.Tensor) -> torch.Tensor:
    """dy @ W, W decoded a chunk of rows at a time."""
    O, N = shape(w, proj)
    dy_PO = dy.reshape(-1, O)
    dx = torch.zeros(dy_PO.shape[0], N, dtype=dy.dtype, device=dy.device)
    step = _chunk(w, proj)
    for r in range(0, O, step):
        dx.addmm_(dy_PO[:, r : r + step], decode_rows(w, proj, r, min(O, r + step), dy.dtype).to(dy.device))
    return dx.reshape(*dy.shape[:-1], N)


def _kernel(w, x: torch.Tensor):
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not (0 < rows < GEMM_MIN_TOKENS and x.is_cpu and x.dtype in (torch.float32, torch.bfloat16)):
        return None
    if kernel_kind(w) is None or os.environ.get(ENV_KERNEL) not in (None, "", "cpu_c"):
        return None  # MOESWAP_EXPERT_KERNEL=torch_rows or reference: the decoding path, as for MXFP4
    return cpu_kernels.kernel()


def forward(w, x_TI: torch.Tensor, act: str, situ_betas: tuple[float, float]) -> torch.Tensor:
    """w2 act(w1 x, w3 x): the C kernel for decode-sized inputs, else rows_linear (inference, no autograd)."""
    kernel = _kernel(w, x_TI)
    if kernel is None:
        h_TF = glu(act, rows_linear(w, "w1", x_TI), rows_linear(w, "w3", x_TI), situ_betas)
        return rows_linear(w, "w2", h_TF)
    x32 = x_TI.reshape(-1, x_TI.shape[-1]).to(torch.float32).contiguous()
    T = x32.shape[0]
    y = torch.zeros_like(x32)
    kernel_experts.moe(kernel, x32, [w], torch.arange(T, dtype=torch.int64), [0, T], torch.ones(T), act, situ_betas, y)
    return y.to(x_TI.dtype).reshape(x_TI.shape)


def project_forward(w, proj: str, x: torch.Tensor) -> torch.Tensor:
    """x @ W^T for one matrix, without autograd: the C kernel for decode-sized inputs, else rows_linear."""
    kernel = _kernel(w, x)
    if kernel is None:
        return rows_linear(w, proj, x)
    q, s = parts(w, proj)
    x32 = x.reshape(-1, x.shape[-1]).to(torch.float32).contiguous()
    y = kernel.quant_linear(kind(w), x32, q if q.is_contiguous() else q.contiguous(), s.contiguous())
    return y.to(x.dtype).reshape(*x.shape[:-1], q.shape[0])
