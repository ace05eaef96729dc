"""Optional torch.compile of the decode step's attention sublayers (KDA, MLA), applied from outside the model
(EngineConfig.compile) for decode steps only: prefill and every other caller keep the eager model, the
reference. The MoE block is not compiled: it asks a Python expert store for its experts.
Entry point: `compile_decode(model) -> callable(tokens_B1, state) -> logits`.
"""

from __future__ import annotations

from contextlib import contextmanager


class CompiledDecode:
    def __init__(self, model):
        import torch

        self.model = model
        self.compiled = [torch.compile(layer.self_attn.forward, dynamic=True) for layer in model.model.layers]

    @contextmanager
    def swapped(self):
        """The compiled attention sublayers in place of the eager ones inside the block."""
        layers = self.model.model.layers
        for layer, fn in zip(layers, self.compiled):
            layer.self_attn.forward = fn  # instance attribute shadows the class method
        try:
            yield
        finally:
            for layer in layers:
                del layer.self_attn.forward

    def __call__(self, tokens_BT, state):
        with self.swapped():
            return self.model(tokens_BT, state)


def compile_decode(model) -> CompiledDecode:
    """One per model (kept on it): schedulers made later reuse the compiled graphs instead of recompiling.

    The C kernels enter the graph as torch ops (ops/cpu_kernels.py, `moeswap::bf16_linear`,
    `moeswap::kda_decode`); as ctypes calls they broke it at every projection. Whole graphs are level with eager
    (docs/benchmarks.md): the eager glue is not what inductor speeds up here. On CUDA the graphed decode step
    (engine/cuda_graph.py) captures these compiled sublayers' fused kernels in its graphs.
    """
    compiled = model.__dict__.get("_compiled_decode")
    if compiled is None:
        compiled = model.__dict__["_compiled_decode"] = CompiledDecode(model)
    return compiled
