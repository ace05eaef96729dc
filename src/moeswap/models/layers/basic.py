"""RMSNorm, gated MLPs (SwiGLU, K3's SiTU-GLU) and the embedding kept as stored (StoredEmbedding). Pure math,
weights as named submodules."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from moeswap.ops import cpu_kernels
from moeswap.ops.activation import glu
from moeswap.ops.gemm_precision import gemm_in_bf16
from moeswap.ops.linear import KERNEL_MAX_ROWS, linear, row_kernel_takes
from moeswap.weights.dense import WeightLinear, codes_of, kernel_of, linear_method, plain_weight


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 (as the references do), returned in x's dtype. Eager CPU inference runs
    the C kernel: torch's CPU rms_norm is a chain of ops (docs/benchmarks.md)."""
    xf = x if x.dtype == torch.float32 else x.float()
    if weight is not None and weight.dtype != torch.float32:
        weight = weight.float()
    kernel = cpu_kernels.for_inference(xf) if weight is None else cpu_kernels.for_inference(xf, weight)
    if kernel is not None and xf.numel():
        return kernel.rms_norm(xf, weight, eps).to(x.dtype)
    return F.rms_norm(xf, (x.shape[-1],), weight, eps).to(x.dtype)


def derived(owner: nn.Module, name: str, make: Callable[[], object], *sources: torch.Tensor):
    """make(), tensors computed from the weights `sources` alone (a cast, a product, a concatenation),
    kept on `owner` under `name` while the sources are unchanged (same storage, same version): decode
    steps stop recomputing it. Recomputed under autograd or tracing, where a kept copy would cut the graph."""
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and any(s.requires_grad for s in sources)):
        return make()
    try:
        key = tuple((s.data_ptr(), s._version) for s in sources)
    except RuntimeError:  # inference tensors keep no version
        return make()
    # one copy per mode: a tensor made under inference_mode (a scheduler step) cannot be saved for a
    # backward pass later (LoRA training on the same model, whose base weights need no grad)
    name = name + "@inference" if torch.is_inference_mode_enabled() else name
    kept = owner.__dict__.setdefault("_derived", {})
    hit = kept.get(name)
    if hit is not None and hit[0] == key:
        return hit[1]
    value = make()
    kept[name] = (key, value)
    return value


def records_graph(module: nn.Module, *tensors: torch.Tensor) -> bool:
    """Whether autograd records this call: grad mode is on and one of `tensors` or of `module`'s parameters
    (a LoRA wrapped around a projection included) requires grad. The C kernels and the in-place updates
    of inference then step aside for their torch forms, which autograd can follow."""
    if not torch.is_grad_enabled():
        return False
    return any(t.requires_grad for t in tensors) or any(p.requires_grad for p in module.parameters())


def fuse_linears(module: nn.Module, names: Sequence[str]) -> None:
    """Speed only: the weights of the named bias-free nn.Linear children become views into one
    [sum of outputs, in] tensor, so `project` reads the input once in one matmul instead of 3-6
    (fewer kernel launches; on a 2-core CPU it measured neutral end to end). Values, names and
    state_dict are unchanged; memory is not duplicated. No-op unless all are plain (or stored-weight) Linears of one dtype."""
    mods = [getattr(module, n) for n in names]
    if codes_of(mods[0]) is not None and all(linear_method(m) is linear_method(mods[0]) for m in mods):
        _fuse_codes(module, names, mods)
        return
    if not all(plain_weight(m) and m.bias is None for m in mods) or len({m.weight.dtype for m in mods}) > 1:
        return
    fused = torch.cat([m.weight.detach() for m in mods])
    start = 0
    for m in mods:
        rows = m.weight.shape[0]
        m.weight = nn.Parameter(fused[start:start + rows], requires_grad=m.weight.requires_grad)
        start += rows
    module.__dict__["_fused_input"] = (fused, tuple(names), [m.weight.data_ptr() for m in mods],
                                       [m.weight.shape[0] for m in mods])


def _fuse_codes(module: nn.Module, names: Sequence[str], mods: list[WeightLinear]) -> None:
    """fuse_linears for Linears of one method kept as codes and scales (block FP8, INT8, INT4: the method's
    `codes`): codes and scales each become views into one tensor, for the C decode step's one product (the
    modules still run one product each: the kernels sum a row alike either way). Scales concatenate only where
    every part but the last fills whole scale rows (`code_rows`: 128 for block FP8); else no fusion."""
    method = linear_method(mods[0])
    assert method is not None and method.codes is not None
    codes_name, scales_name = method.codes
    if (any(m.out_features % method.code_rows for m in mods[:-1])
            or len({getattr(m, codes_name).shape[1] for m in mods}) > 1):
        return
    codes = torch.cat([getattr(m, codes_name).detach() for m in mods])
    scales = torch.cat([getattr(m, scales_name).detach() for m in mods])
    start = s_start = 0
    for m in mods:
        rows, s_rows = getattr(m, codes_name).shape[0], getattr(m, scales_name).shape[0]
        setattr(m, codes_name, nn.Parameter(codes[start:start + rows], requires_grad=False))
        setattr(m, scales_name, nn.Parameter(scales[s_start:s_start + s_rows], requires_grad=False))
        start, s_start = start + rows, s_start + s_rows
    module.__dict__["_fused_input"] = (codes, tuple(names), [getattr(m, codes_name).data_ptr() for m in mods],
                                       [m.out_features for m in mods], scales,
                                       [getattr(m, scales_name).data_ptr() for m in mods])


