"""Kimi Delta Attention layer: projections, short convolutions, decay/beta gates, gated output norm.

The core recurrence lives in ops.kda (chunked for prefill, token recurrence for decode; flash-linear-attention's
kernels on CUDA where it is installed, ops.kda.fla_selected); CPU inference
runs the layer between its projections in one C call (cpu_kernels.kda_layer), prefill and decode alike.
Per-sequence state: KDAState (fp32 recurrent state + the last K-1 conv inputs); constant in length.
Shapes: B batch, T tokens, D model width, H heads, K head dim, W conv width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moeswap.config import ModelConfig
from moeswap.models.layers.basic import WeightOnly, derived, fuse_linears, project, records_graph, rms_norm
from moeswap.ops import cpu_kernels
from moeswap.ops.kda import L2_EPS, fla_selected, kda_chunked, kda_decode_step, kda_fla, kda_for_training, l2_normalize


@dataclass
class KDAState:
    recurrent_BHKK: torch.Tensor  # fp32
    conv_BWC: torch.Tensor  # last W-1 inputs of the q, k and v convs, concatenated on channels

    @staticmethod
    def zeros(batch: int, H: int, K: int, W: int, dtype: torch.dtype, device) -> "KDAState":
        return KDAState(
            torch.zeros(batch, H, K, K, dtype=torch.float32, device=device),
            torch.zeros(batch, W - 1, 3 * H * K, dtype=dtype, device=device),
        )


def causal_conv_silu_reference(x_BTC: torch.Tensor, history_BWC: torch.Tensor, weight_C1W: torch.Tensor) -> torch.Tensor:
    """silu(depthwise causal conv) over [history | x]; history holds the previous W-1 inputs."""
    full = torch.cat([history_BWC, x_BTC], dim=1).transpose(1, 2)  # [B, C, W-1+T]
    y = F.conv1d(full, weight_C1W.to(full.dtype), groups=full.shape[1])
    return F.silu(y).transpose(1, 2)


def causal_conv_silu(x_BTC: torch.Tensor, history_BWC: torch.Tensor, weight_C1W: torch.Tensor) -> torch.Tensor:
    """Same as `causal_conv_silu_reference`, as W shifted multiply-adds over [B, T, C]. A depthwise
    conv1d goes through oneDNN on CPU, which costs more than the layer's projections for one decode token
    (docs/benchmarks.md); this takes microseconds."""
    return conv_taps_silu(x_BTC, history_BWC, weight_C1W[:, 0, :].T)[0]


def conv_taps_silu(x_BTC: torch.Tensor, history_BWC: torch.Tensor, taps_WC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`causal_conv_silu` with the kernel as taps [W, C]; also returns [history | x] (the next history's source)."""
    W, T = taps_WC.shape[0], x_BTC.shape[1]
    full = torch.cat([history_BWC, x_BTC], dim=1)  # [B, W-1+T, C]
    taps_WC = taps_WC.to(full.dtype)
    y = full[:, 0:T] * taps_WC[0]
    for j in range(1, W):
        y.addcmul_(full[:, j:j + T], taps_WC[j])
    return F.silu(y), full


