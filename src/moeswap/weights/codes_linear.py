"""What the integer dense methods share (weights.int8's INT8_KEPT, weights.int4's INT4_KEPT): a bias-free
Linear keeps its codes and scales under the compressed-tensors names; decode-sized fp32 CPU inputs multiply
straight from them (csrc/int8.c, csrc/quant.c: each weight made in registers as the format's decode makes it),
other inputs (prefill, autograd, compiling) by decoded row chunks of at most PREFILL_CHUNK_BYTES, each a GEMM
(the whole weight is never decoded at once: K3's lm_head would take 4.7 GB as fp32). Entry point:
`CodesLinear`, subclassed once per format.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from moeswap.ops import cpu_kernels
from moeswap.ops.linear import KERNEL_MAX_ROWS
from moeswap.weights.dense import LinearMethod

PREFILL_CHUNK_BYTES = 32 << 20  # decoded fp32 bytes per GEMM of a prefill-sized product


class CodesLinear(LinearMethod):
    """A Linear kept as integer codes + scales (format `stored`, tensors `parts`); `kernel` names its C product."""

    weight_is_values = False
    stored = ""  # the weights format (registry.FORMATS) whose tensors it keeps
    parts: tuple[str, ...] = ()  # the suffixes it keeps as parameters, the codes first
    dtypes: Mapping[str, torch.dtype] = {}  # what each kept part must be for the kernel

    def keeps(self, stored, dtypes, block, compute, device):
        """Kept where the C kernel runs it: fp32 math on a CPU with the kernel, the tensors in its dtypes."""
        return (stored == self.stored and all(dtypes.get(s) == d for s, d in self.dtypes.items())
                and compute == torch.float32 and torch.device(device).type == "cpu"
                and cpu_kernels.kernel() is not None)

    def load_weights(self, layer, tensors, device):
        super().load_weights(layer, {s: tensors[s] for s in self.parts}, device)

    def decode_rows(self, layer, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows [start, stop) of the weight as `dtype`: the format's decode of those rows."""
        raise NotImplementedError

    def run_kernel(self, kernel, layer, x_TI: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def apply(self, layer, x):
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        kernel = (cpu_kernels.for_inference(x) if 0 < rows <= KERNEL_MAX_ROWS and x.dtype == torch.float32
                  and x.shape[-1] % 32 == 0 else None)
        if kernel is not None:
            y = self.run_kernel(kernel, layer, x.reshape(rows, x.shape[-1]).contiguous())
            return y.view(*x.shape[:-1], layer.out_features)
        O = layer.out_features
        step = max(1, PREFILL_CHUNK_BYTES // max(1, layer.in_features * 4))
        if step >= O:
            return F.linear(x, self.decode_rows(layer, 0, O, x.dtype))
        return torch.cat([F.linear(x, self.decode_rows(layer, r, min(O, r + step), x.dtype))
                          for r in range(0, O, step)], dim=-1)

    def values(self, layer, dtype: torch.dtype = torch.float32):
        """The decoded weight [out, in] in `dtype` (LoRA, merges, MLA's absorbed weights)."""
        return self.decode_rows(layer, 0, layer.out_features, dtype)

    def sources(self, layer):
        return tuple(getattr(layer, s) for s in self.parts)