def fused_codes(module: nn.Module, names: Sequence[str], unadapted_rows: bool = False):
    """(codes, scales, kernel kind) of the named Linears fused by `_fuse_codes`, while that fusion holds; else
    None."""
    fused = module.__dict__.get("_fused_input")
    if fused is None or len(fused) < 6 or fused[1] != tuple(names):
        return None
    mods = [unadapted(getattr(module, n)) if unadapted_rows else getattr(module, n) for n in names]
    method = linear_method(mods[0])
    if method is None or method.codes is None or any(linear_method(m) is not method for m in mods):
        return None
    codes_name, scales_name = method.codes
    if ([getattr(m, codes_name).data_ptr() for m in mods] == fused[2]
            and [getattr(m, scales_name).data_ptr() for m in mods] == fused[5]):
        return fused[0], fused[4], method.kernel
    return None


def fuse_projections(model: nn.Module) -> None:
    """Fuse the projections that share an input (`fuse_linears`) in every attention layer, dense MLP and
    shared-expert MLP of `model`; idempotent."""
    for module in model.modules():
        if hasattr(module, "fuse_projections") and "_fused_input" not in module.__dict__:
            module.fuse_projections()


def unadapted(module: nn.Module) -> nn.Module:
    """`module`, or the Linear inside a wrapper whose output equals that Linear's for rows that use no
    adapter (lora.multi.MultiLoRALinear, which says so with `row_adapters`): what a caller may read in
    place of the wrapper while no row of the batch uses an adapter (the C decode step)."""
    return module.__dict__["base"] if getattr(module, "row_adapters", False) else module


def fused_weight(module: nn.Module, names: Sequence[str], unadapted_rows: bool = False) -> torch.Tensor | None:
    """The one [sum of outputs, in] weight of the named Linears while their fusion (`fuse_linears`) still
    holds: no child replaced by a wrapper (a LoRA), no weight re-materialised by .to() or a loader, none
    being trained. Else None. unadapted_rows: for a batch whose rows use no adapter, read through
    served-adapter wrappers (`unadapted`)."""
    fused = module.__dict__.get("_fused_input")
    if fused is None or fused[1] != tuple(names):
        return None
    mods = [getattr(module, n) for n in names]
    if unadapted_rows:
        mods = [unadapted(m) for m in mods]
    if torch.is_grad_enabled() and any(m.weight.requires_grad for m in mods):
        return None  # the fused tensor is a detached copy: weights being trained go through their own modules
    # data pointers cannot be compared while compiling: the compiled decode is made after fusion
    if all(plain_weight(m) for m in mods) and (
            torch.compiler.is_compiling() or [m.weight.data_ptr() for m in mods] == fused[2]):
        return fused[0]
    return None


def project(module: nn.Module, x: torch.Tensor, names: Sequence[str]) -> list[torch.Tensor]:
    """[getattr(module, n)(x) for n in names], in one matmul while their fusion holds (`fused_weight`); served
    adapters' wrappers (lora.multi) add their rows' deltas to their part of it. On the CPU the same bits fused
    or not: one matmul only where the row kernel computes it (`row_kernel_takes`: decode); torch's GEMM
    (prefill, fp32 weights) gets one product a name, each on its rows of the fused weight (a name's own
    weight), as on MKL's AVX2 kernels a column of the fused product can differ from that of the name's own,
    and a forward would then depend on whether a scheduler had fused the model before it (docs/numerics.md).
    Accelerators keep the one product (fewer launches); no claim on their bits rests on it."""
    weight = fused_weight(module, names, unadapted_rows=True)
    if weight is not None:
        sizes = module.__dict__["_fused_input"][3]
        if row_kernel_takes(x, weight) or not x.is_cpu:
            parts = linear(x, weight).split(sizes, dim=-1)
        else:
            parts = [linear(x, w) for w in weight.split(sizes)]
        mods = [getattr(module, n) for n in names]
        return [m.add_deltas(x, y) if getattr(m, "row_adapters", False) else y for m, y in zip(mods, parts)]
    return [getattr(module, n)(x) for n in names]


