"""Multi-head latent attention (MLA) with a latent cache: gated NoPE (Kimi) or with a rotary shared key
(DeepSeek-V3 / Kimi K2: RoPE with YaRN, models/layers/rope.py).

The cache keeps, per token, the normalised latent c_kv (L) and the shared key slice k_r (R; rotated at its
position when the layer has RoPE, as are the queries' R dims): the per-head keys and values are never cached,
and the attention below is the same with or without RoPE. Attention runs in the absorbed form (queries are
mapped into the latent space through kv_b_proj), which is exact and reads only L+R values per cached token.
Shapes: B batch, T new tokens, S cached+new tokens, H heads, N nope dim, R shared-key dim, V value dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moeswap.config import ModelConfig
from moeswap.models.layers.basic import RMSNorm, derived, fuse_linears, project, records_graph
from moeswap.models.layers.rope import Rotary
from moeswap.ops import cpu_kernels
from moeswap.weights.dense import weight_sources, weight_values


@dataclass
class MLACache:
    latent_BSX: torch.Tensor  # [B, capacity, L + R]
    lengths_B: torch.Tensor  # int64, tokens cached per sequence
    # Host-side max(lengths_B) when the owner knows it (engine), so a step needs no device->host read;
    # None: read it from lengths_B.
    max_length: int | None = None
    # True: a step attends over the whole buffer, masked by lengths_B, and writes its rows at lengths_B: no host
    # read of a length and no growth, so that a CUDA graph can capture it (engine/cuda_graph.py)
    whole: bool = False

    @staticmethod
    def empty(batch: int, width: int, dtype: torch.dtype, device, capacity: int = 64) -> "MLACache":
        return MLACache(
            torch.zeros(batch, capacity, width, dtype=dtype, device=device),
            torch.zeros(batch, dtype=torch.long, device=device),
        )

    def longest(self) -> int:
        if self.whole:
            return self.latent_BSX.shape[1]
        return self.max_length if self.max_length is not None else int(self.lengths_B.max())

    def reserve(self, T: int) -> int:
        """Grows the capacity (doubling) so that T more tokens fit; returns the longest length after them."""
        need = self.longest() + T
        if need > self.latent_BSX.shape[1]:
            B, cap, X = self.latent_BSX.shape
            grown = torch.zeros(B, max(need, 2 * cap), X, dtype=self.latent_BSX.dtype, device=self.latent_BSX.device)
            grown[:, :cap] = self.latent_BSX
            self.latent_BSX = grown
        return need

    def append(self, new_BTX: torch.Tensor) -> None:
        """Writes in place (latent rows and lengths) unless capacity must grow: the cache may be a
        view into an engine's preallocated buffers, which are sized so that it never grows. Under autograd
        the latent rows go into a new tensor instead (lengths still in place)."""
        B, T, _ = new_BTX.shape
        if self.whole:  # the owner made room; positions stay on the device (a scatter: no host read)
            pos_BT = self.lengths_B[:, None] + torch.arange(T, device=new_BTX.device)
            pos_BTX = pos_BT[..., None].expand(new_BTX.shape)
            self.latent_BSX.scatter_(1, pos_BTX, new_BTX.to(self.latent_BSX.dtype))
            self.lengths_B += T
            return
        need = self.reserve(T)
        if torch.is_grad_enabled() and (new_BTX.requires_grad or self.latent_BSX.requires_grad):
            # autograd may keep earlier rows of the cache for a backward pass: a new tensor, not a write
            pos_BT = self.lengths_B[:, None] + torch.arange(T, device=new_BTX.device)
            rows_B1 = torch.arange(B, device=new_BTX.device)[:, None]
            self.latent_BSX = self.latent_BSX.index_put((rows_B1, pos_BT), new_BTX.to(self.latent_BSX.dtype))
        elif B == 1 and self.max_length is not None:  # one sequence whose length the host knows: a slice
            self.latent_BSX[0, need - T:need] = new_BTX[0]
        else:
            pos_BT = self.lengths_B[:, None] + torch.arange(T, device=new_BTX.device)
            self.latent_BSX[torch.arange(B, device=new_BTX.device)[:, None], pos_BT] = new_BTX.to(self.latent_BSX.dtype)
        self.lengths_B += T
        self.max_length = need


class MLA(nn.Module):
    def __init__(self, cfg: ModelConfig, device=None):
        super().__init__()
        m, d = cfg.mla, cfg.hidden_size
        self.H, self.N, self.R, self.V, self.L = (
            m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank)
        lin = lambda i, o: nn.Linear(i, o, bias=False, device=device)  # noqa: E731
        q_width = self.H * (self.N + self.R)
        if m.q_lora_rank:
            self.q_a_proj = lin(d, m.q_lora_rank)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, cfg.rms_norm_eps, device)
            self.q_b_proj = lin(m.q_lora_rank, q_width)
        else:
            self.q_proj = lin(d, q_width)
        self.kv_a_proj_with_mqa = lin(d, self.L + self.R)
        self.kv_a_layernorm = RMSNorm(self.L, cfg.rms_norm_eps, device)
        self.kv_b_proj = lin(self.L, self.H * (self.N + self.V))
        if m.output_gate:
            self.g_proj = lin(d, self.H * self.V)
        self.o_proj = lin(self.H * self.V, d)
        self.scale = (self.N + self.R) ** -0.5
        self.rotary = Rotary(m.rope, self.R) if m.rope is not None else None
        if self.rotary is not None:
            self.scale *= self.rotary.softmax_factor  # YaRN's temperature (mscale^2)

    def cache_width(self) -> int:
        return self.L + self.R

    def input_projections(self) -> tuple[str, ...]:
        """The projections that read the layer input x (fused into one matmul by `fuse_projections`)."""
        q = ("q_proj",) if hasattr(self, "q_proj") else ("q_a_proj",)
        return q + ("kv_a_proj_with_mqa",) + (("g_proj",) if hasattr(self, "g_proj") else ())

    def fuse_projections(self) -> None:
        fuse_linears(self, self.input_projections())

    def queries(self, x_BTD: torch.Tensor, q_in: torch.Tensor | None = None) -> torch.Tensor:
        """q_in: q_proj(x) or q_a_proj(x) when already computed."""
        if hasattr(self, "q_proj"):
            return self.q_proj(x_BTD) if q_in is None else q_in
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BTD) if q_in is None else q_in))

    def absorbed_weights(self, dtype: torch.dtype, slot: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head for the absorbed form, in `dtype`: keys [H, N, L], values [H, L, V].
        slot: with served adapters (lora.multi.MultiLoRALinear), that adapter's update folded in (0: none)."""
        kv_b = self.kv_b_proj
        if slot:
            weight, sources = (lambda: kv_b.folded_weight_of(slot)), kv_b.fold_sources_of(slot)
        elif hasattr(kv_b, "folded_weight"):  # a LoRA wrapper (moeswap.lora): its update folded into the matrix
            weight, sources = kv_b.folded_weight, kv_b.fold_sources()
        else:
            weight, sources = (lambda: weight_values(kv_b)), weight_sources(kv_b)  # block FP8: decoded

        def split():
            w_HXL = weight().to(dtype).unflatten(0, (self.H, self.N + self.V))
            return w_HXL[:, : self.N].contiguous(), w_HXL[:, self.N:].transpose(1, 2).contiguous()

        return derived(self, f"absorbed_{dtype}" + (f"_slot{slot}" if slot else ""), split, *sources)

    def forward(self, x_BTD: torch.Tensor, cache: MLACache | None = None) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        if cache is None:
            cache = MLACache.empty(B, self.cache_width(), x_BTD.dtype, x_BTD.device, capacity=T)
        q_in, kv_in, *gate_in = project(self, x_BTD, self.input_projections())
        q_BTHX = self.queries(x_BTD, q_in).unflatten(-1, (self.H, self.N + self.R))
        q_nope_BTHN, q_r_BTHR = q_BTHX.split([self.N, self.R], dim=-1)
        c_kv, k_r = kv_in.split([self.L, self.R], dim=-1)
        if self.rotary is not None:  # new token t of sequence b sits at position lengths_b + t
            pos_BT = cache.lengths_B[:, None] + torch.arange(T, device=x_BTD.device)
            cos_BTF, sin_BTF = self.rotary.cos_sin(pos_BT, x_BTD.dtype)
            k_r = self.rotary.rotate(k_r, cos_BTF, sin_BTF)
            q_r_BTHR = self.rotary.rotate(q_r_BTHR, cos_BTF[:, :, None], sin_BTF[:, :, None])
            q_BTHX = torch.cat([q_nope_BTHN, q_r_BTHR], dim=-1)
        # one decode token on the CPU: the attention core in one C call (below); never under autograd, which
        # the call would cut (a LoRA in this layer, an input that requires grad)
        grad = records_graph(self, x_BTD, cache.latent_BSX)
        kernel = cpu_kernels.for_inference(x_BTD, cache.latent_BSX) if T == 1 and not grad else None
        if kernel is not None and not (x_BTD.dtype == cache.latent_BSX.dtype == torch.float32
                                       and cache.latent_BSX.is_contiguous()):
            kernel = None
        # a lone decode token sees the whole cache, unless that is the buffer's capacity (cache.whole)
        masked = kernel is None and (cache.whole or not (T == 1 and B == 1))
        past_B = cache.lengths_B.clone() if masked else None  # append updates lengths_B in place
        cache.append(torch.cat([self.kv_a_layernorm(c_kv), k_r], dim=-1))
        S = cache.longest()
        if not getattr(self.kv_b_proj, "foldable", True):
            return self._output(self._expanded(q_nope_BTHN, q_r_BTHR, cache, S, past_B), gate_in)

        # served adapters on kv_b_proj (lora.multi): each slot's rows with that adapter's absorbed weights
        by_slot = getattr(self.kv_b_proj, "slot_groups", None)
        groups = by_slot(B, x_BTD.device) if by_slot is not None else None
        if groups is not None and groups[0][1] is not None:
            out_BTHV = torch.empty(B, T, self.H * self.V, dtype=x_BTD.dtype, device=x_BTD.device)
            for slot, idx in groups:
                out_BTHV[idx] = self._absorbed(
                    self.absorbed_weights(x_BTD.dtype, slot), kernel, q_BTHX[idx], cache.latent_BSX[idx, :S],
                    cache.lengths_B[idx], S, masked, None if past_B is None else past_B[idx])
            return self._output(out_BTHV, gate_in)
        w = self.absorbed_weights(x_BTD.dtype, groups[0][0] if groups else 0)
        return self._output(self._absorbed(w, kernel, q_BTHX, cache.latent_BSX, cache.lengths_B, S, masked, past_B),
                            gate_in)

    def _absorbed(self, weights: tuple[torch.Tensor, torch.Tensor], kernel, q_BTHX: torch.Tensor,
                  cache_BSX: torch.Tensor, lengths_B: torch.Tensor, S: int, masked: bool,
                  past_B: torch.Tensor | None) -> torch.Tensor:
        """The attention in the absorbed form: queries mapped into the latent space score [c | k_r] rows in
        one product (the C kernel for a decode token on the CPU). Returns [B, T, H V]."""
        w_k_HNL, w_v_HLV = weights
        B, T = q_BTHX.shape[:2]
        dtype = q_BTHX.dtype
        if kernel is not None:
            return kernel.mla_decode(q_BTHX.reshape(B, self.H, self.N + self.R).contiguous(), cache_BSX,
                                     lengths_B, w_k_HNL, w_v_HLV, self.scale).view(B, 1, -1)
        q_nope_BTHN, q_r_BTHR = q_BTHX.split([self.N, self.R], dim=-1)
        q_lat_HML = q_nope_BTHN.reshape(B * T, self.H, self.N).transpose(0, 1) @ w_k_HNL  # M = B*T
        q_abs_BTHX = torch.cat([q_lat_HML.transpose(0, 1).reshape(B, T, self.H, self.L), q_r_BTHR], dim=-1)
        latent_BSX = cache_BSX[:, :S].to(dtype)
        scores_BQS = q_abs_BTHX.reshape(B, T * self.H, self.L + self.R) @ latent_BSX.transpose(1, 2)  # Q = T*H
        scores_BQS = scores_BQS.float().mul_(self.scale)
        if masked:
            # query t of sequence b sits at position past_b + t and sees keys 0..past_b + t
            visible_BTS = (torch.arange(S, device=q_BTHX.device)
                           <= (past_B[:, None] + torch.arange(T, device=q_BTHX.device))[..., None])
            scores_BQS = scores_BQS.view(B, T, self.H, S).masked_fill_(~visible_BTS[:, :, None], float("-inf"))
        probs_BQS = scores_BQS.view(B, T * self.H, S).softmax(dim=-1).to(dtype)
        ctx_HML = (probs_BQS @ latent_BSX[..., :self.L]).view(B * T, self.H, self.L).transpose(0, 1)
        return (ctx_HML @ w_v_HLV).transpose(0, 1).reshape(B, T, self.H * self.V)

    def _expanded(self, q_nope_BTHN: torch.Tensor, q_r_BTHR: torch.Tensor, cache: MLACache, S: int,
                  past_B: torch.Tensor | None) -> torch.Tensor:
        """The attention with per-head keys and values formed from every cached latent (kv_b_proj applied
        to each token), for a kv_b_proj whose output cannot be folded into one matrix: a LoRA with dropout
        on its input while training. The same result as the absorbed form otherwise (to rounding)."""
        B, T = q_nope_BTHN.shape[:2]
        dtype = q_nope_BTHN.dtype
        latent_BSX = cache.latent_BSX[:, :S].to(dtype)
        kv_BSHX = self.kv_b_proj(latent_BSX[..., :self.L]).unflatten(-1, (self.H, self.N + self.V))
        k_BSHN, v_BSHV = kv_BSHX.split([self.N, self.V], dim=-1)
        scores_BTHS = (torch.einsum("bthn,bshn->bths", q_nope_BTHN, k_BSHN)
                       + torch.einsum("bthr,bsr->bths", q_r_BTHR, latent_BSX[..., self.L:])).float() * self.scale
        if past_B is not None:  # query t of sequence b sees keys 0..past_b + t
            visible_BTS = (torch.arange(S, device=q_nope_BTHN.device)
                           <= (past_B[:, None] + torch.arange(T, device=q_nope_BTHN.device))[..., None])
            scores_BTHS = scores_BTHS.masked_fill(~visible_BTS[:, :, None], float("-inf"))
        probs_BTHS = scores_BTHS.softmax(dim=-1).to(dtype)
        return torch.einsum("bths,bshv->bthv", probs_BTHS, v_BSHV).reshape(B, T, self.H * self.V)

    def _output(self, out_BTHV: torch.Tensor, gate_in: list[torch.Tensor]) -> torch.Tensor:
        if gate_in:
            g = gate_in[0]
            kernel = cpu_kernels.for_inference(out_BTHV, g) if out_BTHV.shape[0] * out_BTHV.shape[1] <= 32 else None
            if kernel is not None and out_BTHV.dtype == g.dtype == torch.float32 and out_BTHV.is_contiguous():
                # decode: the C sigmoid, which the native decode step (engine/native_step.py) uses too
                return self.o_proj(kernel.sigmoid_gate(out_BTHV, g))
            out_BTHV = out_BTHV * torch.sigmoid(g)
        return self.o_proj(out_BTHV)
