"""Kernels per layer of moeswap's graphed CUDA decode step (engine/cuda_graph.py): the counts behind the
planner's `moeswap-cuda` engine profile (catalog/engines.toml), whose fixed per-step time is kernels x
kernel_us. The counts are the step's structure, counted on the CPU, not a profile of a GPU.
Entry point: `count(model) -> {kernels_kda, kernels_mla, kernels_dense, kernels_moe, kernels_attn_res,
kernels_step}`.
"""

from __future__ import annotations

from contextlib import ExitStack
from unittest import mock

import torch

from moeswap.planner.local_cpu import OpCounter, layer_buckets, per_layer_counts

NOT_KERNELS = ("empty", "detach", "alias", "lift_fresh", "_to_copy")  # allocations and no-op copies on one device


def count(model) -> dict[str, float]:
    """Engine-profile kernel counts of the graphed decode step of `model` (loaded on the CPU, its experts all
    resident): per layer of each kind and per step outside the layers.

    Counted by running the step's forward once as the graph captures it (all experts resident: one graph,
    batch 1), on the CPU with moeswap's C kernels off so that every sublayer takes the torch path CUDA takes:
    each aten op that launches work counts one kernel (views and allocations launch none), and each Triton
    launch one (what the Triton interpreter dispatches inside it is not counted). A composite op may launch
    more than one kernel on a GPU and a fused one fewer; the time per kernel (kernel_us) is what a GPU run
    calibrates. tests/planner/test_graph_kernels.py keeps the catalog's numbers equal to a fresh count.
    """
    from moeswap.engine.cuda_graph import GraphedDecode
    from moeswap.engine.scheduler import fuse_projections
    from moeswap.ops import cpu_kernels, triton_mxfp4

    fuse_projections(model)  # as the scheduler runs it
    step = GraphedDecode(model, capture=False)
    state = model.make_state(1)
    tokens = torch.tensor([[1]])
    counter = OpCounter()
    quiet = [False]

    def counted(func):
        def run(*args, **kwargs):  # one Triton launch: one kernel, nothing of the interpreter's ops
            counter.counts[counter.bucket] += 1
            quiet[0] = True
            try:
                return func(*args, **kwargs)
            finally:
                quiet[0] = False
        return run

    class Kernels(type(counter.mode)):  # type: ignore[misc]  # the counting mode's class, known at run time
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not quiet[0] and not func.is_view and not func.__name__.startswith(NOT_KERNELS):
                counter.counts[counter.bucket] += 1
            return func(*args, **(kwargs or {}))

    mods = layer_buckets(model)
    handles = []
    for i, (m, bucket) in enumerate(mods):
        handles += counter.hook(m, bucket, "step" if i == len(mods) - 1 else "layer")
    with torch.inference_mode(), ExitStack() as stack:
        model(torch.tensor([[1, 2, 3]]), state)  # a prefill: the state and the store as a decode step finds them
        why = step.unsupported(tokens, state)
        if why is not None:
            raise ValueError(f"the graphed step does not apply to this model: {why}")
        step._experts.mode, step._experts.split = "warmup", False
        for name in ("for_inference", "kernel"):
            stack.enter_context(mock.patch.object(cpu_kernels, name, lambda *a, **k: None))
        for name in ("pair_linears", "sorted_linears"):
            stack.enter_context(mock.patch.object(triton_mxfp4, name, counted(getattr(triton_mxfp4, name))))
        try:
            with Kernels():
                counter.bucket = "step"
                step._forward(tokens, state)
        finally:
            for h in handles:
                h.remove()
    return per_layer_counts(model, counter.counts)