def adapter_split(modules: Sequence[nn.Module], n: int):
    """For a path that reads `modules`' weights directly, with served adapters (lora.multi): (rows context,
    split) where split is False when no row of this forward uses an adapter on one of them, True when every
    row does, else (those rows' indices, the other rows'); (None, False) without served adapters."""
    wrapped = [m for m in modules if getattr(m, "row_adapters", False)]
    if not wrapped:
        return None, False
    rows = wrapped[0].rows
    return rows, rows.split(n, set().union(*(m.scalings for m in wrapped)))


class StoredEmbedding(nn.Embedding):
    """A token embedding whose table stays the checkpoint's zero-copy mapping in its stored dtype; a lookup
    returns its rows in `compute_dtype`. With --dense-weights int8|int4 (the loader): a row lookup reads a
    row a token, so the table need not be resident at all (the page cache keeps the rows read, and gives
    them back under pressure), where a compute-dtype copy of K3's would take 4.7 GB in fp32."""

    def __init__(self, table: torch.Tensor, compute_dtype: torch.dtype):
        super().__init__(table.shape[0], table.shape[1], _weight=table, _freeze=True)
        self.compute_dtype = compute_dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids).to(self.compute_dtype)


def embedding_dtype(embedding: nn.Embedding) -> torch.dtype:
    """The dtype an embedding's lookups return (a StoredEmbedding's compute dtype, else its table's)."""
    return embedding.compute_dtype if isinstance(embedding, StoredEmbedding) else embedding.weight.dtype


class WeightOnly(nn.Module):
    """A bare `weight` parameter under a checkpoint name (conv kernels, norm and score vectors)."""

    def __init__(self, *shape: int, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(*shape, device=device))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class GatedMLP(nn.Module):
    """down(act(gate x) * up x): layer 0's dense MLP and the shared experts."""

    def __init__(self, dim: int, hidden: int, act: str, situ_betas: tuple[float, float], device=None):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False, device=device)
        self.up_proj = nn.Linear(dim, hidden, bias=False, device=device)
        self.down_proj = nn.Linear(hidden, dim, bias=False, device=device)
        self.act, self.situ_betas = act, situ_betas

    def fuse_projections(self) -> None:
        fuse_linears(self, ("gate_proj", "up_proj"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if (0 < rows <= KERNEL_MAX_ROWS and x.dtype == torch.float32
                and kernel_of(unadapted(self.down_proj)) == "bf16"
                and self.down_proj.weight.dtype == torch.bfloat16 and not gemm_in_bf16()):
            # a decode step: the three products in one C call (cpu_kernels.bf16_mlp), the same bits
            w_gu = fused_weight(self, ("gate_proj", "up_proj"), unadapted_rows=True)
            kernel = (cpu_kernels.for_inference(x, w_gu, self.down_proj.weight)
                      if w_gu is not None and w_gu.dtype == torch.bfloat16 else None)
            # rows with served adapters here (lora.multi) take the modules, as a LoRA-wrapped MLP runs; the
            # others the C call, as without adapters
            adapters, split = adapter_split((self.gate_proj, self.up_proj, self.down_proj), rows)
            if kernel is not None and split is not True:
                x_RD = x.reshape(rows, x.shape[-1]).contiguous()
                if split is False:
                    y = kernel.bf16_mlp(x_RD, w_gu, self.down_proj.weight, self.act, self.situ_betas)
                else:
                    adapted, plain = split
                    y = x_RD.new_empty(rows, self.down_proj.out_features)
                    y[plain] = kernel.bf16_mlp(x_RD[plain], w_gu, self.down_proj.weight, self.act, self.situ_betas)
                    with adapters.subset(adapted):
                        y[adapted] = self._modules_forward(x_RD[adapted])
                return y.view(*x.shape[:-1], y.shape[-1])
        if (0 < rows <= KERNEL_MAX_ROWS and x.dtype == torch.float32 and x.shape[-1] % 32 == 0
                and codes_of(self.down_proj) is not None
                and all(kernel_of(m) == kernel_of(self.down_proj) for m in (self.gate_proj, self.up_proj))):
            # weights kept as codes (block FP8, INT8, INT4; a decode step): each product from the codes, the
            # activation in C, as the native decode step runs them (csrc/decode_step.c layer_mlp), the same bits
            kernel = cpu_kernels.for_inference(x)
            if kernel is not None and self.down_proj.in_features % 32 == 0:
                return self.down_proj(kernel.glu(self.gate_proj(x), self.up_proj(x), self.act, self.situ_betas))
        return self._modules_forward(x)

    def _modules_forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(self, x, ("gate_proj", "up_proj"))
        return self.down_proj(glu(self.act, gate, up, self.situ_betas))
