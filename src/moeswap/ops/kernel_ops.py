"""kernel_ops: the C kernels as torch ops (torch.library), for torch.compile: a ctypes call breaks a compiled
graph, an op does not. Eager code calls the CpuKernels methods directly (an op call costs more); compiled
code calls torch.ops.moeswap.*. Registered when ops.cpu_kernels is imported; each op loads the kernel through
it (a plain-torch answer where the kernel cannot be built, for bf16_linear).
"""

from __future__ import annotations

import torch


def _kernel():
    from moeswap.ops import cpu_kernels  # (the entry module imports this one to register the ops)

    return cpu_kernels.kernel()


@torch.library.custom_op("moeswap::bf16_linear", mutates_args=())
def bf16_linear_op(x_TI: torch.Tensor, w_OI: torch.Tensor) -> torch.Tensor:
    k = _kernel()
    return k.bf16_linear(x_TI, w_OI) if k is not None else torch.nn.functional.linear(x_TI, w_OI.float())


@bf16_linear_op.register_fake
def _(x_TI, w_OI):
    return x_TI.new_empty(x_TI.shape[0], w_OI.shape[0])


@torch.library.custom_op("moeswap::kda_decode", mutates_args=("state_NKV",))
def kda_decode_op(q_NK: torch.Tensor, k_NK: torch.Tensor, v_NV: torch.Tensor, g_NK: torch.Tensor,
                  beta_N: torch.Tensor, state_NKV: torch.Tensor, scale: float, eps: float) -> torch.Tensor:
    return _kernel().kda_decode(q_NK, k_NK, v_NV, g_NK, beta_N, state_NKV, scale, eps)


@kda_decode_op.register_fake
def _(q_NK, k_NK, v_NV, g_NK, beta_N, state_NKV, scale, eps):
    return v_NV.new_empty(v_NV.shape)
