"""The decoder every architecture builds (Kimi K3, Kimi Linear, DeepSeek-V3 / K2), its layers chosen by
ModelConfig's flags: KDA or MLA attention per layer (MLA NoPE or rotary), a dense MLP or a MoE, block
attention residuals when the config has them. Knows no checkpoint names (moeswap.archs does). Routed
experts are never parameters: MoE blocks ask the attached expert store.
Entry points: `DecoderModel(config, device=...)`, `.forward(tokens, state)`, `.make_state(batch)`.
Shapes: B batch, T tokens, D width, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from moeswap.config import ModelConfig
from moeswap.models.layers.attn_res import mix, score_vector
from moeswap.models.layers.basic import GatedMLP, RMSNorm, WeightOnly, embedding_dtype
from moeswap.models.layers.kda import KDA, KDAState
from moeswap.models.layers.mla import MLA, MLACache
from moeswap.models.layers.moe import MoE
from moeswap.ops.gemm_precision import gemm_precision
from moeswap.ops.linear import linear
from moeswap.weights.dense import plain_weight


@dataclass
class ModelState:
    """Per-sequence state of a batch: one KDAState or MLACache per layer."""

    layers: list

    @property
    def batch(self) -> int:
        first = self.layers[0]
        return (first.recurrent_BHKK if isinstance(first, KDAState) else first.latent_BSX).shape[0]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int, device=None):
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.attn_kind = cfg.attn_kinds[idx]
        self.self_attn = KDA(cfg, device) if self.attn_kind == "kda" else MLA(cfg, device)
        if cfg.mlp_kinds[idx] == "dense":
            self.mlp = GatedMLP(d, cfg.intermediate_size, cfg.hidden_act, (cfg.situ_beta, cfg.situ_linear_beta), device)
        else:
            self.block_sparse_moe = MoE(cfg, idx, device)
        self.input_layernorm = RMSNorm(d, eps, device)
        self.post_attention_layernorm = RMSNorm(d, eps, device)
        if cfg.attn_res_block_size:
            self.self_attention_res_norm = WeightOnly(d, device=device)
            self.self_attention_res_proj = WeightOnly(1, d, device=device)
            self.mlp_res_norm = WeightOnly(d, device=device)
            self.mlp_res_proj = WeightOnly(1, d, device=device)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x) if hasattr(self, "mlp") else self.block_sparse_moe(x)


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, device=None):
        super().__init__()
        c = config
        self.config = c
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, device=device)
        self.model.layers = nn.ModuleList(DecoderLayer(c, i, device) for i in range(c.num_layers))
        self.model.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, device)
        if c.attn_res_block_size:
            self.model.output_attn_res_norm = WeightOnly(c.hidden_size, device=device)
            self.model.output_attn_res_proj = WeightOnly(1, c.hidden_size, device=device)
        if not c.tie_word_embeddings:
            self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False, device=device)
        self.expert_lookahead = None  # hook(layer, hidden) set by the loader for next-layer prefetch; not a module
        self.gemm_precision = "fp32"  # LoadOptions.gemm_precision: "bf16" rounds bf16-weight CPU matmuls' inputs
        # training: each decoder layer's activations are recomputed in backward instead of kept
        # (torch.utils.checkpoint, non-reentrant); applies to forwards without state under grad
        self.gradient_checkpointing = False

    def moe_blocks(self) -> list[MoE]:
        return [layer.block_sparse_moe for layer in self.model.layers if hasattr(layer, "block_sparse_moe")]

    def make_state(self, batch: int = 1, dtype: torch.dtype | None = None, device=None) -> ModelState:
        c = self.config
        ref = self.model.embed_tokens
        dtype, device = dtype or embedding_dtype(ref), device or ref.weight.device
        layers = []
        for layer in self.model.layers:
            if layer.attn_kind == "kda":
                layers.append(KDAState.zeros(batch, c.kda.num_heads, c.kda.head_dim, c.kda.conv_kernel, dtype, device))
            else:
                layers.append(MLACache.empty(batch, layer.self_attn.cache_width(), dtype, device))
        return ModelState(layers)

    def forward(self, tokens_BT: torch.Tensor, state: ModelState | None = None, last_only: bool = False,
                hidden_only: bool = False) -> torch.Tensor:
        """Logits [B, T, V] (or [B, 1, V] with last_only). Updates `state` in place when given. hidden_only:
        the final normed hidden states [B, T, H] instead, which `head` turns into logits (training computes
        its loss a chunk of tokens at a time rather than holding every token's logits)."""
        with gemm_precision(self.gemm_precision):
            hidden = self._forward(tokens_BT, state, last_only)
            return hidden if hidden_only else self._head(hidden)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [..., V] of final normed hidden states [..., H] (forward's last step)."""
        with gemm_precision(self.gemm_precision):
            return self._head(hidden)

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            return linear(hidden, self.model.embed_tokens.weight)
        if plain_weight(self.lm_head):
            return linear(hidden, self.lm_head.weight)
        return self.lm_head(hidden)  # a wrapper (LoRA)

    def _forward(self, tokens_BT: torch.Tensor, state: ModelState | None, last_only: bool) -> torch.Tensor:
        """The final normed hidden states [B, T, H] (or [B, 1, H] with last_only)."""
        c, eps = self.config, self.config.rms_norm_eps
        block = c.attn_res_block_size
        partial = self.model.embed_tokens(tokens_BT)
        bank: list[torch.Tensor] = []
        # recomputing a layer in backward is only sound without state, which a forward updates in place
        recompute = self.gradient_checkpointing and state is None and torch.is_grad_enabled()
        for i, layer in enumerate(self.model.layers):
            if recompute:
                out = checkpoint(self._layer, i, layer, None, partial, *bank, use_reentrant=False)
            else:
                out = self._layer(i, layer, state.layers[i] if state else None, partial, *bank)
            if block and i % block == 0:
                bank.append(partial)  # the raw partial sum is banked and the layer restarted it
            partial = out
        if block:
            score = score_vector(self.model.output_attn_res_norm, self.model.output_attn_res_proj)
            partial = mix(partial, bank, score, eps)
        if last_only:
            partial = partial[:, -1:]
        return self.model.norm(partial)

    def _layer(self, i: int, layer: DecoderLayer, layer_state, partial: torch.Tensor,
               *bank: torch.Tensor) -> torch.Tensor:
        """Decoder layer i: the new partial sum from the one before it and the bank of earlier blocks' sums.
        A layer that starts a block banks `partial` (the caller appends it) and restarts the sum from zero."""
        eps, block = self.config.rms_norm_eps, self.config.attn_res_block_size
        h = partial
        if block:
            score = score_vector(layer.self_attention_res_norm, layer.self_attention_res_proj)
            h = mix(partial, list(bank), score, eps)
        if block and i % block == 0:
            bank = (*bank, partial)
            partial = torch.zeros_like(partial)
        partial = partial + layer.self_attn(layer.input_layernorm(h), layer_state)
        m = mix(partial, list(bank), score_vector(layer.mlp_res_norm, layer.mlp_res_proj), eps) if block else partial
        if self.expert_lookahead is not None:  # guess the next MoE layer's experts while this one computes
            self.expert_lookahead(i, m)
        return partial + layer.feed_forward(layer.post_attention_layernorm(m))