class KDA(nn.Module):
    def __init__(self, cfg: ModelConfig, device=None):
        super().__init__()
        d, H, K = cfg.hidden_size, cfg.kda.num_heads, cfg.kda.head_dim
        self.H, self.K, self.W = H, K, cfg.kda.conv_kernel
        self.lower_bound = cfg.kda.gate_lower_bound
        self.eps = cfg.rms_norm_eps
        lin = lambda i, o: nn.Linear(i, o, bias=False, device=device)  # noqa: E731
        self.q_proj, self.k_proj, self.v_proj = lin(d, H * K), lin(d, H * K), lin(d, H * K)
        self.q_conv1d = WeightOnly(H * K, 1, self.W, device=device)
        self.k_conv1d = WeightOnly(H * K, 1, self.W, device=device)
        self.v_conv1d = WeightOnly(H * K, 1, self.W, device=device)
        self.f_a_proj, self.f_b_proj = lin(d, K), lin(K, H * K)
        self.b_proj = lin(d, H)
        self.A_log = nn.Parameter(torch.zeros(H, device=device))
        self.dt_bias = nn.Parameter(torch.zeros(H * K, device=device))
        if cfg.kda.full_rank_gate:
            self.g_proj = lin(d, H * K)
        else:
            self.g_a_proj, self.g_b_proj = lin(d, K), lin(K, H * K)
        self.o_norm = WeightOnly(K, device=device)
        self.o_proj = lin(H * K, d)

    def input_projections(self) -> tuple[str, ...]:
        """The projections that read the layer input x (fused into one matmul by `fuse_projections`)."""
        gate = ("g_proj",) if hasattr(self, "g_proj") else ("g_a_proj",)
        return ("q_proj", "k_proj", "v_proj", "f_a_proj", "b_proj") + gate

    def fuse_projections(self) -> None:
        fuse_linears(self, self.input_projections())

    def conv_taps(self) -> torch.Tensor:
        """The q, k and v conv kernels as one [W, 3 H K] tap matrix (kept between steps)."""
        convs = (self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight)
        return derived(self, "conv_taps", lambda: torch.cat(convs)[:, 0, :].T.contiguous(), *convs)

    def decay_rate(self) -> torch.Tensor:
        """exp(A_log) per head, fp32 (kept between steps)."""
        return derived(self, "decay_rate", lambda: self.A_log.float().exp(), self.A_log)

    def decay(self, x_BTD: torch.Tensor, f_a_BTK: torch.Tensor | None = None) -> torch.Tensor:
        """Log retention g per head and key channel, [B, T, H, K], in fp32."""
        f_a_BTK = self.f_a_proj(x_BTD) if f_a_BTK is None else f_a_BTK
        dt_bias = derived(self, "dt_bias", self.dt_bias.float, self.dt_bias)
        z = (self.f_b_proj(f_a_BTK).float() + dt_bias).unflatten(-1, (self.H, self.K))
        a = self.decay_rate()[:, None]
        if self.lower_bound is not None:  # K3: bounded to (lower_bound, 0)
            return self.lower_bound * torch.sigmoid(a * z)
        return -a * F.softplus(z)  # Kimi Linear: unbounded

    def output_gate(self, x_BTD: torch.Tensor, g_in: torch.Tensor | None = None) -> torch.Tensor:
        """g_in: g_proj(x) (K3) or g_a_proj(x) (Kimi Linear) when already computed."""
        if hasattr(self, "g_proj"):
            return self.g_proj(x_BTD) if g_in is None else g_in
        return self.g_b_proj(self.g_a_proj(x_BTD) if g_in is None else g_in)

    def _fits_fused_kernel(self, x_BTD: torch.Tensor, state: KDAState) -> bool:
        return (x_BTD.dtype == state.conv_BWC.dtype == state.recurrent_BHKK.dtype == torch.float32
                and state.conv_BWC.is_contiguous() and state.recurrent_BHKK.is_contiguous())

    def _fused(self, kernel, x_BTD, state: KDAState, qkv_BTC, f_a, b_in, g_in) -> torch.Tensor:
        """The layer between its projections in one C call (cpu_kernels.kda_layer), for a decode token
        or a prefill chunk: the same math as the general path below without its ~40 torch ops, and the
        token recurrence instead of the chunked form (the same result to fp32 rounding)."""
        B, T, _ = x_BTD.shape
        rows = lambda t: t.reshape(B, T, -1).float().contiguous()  # noqa: E731
        # the kernel's weight-derived inputs in one kept lookup (four lookups cost a layer's decode step time)
        weights = (self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight, self.dt_bias, self.A_log,
                   self.o_norm.weight)
        taps, dt_bias, rate, o_norm = derived(
            self, "kernel_inputs",
            lambda: (self.conv_taps(), self.dt_bias.float(), self.decay_rate(), self.o_norm.weight.float()), *weights)
        y = kernel.kda_layer(rows(qkv_BTC), state.conv_BWC, taps, rows(self.f_b_proj(f_a)), dt_bias, rate,
                             self.lower_bound, rows(b_in), state.recurrent_BHKK, rows(self.output_gate(x_BTD, g_in)),
                             o_norm, self.eps, self.K**-0.5, L2_EPS)
        return self.o_proj(y.to(x_BTD.dtype))

    def forward(self, x_BTD: torch.Tensor, state: KDAState | None = None) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        if state is None:
            state = KDAState.zeros(B, self.H, self.K, self.W, x_BTD.dtype, x_BTD.device)
        q_in, k_in, v_in, f_a, b_in, g_in = project(self, x_BTD, self.input_projections())
        qkv_BTC = torch.cat([q_in, k_in, v_in], dim=-1)
        # under autograd (a LoRA in this layer, an input that requires grad) the fused C call would cut the
        # graph, even where x itself needs no grad: the torch path below then runs instead
        grad = records_graph(self, x_BTD, state.recurrent_BHKK, state.conv_BWC)
        kernel = None if grad else cpu_kernels.for_inference(x_BTD, state.recurrent_BHKK, state.conv_BWC)
        if kernel is not None and self._fits_fused_kernel(x_BTD, state):
            return self._fused(kernel, x_BTD, state, qkv_BTC, f_a, b_in, g_in)
        conv_BTC, full_BTC = conv_taps_silu(qkv_BTC, state.conv_BWC, self.conv_taps())
        # State is updated in place: it may be a view into an engine's preallocated batch buffers.
        state.conv_BWC.copy_(full_BTC[:, -(self.W - 1):])
        q, k, v = (t.unflatten(-1, (self.H, self.K)).float() for t in conv_BTC.chunk(3, dim=-1))
        beta_BTH = torch.sigmoid(b_in.float())
        g_BTHK = self.decay(x_BTD, f_a)
        if not grad and fla_selected(state.recurrent_BHKK):  # flash-linear-attention's kernels on CUDA
            o_BTHK = kda_fla(q, k, v, g_BTHK, beta_BTH, state.recurrent_BHKK, self.K**-0.5)
        elif T == 1:  # q and k are normalised inside (one fused CPU kernel where it runs)
            o_BTHK = kda_decode_step(q, k, v, g_BTHK, beta_BTH, state.recurrent_BHKK, self.K**-0.5)
        else:
            q, k = l2_normalize(q) * self.K**-0.5, l2_normalize(k)
            # autograd keeps the initial state for backward, and the state is overwritten below: a copy
            S0_BHKK = state.recurrent_BHKK.clone() if grad else state.recurrent_BHKK
            run = kda_for_training if grad else kda_chunked
            o_BTHK, S_BHKK = run(q, k, v, g_BTHK, beta_BTH, S0_BHKK)
            state.recurrent_BHKK.copy_(S_BHKK)
        gate = self.output_gate(x_BTD, g_in).unflatten(-1, (self.H, self.K)).float()
        y = rms_norm(o_BTHK, self.o_norm.weight, self.eps) * torch.sigmoid(gate)
        return self.o_proj(y.flatten(-2).to(x_BTD.dtype))

