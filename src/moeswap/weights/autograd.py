"""Autograd through frozen routed experts (no weight gradients): `project` (x W^T of one projection: the
format's fast forward, its backward dx = dy W decoded in row chunks), `train_forward` (an expert from three
`project`s, plus adapters), `frozen_group` / `frozen_moe` (a layer step's frozen float experts without
adapters as one node, bf16 products on the stored weights in C: cpu_kernels.bf16_gemm). `Held` is how a
graph keeps an expert. Shapes: T tokens, I expert input width, F expert width, P (token, expert) pairs.
"""

from __future__ import annotations

import itertools

import torch

from moeswap.ops import cpu_kernels
from moeswap.ops.activation import glu, glu_reference
from moeswap.ops.expert import ExpertWeights
from moeswap.weights.format import Adapter
from moeswap.weights.registry import format_of


class Held:
    """An expert as an autograd graph keeps it for its backward: `get()` gives the weights. This one holds
    them; an expert store hands out its own kind (experts.store), which lets go when the store evicts the
    expert and fetches it again for the backward, so a graph never holds bytes the store's budget does not
    count."""

    __slots__ = ("w",)

    def __init__(self, w):
        self.w = w

    def get(self):
        return self.w


class _Project(torch.autograd.Function):
    """y = x W^T for one projection of a frozen expert: no gradient for W, which only `held` keeps."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, held, proj: str) -> torch.Tensor:
        ctx.held, ctx.proj = held, proj
        w = held.get()
        return format_of(w).project_forward(w, proj, x)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        w = ctx.held.get()
        return format_of(w).project_backward(w, ctx.proj, dy.contiguous()), None, None


def project(held, proj: str, x: torch.Tensor) -> torch.Tensor:
    """x W_proj^T for a held expert (see Held), differentiable in x."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _Project.apply(x, held, proj)
    w = held.get()
    return format_of(w).project_forward(w, proj, x)


def train_forward(held, x_TI: torch.Tensor, act: str, situ_betas: tuple[float, float],
                  adapter: Adapter | None = None) -> torch.Tensor:
    """w2 act(w1 x, w3 x) as three `project`s and the activation in torch ops, so autograd sees it all;
    `adapter(proj, input)` (LoRA) returns what to add to that projection's output, or None."""

    def proj(name: str, inp: torch.Tensor) -> torch.Tensor:
        y = project(held, name, inp)
        delta = adapter(name, inp) if adapter is not None else None
        return y if delta is None else y + delta.to(y.dtype)

    h_TF = glu(act, proj("w1", x_TI), proj("w3", x_TI), situ_betas)
    return proj("w2", h_TF)


GROUP_WIDE_BYTES = 64 << 20  # one expert's widened weights `frozen_group` holds at once, at most (torch path)


def groupable(w, x: torch.Tensor) -> bool:
    """Whether `frozen_group` takes this kept expert with inputs like x: a decoded (float) expert whose weights
    widened to x's dtype would fit GROUP_WIDE_BYTES (where `_direct` they are not widened at all), under fp32
    or float64 x on the same device."""
    if not isinstance(w, ExpertWeights) or not x.dtype.is_floating_point or x.dtype.itemsize < 4:
        return False
    return w.w1_FI.device == x.device and 3 * w.w1_FI.numel() * x.element_size() <= GROUP_WIDE_BYTES


def frozen_group(helds: list, x_PI: torch.Tensor, counts: list[int], act: str,
                 situ_betas: tuple[float, float]) -> torch.Tensor:
    """`train_forward` without adapters for consecutive experts' pairs (x_PI: each expert's rows in turn,
    counts[i] of them for helds[i], all `groupable`): [P, I], differentiable in x_PI, as one autograd node
    (`_FrozenGroup`) instead of four per expert."""
    if not helds:
        return x_PI.new_zeros(0, x_PI.shape[-1])
    return _FrozenGroup.apply(x_PI, tuple(helds), tuple(counts), act, situ_betas)


