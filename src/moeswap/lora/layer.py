"""LoRALinear: a frozen Linear plus a trainable low-rank update, y = W x + s · B A dropout(x) (PEFT's LoRA).

The wrapper takes the place of the Linear in the model (same module name) and keeps its `weight` (and
`bias`) under the same names, so the model's state_dict keeps its checkpoint names and the adapter's
tensors are `<module>.lora_A.weight` [r, in] and `<module>.lora_B.weight` [out, r]. A starts as PEFT's
kaiming-uniform(a=sqrt 5), B as zeros; s = alpha / r (rsLoRA: alpha / sqrt r). The LoRA tensors are fp32
over bf16, fp16 and fp32 weights (bf16 kept as stored included), as PEFT keeps them by default.
Fusion: the engine's fused projections (models/layers/basic.py `fuse_linears`) only take plain Linears, so a
module with a wrapped projection is not fused, and a fusion made earlier stops applying once a child is
wrapped (`fused_weight`); the C decode step then declines and the model's modules run.
Entry points: `LoRALinear.from_base(linear, r, alpha, dropout, use_rslora)`, `.merge()`, `.unmerge()`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from moeswap.ops.linear import gemm_input
from moeswap.weights.dense import linear_method, with_weight_values


def lora_scaling(r: int, alpha: float, use_rslora: bool = False) -> float:
    """PEFT's scaling of the update: alpha / r, or alpha / sqrt(r) with rsLoRA."""
    return alpha / math.sqrt(r) if use_rslora else alpha / r


def add_update(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scaling: float) -> torch.Tensor:
    """y + scaling · B A x for x [..., in] (dropout already applied), A [r, in], B [out, r]: the one way every
    LoRA wrapper adds its update (LoRALinear, and lora.multi's served adapters), so a row gets the same bits
    from either, whatever x is a view of (ops.linear.gemm_input). Where y is in B's dtype, one addmm: the B
    product, the scaling and the sum in one pass over [rows, out] and one backward node."""
    a = F.linear(gemm_input(x.to(A.dtype)), A)
    if y.dtype != B.dtype or y.dim() < 2:
        return y + (F.linear(a, B) * scaling).to(y.dtype)
    return torch.addmm(y.reshape(-1, y.shape[-1]), a.reshape(-1, a.shape[-1]), B.T, alpha=scaling).view(y.shape)


class LoRALinear(nn.Module):
    """See the module docstring. `base` is the wrapped Linear (kept for `unwrap`, not a submodule: its
    parameters are this module's `weight` and `bias`)."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0, use_rslora: bool = False,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        if r < 1:
            raise ValueError(f"LoRA rank must be at least 1, got {r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout}")
        self.__dict__["base"] = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.r, self.alpha, self.use_rslora = r, alpha, use_rslora
        self.scaling = lora_scaling(r, alpha, use_rslora)
        device = base.weight.device
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.lora_A = nn.Linear(self.in_features, r, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(r, self.out_features, bias=False, device=device, dtype=dtype)
        self.merged = False

    @classmethod
    def from_base(cls, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0, use_rslora: bool = False,
                  generator: torch.Generator | None = None) -> LoRALinear:
        """A wrapper around `base` with PEFT's initialisation (B = 0: the model's outputs are unchanged)."""
        if not isinstance(base, nn.Linear):
            raise TypeError(f"LoRA wraps nn.Linear layers, not {type(base).__name__}")
        base = with_weight_values(base)  # block-FP8 codes decoded: the LoRA paths read `weight` as values
        # fp32 LoRA tensors over bf16/fp16/fp32 weights (PEFT's default), fp64 over fp64 ones
        module = cls(base, r, alpha, dropout, use_rslora, torch.promote_types(base.weight.dtype, torch.float32))
        module.reset_parameters(generator)
        return module

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        with torch.no_grad():
            nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5), generator=generator)
            nn.init.zeros_(self.lora_B.weight)

    # -- forward -----------------------------------------------------------------------------------

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        """What the wrapped Linear computes (ops.linear for a weight kept in its stored dtype)."""
        return linear_method(self.base).apply_values(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_forward(x)
        if self.merged:
            return y
        return add_update(y, self.lora_dropout(x.to(self.lora_A.weight.dtype)), self.lora_A.weight,
                          self.lora_B.weight, self.scaling)

    # -- the update as a matrix --------------------------------------------------------------------

    def delta_weight(self) -> torch.Tensor:
        """s · B A [out, in] in the LoRA dtype (in autograd's graph when A and B require grad)."""
        return (self.lora_B.weight @ self.lora_A.weight) * self.scaling

    @property
    def foldable(self) -> bool:
        """Whether the layer equals one matrix, `folded_weight()`: not while dropout acts on the LoRA input."""
        return not (self.training and isinstance(self.lora_dropout, nn.Dropout))

    def folded_weight(self) -> torch.Tensor:
        """W + s · B A in the LoRA dtype, for callers that need the layer as a matrix (MLA's absorbed form)."""
        w = self.weight.to(self.lora_A.weight.dtype)
        return w if self.merged else w + self.delta_weight()

    def fold_sources(self) -> tuple[torch.Tensor, ...]:
        """The tensors `folded_weight` is computed from (a cache of it is valid while they are unchanged)."""
        return self.weight, self.lora_A.weight, self.lora_B.weight

    def merged_weight(self) -> torch.Tensor:
        """W + s · B A as a new tensor in W's dtype (W itself unchanged): what `merge` stores."""
        with torch.no_grad():
            return (self.weight.to(torch.float32) + self.delta_weight().to(torch.float32)).to(self.weight.dtype)

    def merge(self) -> None:
        """Adds the update into the weight in place (in its dtype: a bf16 weight rounds it); forward then
        skips the LoRA branch."""
        if not self.merged:
            with torch.no_grad():
                self.weight.copy_(self.merged_weight())
            self.merged = True

    def unmerge(self) -> None:
        """Subtracts the update again; exact only for fp32 weights (a bf16 weight keeps the rounding of both)."""
        if self.merged:
            with torch.no_grad():
                self.weight.copy_((self.weight.to(torch.float32) - self.delta_weight().to(torch.float32))
                                  .to(self.weight.dtype))
            self.merged = False

    def unwrap(self) -> nn.Linear:
        """The wrapped Linear, holding this module's (possibly merged) weight."""
        base = self.base
        base.weight, base.bias = self.weight, self.bias
        return base

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, r={self.r}, alpha={self.alpha}, "
                f"scaling={self.scaling:g}, merged={self.merged}, base={type(self.base).__name__}")
