"""Gated activations of the MLPs and experts: SwiGLU and K3's SiTU-GLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeswap.ops import cpu_kernels


def glu(act: str, gate: torch.Tensor, up: torch.Tensor, situ_betas: tuple[float, float] = (4.0, 25.0)) -> torch.Tensor:
    """act(gate) * up. SiTU soft-caps both halves: b1 tanh(g/b1) sigmoid(g) * b2 tanh(u/b2).

    Without autograd: SiTU on fp32 CPU tensors is one pass of the C kernel (5x torch's nine; within a
    few ulp of them, and the same bits for any shape, so batching changes nothing); otherwise the same
    torch operations run in place, bit-identical to `glu_reference` with fewer temporaries. Under
    autograd on fp32 CPU tensors: `GLUFunction` (that kernel forward, one C pass backward, only the
    inputs kept)."""
    grad = torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)
    if grad and act in ("silu", "situ") and gate.shape == up.shape and _fits_kernel(gate, up):
        return GLUFunction.apply(gate, up, act, situ_betas)
    in_place = gate.shape == up.shape and not grad
    if not in_place or act not in ("silu", "situ"):
        return glu_reference(act, gate, up, situ_betas)
    if act == "silu":
        return F.silu(gate).mul_(up)  # torch's silu is already one pass
    if gate.dtype == up.dtype == torch.float32 and gate.device.type == up.device.type == "cpu":
        kernel = cpu_kernels.kernel()
        if kernel is not None:
            return kernel.glu(gate, up, act, situ_betas)
    b1, b2 = situ_betas
    h = torch.div(gate, b1).tanh_().mul_(b1).mul_(torch.sigmoid(gate))
    return h.mul_(torch.div(up, b2).tanh_().mul_(b2))


def glu_reference(act: str, gate: torch.Tensor, up: torch.Tensor,
                  situ_betas: tuple[float, float] = (4.0, 25.0)) -> torch.Tensor:
    """`glu` written plainly (and the autograd path)."""
    if act == "silu":
        return F.silu(gate) * up
    if act == "situ":
        b1, b2 = situ_betas
        return (b1 * torch.tanh(gate / b1) * torch.sigmoid(gate)) * (b2 * torch.tanh(up / b2))
    raise ValueError(f"unknown activation {act!r}")


def _fits_kernel(gate: torch.Tensor, up: torch.Tensor) -> bool:
    return (gate.dtype == up.dtype == torch.float32 and gate.device.type == up.device.type == "cpu"
            and cpu_kernels.kernel() is not None)


class GLUFunction(torch.autograd.Function):
    """`glu` under autograd on the CPU: the C forward, and a C backward that recomputes the activation's
    parts from the saved inputs (torch's version keeps ~6 intermediates per element and runs ~15 passes)."""

    @staticmethod
    def forward(ctx, gate, up, act, situ_betas):
        ctx.save_for_backward(gate, up)
        ctx.act, ctx.situ_betas = act, situ_betas
        return cpu_kernels.kernel().glu(gate, up, act, situ_betas)

    @staticmethod
    def backward(ctx, d_out):
        gate, up = ctx.saved_tensors
        dg, du = cpu_kernels.kernel().glu_backward(gate, up, d_out, ctx.act, ctx.situ_betas)
        return dg, du, None, None