class _Widened:
    """An expert's three matrices as the products (`_xwT`, `_dyW`) take them: as kept where they already are
    in the compute dtype or `_direct`, else widened into buffers reused from expert to expert (no allocation
    per call)."""

    FIELDS = ("w1_FI", "w3_FI", "w2_IF")

    def __init__(self, dtype: torch.dtype, device):
        self.dtype, self.device = dtype, device
        self.bufs: dict[str, torch.Tensor] = {}

    def get(self, w) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1 [F, I], w3 [F, I], w2 [I, F]) of expert w."""
        return tuple(self._one(f, getattr(w, f)) for f in self.FIELDS)

    def each(self, helds):
        """(w1, w3, w2) of each held expert in turn (fetched again where the store let it go), widened
        into the same buffers: use each before asking for the next."""
        for held in helds:
            w = held.get()
            mats = self.get(w)
            del w
            yield mats

    def _one(self, field: str, t: torch.Tensor) -> torch.Tensor:
        if t.dtype == self.dtype or _direct(t, self.dtype):
            return t
        buf = self.bufs.get(field)
        if buf is None or buf.shape != t.shape:
            buf = self.bufs[field] = torch.empty(t.shape, dtype=self.dtype, device=self.device)
        return buf.copy_(t)


def _direct(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the products take weight t as stored: bf16 on the CPU under fp32 math, where the C kernel is
    (csrc/gemm_bf16.c widens it panel by panel inside the GEMM: no fp32 copy of the weights)."""
    return t.dtype == torch.bfloat16 and dtype == torch.float32 and t.is_cpu and cpu_kernels.kernel() is not None


def _xwT(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = x w^T (w [O, N] from `_Widened`): torch's GEMM on weights in x's dtype, else the bf16 kernel."""
    if w.dtype == x.dtype:
        return torch.mm(x, w.T, out=out)
    return cpu_kernels.kernel().bf16_gemm(x, w, trans=True, out=out)


def _dyW(dy: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, accumulate: bool = False
         ) -> torch.Tensor:
    """dy w (w [O, N] from `_Widened`) into out (accumulate: out += dy w) or a new tensor, as `_xwT` chooses."""
    if w.dtype == dy.dtype:
        if accumulate:
            return out.addmm_(dy, w)
        return torch.mm(dy, w) if out is None else torch.mm(dy, w, out=out)
    return cpu_kernels.kernel().bf16_gemm(dy, w, trans=False, out=out, accumulate=accumulate)


def _glu_products(x, w1, w3, w2, gate_out, up_out, y_out, act: str, situ_betas) -> torch.Tensor:
    """w2 act(w1 x, w3 x) into y_out, the pre-activations into gate_out and up_out (kept for backward)."""
    _xwT(x, w1, gate_out)
    _xwT(x, w3, up_out)
    return _xwT(glu(act, gate_out, up_out, situ_betas), w2, y_out)


def _step_buffers(like: torch.Tensor, P: int, w1: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A layer step's gate and up pre-activations [P, F] and outputs [P, I] for P pairs, like `like`."""
    return like.new_empty(P, w1.shape[0]), like.new_empty(P, w1.shape[0]), like.new_empty(P, w2.shape[0])


def _glu_grads(gate, up, dh, act: str, situ_betas) -> tuple[torch.Tensor, torch.Tensor]:
    """(d gate, d up) of glu(act, gate, up) from d of its output: the C kernel on fp32 CPU rows, else
    torch's own derivative of the plain activation (float64 gradient checks)."""
    kernel = cpu_kernels.kernel() if gate.dtype == torch.float32 and gate.is_cpu else None
    if kernel is not None:
        return kernel.glu_backward(gate, up, dh, act, situ_betas)
    with torch.enable_grad():
        g, u = gate.detach().requires_grad_(), up.detach().requires_grad_()
        return torch.autograd.grad(glu_reference(act, g, u, situ_betas), (g, u), dh)


class _FrozenGroup(torch.autograd.Function):
    """w2 act(w1 x, w3 x) for consecutive frozen float experts as one node: per expert (fetched once a
    pass, as `train_forward`'s projections fetch it) the gate, up and down products and the activation,
    written into whole-step outputs (contiguous rows: the activation kernels need no copies). Keeps the
    gate and up pre-activations (as GLUFunction does) and the held experts; backward per expert:
    dh = dy W2, (dg, du) from the activation, dx = dg W1 + du W3, on the weights as `_Widened` gives them
    again (bf16 ones as stored: `_xwT`, `_dyW`)."""

    @staticmethod
    def forward(ctx, x_PI, helds, counts, act, situ_betas):
        wide = _Widened(x_PI.dtype, x_PI.device)
        gate_PF = up_PF = y_PI = None
        starts = list(itertools.accumulate(counts, initial=0))
        for i, (w1, w3, w2) in enumerate(wide.each(helds)):
            lo, hi = starts[i], starts[i + 1]
            if gate_PF is None:
                gate_PF, up_PF, y_PI = _step_buffers(x_PI, x_PI.shape[0], w1, w2)
            _glu_products(x_PI[lo:hi], w1, w3, w2, gate_PF[lo:hi], up_PF[lo:hi], y_PI[lo:hi], act, situ_betas)
        ctx.save_for_backward(gate_PF, up_PF)
        ctx.helds, ctx.starts, ctx.act, ctx.situ_betas = helds, starts, act, situ_betas
        return y_PI

    @staticmethod
    def backward(ctx, dy_PI):
        gate_PF, up_PF = ctx.saved_tensors
        dy_PI = dy_PI.contiguous()
        wide = _Widened(dy_PI.dtype, dy_PI.device)
        dx_PI = torch.empty_like(dy_PI)
        for i, (w1, w3, w2) in enumerate(wide.each(ctx.helds)):
            lo, hi = ctx.starts[i], ctx.starts[i + 1]
            dh = _dyW(dy_PI[lo:hi], w2)
            dg, du = _glu_grads(gate_PF[lo:hi], up_PF[lo:hi], dh, ctx.act, ctx.situ_betas)
            dx = _dyW(dg, w1, out=dx_PI[lo:hi])
            _dyW(du, w3, out=dx, accumulate=True)
        return dx_PI, None, None, None, None


def frozen_moe(helds: list, h_TI: torch.Tensor, token_of: torch.Tensor, weights: torch.Tensor, counts: list[int],
               act: str, situ_betas: tuple[float, float]) -> torch.Tensor:
    """A layer step's routed output when every expert is `groupable` without adapters: each token's pairs'
    `frozen_group` outputs times their routing weights, added from zero in pair order (models.layers.moe's
    combine_pairs, the same bits) — [T, I], differentiable in h_TI and weights, as one autograd node that
    gathers and scatters each expert's rows itself (no [P, I] copies of the inputs or outputs)."""
    return _FrozenMoE.apply(h_TI, weights, token_of, tuple(helds), tuple(counts), act, situ_betas)


class _FrozenMoE(torch.autograd.Function):
    """`frozen_moe`: _FrozenGroup's per-expert products with the gather, routing weights and sum inside.
    Keeps gate, up and each pair's unweighted output (the weights' gradient is dy · y)."""

    @staticmethod
    def forward(ctx, h_TI, weights, token_of, helds, counts, act, situ_betas):
        wide = _Widened(h_TI.dtype, h_TI.device)
        P = token_of.shape[0]
        w_P1 = weights.to(h_TI.dtype)[:, None]
        out_TI = torch.zeros_like(h_TI)
        gate_PF = up_PF = y_PI = None
        starts = list(itertools.accumulate(counts, initial=0))
        for i, (w1, w3, w2) in enumerate(wide.each(helds)):
            lo, hi = starts[i], starts[i + 1]
            if gate_PF is None:
                gate_PF, up_PF, y_PI = _step_buffers(h_TI, P, w1, w2)
            rows = token_of[lo:hi]
            y = _glu_products(h_TI.index_select(0, rows), w1, w3, w2, gate_PF[lo:hi], up_PF[lo:hi], y_PI[lo:hi],
                              act, situ_betas)
            out_TI.index_add_(0, rows, y * w_P1[lo:hi])
        ctx.save_for_backward(gate_PF, up_PF, y_PI, w_P1, token_of)
        ctx.helds, ctx.starts, ctx.act, ctx.situ_betas, ctx.w_dtype = helds, starts, act, situ_betas, weights.dtype
        return out_TI

    @staticmethod
    def backward(ctx, dout_TI):
        gate_PF, up_PF, y_PI, w_P1, token_of = ctx.saved_tensors
        dout_TI = dout_TI.contiguous()
        wide = _Widened(dout_TI.dtype, dout_TI.device)
        dh_TI = torch.zeros_like(dout_TI)
        dw_P = dout_TI.new_empty(token_of.shape[0])
        for i, (w1, w3, w2) in enumerate(wide.each(ctx.helds)):
            lo, hi = ctx.starts[i], ctx.starts[i + 1]
            rows = token_of[lo:hi]
            dc = dout_TI.index_select(0, rows)  # d (weighted output) of each pair
            torch.sum(dc * y_PI[lo:hi], 1, out=dw_P[lo:hi])
            dh = _dyW(dc.mul_(w_P1[lo:hi]), w2)
            dg, du = _glu_grads(gate_PF[lo:hi], up_PF[lo:hi], dh, ctx.act, ctx.situ_betas)
            dh_TI.index_add_(0, rows, _dyW(du, w3, out=_dyW(dg, w1), accumulate=True))
        return dh_TI, dw_P.to(ctx.w_dtype), None, None, None, None, None
