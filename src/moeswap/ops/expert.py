"""The forms an expert is kept in, as plain data: `ExpertWeights` (decoded matrices) and its stored bytes:
`MXFP4ExpertWeights`, `FP8ExpertWeights` (block FP8) and `Int4ExpertWeights` (INT4 pack-quantized); and
their layout as the CPU kernels read them (`kernel_kind`, `kernel_mats`). They know no format object: the
weights package computes them (weights.registry.format_of(w)). Shapes: T tokens, I expert input width, F width.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from moeswap.formats import int4, mx
from moeswap.ops.kernel_abi import KERNEL_PROJS

_TENSOR_FIELDS: dict[type, tuple[str, ...]] = {}  # class -> its init fields (dataclasses.fields is slow per call)


def tensors(w) -> dict[str, torch.Tensor]:
    """The weight tensors of an expert by field name (what a tier moves, pins or frees)."""
    names = _TENSOR_FIELDS.get(type(w))
    if names is None:
        names = _TENSOR_FIELDS[type(w)] = tuple(f.name for f in fields(w) if f.init)
    return {name: getattr(w, name) for name in names}


@dataclass
class ExpertWeights:
    w1_FI: torch.Tensor  # gate
    w3_FI: torch.Tensor  # up
    w2_IF: torch.Tensor  # down
    nbytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        self.nbytes = sum(t.numel() * t.element_size() for t in (self.w1_FI, self.w3_FI, self.w2_IF))


@dataclass
class MXFP4ExpertWeights:
    """An expert kept as its stored MXFP4 bytes (4.25 bits per weight); computes without keeping a
    decoded copy. The math is ops.expert_mxfp4's selected implementation (a C kernel on CPU that decodes
    blocks in registers, else decoding in row chunks); `expert_mxfp4.reference` is the plain-torch oracle
    it matches (decode all, multiply, drop)."""

    w1_packed: torch.Tensor  # uint8 [F, I/2]
    w1_scale: torch.Tensor  # uint8 [F, I/32]
    w3_packed: torch.Tensor
    w3_scale: torch.Tensor
    w2_packed: torch.Tensor  # uint8 [I, F/2]
    w2_scale: torch.Tensor  # uint8 [I, F/32]
    nbytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        """Checked once here (shapes, E8M0 scales as bytes), so the per-step kernel calls need not."""
        for p in KERNEL_PROJS:
            scale = mx.as_scale_bytes(getattr(self, f"{p}_scale"), f"expert {p}")
            setattr(self, f"{p}_scale", scale)
            packed = getattr(self, f"{p}_packed")
            if packed.dtype != torch.uint8 or packed.ndim != 2:
                raise ValueError(f"expert {p}: packed MXFP4 must be uint8 [out, in/2], got {packed.dtype} "
                                 f"{tuple(packed.shape)}")
            mx.check_blocks("MXFP4", packed, scale, mx.BLOCK // 2, f"expert {p} packed")
        F, I = self.w1_packed.shape[0], self.w1_packed.shape[1] * 2
        if self.w3_packed.shape != self.w1_packed.shape or tuple(self.w2_packed.shape) != (I, F // 2):
            raise ValueError(f"MXFP4 expert: w1 {tuple(self.w1_packed.shape)}, w3 {tuple(self.w3_packed.shape)} and "
                             f"w2 {tuple(self.w2_packed.shape)} packed shapes do not form an expert")
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors(self).values())

    @classmethod
    def unchecked(cls, parts: dict[str, torch.Tensor], nbytes: int | None = None) -> MXFP4ExpertWeights:
        """Without __post_init__'s checks (docs/benchmarks.md): for tensors laid out exactly like ones that passed
        them (the expert store's reads, whose layout it checked once). nbytes: theirs, if known."""
        w = cls.__new__(cls)
        w.__dict__.update(parts)
        w.nbytes = sum(t.numel() for t in parts.values()) if nbytes is None else nbytes  # all uint8
        return w


def _unchecked(cls, parts: dict[str, torch.Tensor]):
    w = cls.__new__(cls)
    for name, t in parts.items():
        setattr(w, name, t)
    w.nbytes = sum(t.numel() * t.element_size() for t in parts.values())
    return w


@dataclass
class FP8ExpertWeights:
    """An expert kept as its stored block-FP8 bytes (1 byte per weight, fp32 scales per 128 x 128 block);
    computes from them (ops.expert_quant). Made by weights.fp8_block.FP8_BLOCK, which checks the layout."""

    w1_weight: torch.Tensor  # float8_e4m3fn [F, I]
    w1_scale_inv: torch.Tensor  # fp32 [ceil(F/128), ceil(I/128)]
    w3_weight: torch.Tensor
    w3_scale_inv: torch.Tensor
    w2_weight: torch.Tensor  # float8_e4m3fn [I, F]
    w2_scale_inv: torch.Tensor
    nbytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors(self).values())

    @classmethod
    def unchecked(cls, **parts: torch.Tensor) -> FP8ExpertWeights:
        return _unchecked(cls, parts)


@dataclass
class Int4ExpertWeights:
    """An expert kept as its stored INT4 pack-quantized bytes (int32 words of 8 codes, bf16 scales per 32
    inputs; 4.5 bits per weight); computes from them (ops.expert_quant). Made by weights.int4.INT4."""

    w1_packed: torch.Tensor  # int32 [F, I/8]
    w1_scale: torch.Tensor  # bf16 [F, I/32]
    w3_packed: torch.Tensor
    w3_scale: torch.Tensor
    w2_packed: torch.Tensor  # int32 [I, F/8]
    w2_scale: torch.Tensor  # bf16 [I, F/32]
    nbytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors(self).values())

    @classmethod
    def unchecked(cls, **parts: torch.Tensor) -> Int4ExpertWeights:
        return _unchecked(cls, parts)


# -- the layout the CPU kernels read (cpu_kernels.moe and the *_resident tables) ---------------------------


def is_fp8(w) -> bool:
    return hasattr(w, "w1_scale_inv")


def quant_parts(w, proj: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of one matrix of a block-FP8 or INT4 expert: FP8 float8_e4m3fn [O, N] + fp32 per
    128 x 128; INT4 int32 [O, N/8] + scales per 32 inputs."""
    if is_fp8(w):
        return getattr(w, f"{proj}_weight"), getattr(w, f"{proj}_scale_inv")
    return getattr(w, f"{proj}_packed"), getattr(w, f"{proj}_scale")


def quant_shape(w, proj: str) -> tuple[int, int]:
    """[O, N] of one matrix of a block-FP8 or INT4 expert."""
    q, s = quant_parts(w, proj)
    return (q.shape[0], q.shape[1]) if is_fp8(w) else (q.shape[0], s.shape[1] * int4.GROUP)


def _float_kind(w) -> str | None:
    mats = [getattr(w, f, None) for f in ("w1_FI", "w3_FI", "w2_IF")]
    return "bf16" if all(m is not None and m.dtype == torch.bfloat16 and m.is_cpu for m in mats) else None


def _mxfp4_kind(w) -> str | None:
    return "mxfp4" if w.w1_packed.is_cpu else None  # is_cpu: no device object per call (docs/benchmarks.md)


def _quant_kind(w) -> str | None:
    """"fp8" or "int4" where csrc/quant.c runs this expert: CPU tensors, widths a multiple of 32, and the
    scale dtype the kernel reads (fp32 for FP8; bf16 for INT4, whose products round to the scale's dtype)."""
    F, I = quant_shape(w, "w1")
    if F % 32 or I % 32 or not all(t.is_cpu for t in quant_parts(w, "w1")):
        return None
    scale_dtype = torch.float32 if is_fp8(w) else torch.bfloat16
    if any(quant_parts(w, p)[1].dtype != scale_dtype for p in KERNEL_PROJS):
        return None
    return "fp8" if is_fp8(w) else "int4"


def _contiguous(mats: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t if t.is_contiguous() else t.contiguous() for t in mats]


def _float_mats(w, I: int) -> list[torch.Tensor]:
    mats = [w.w1_FI, w.w3_FI, w.w2_IF]
    F = mats[0].shape[0]
    if mats[0].shape[1] != I or tuple(mats[1].shape) != (F, I) or tuple(mats[2].shape) != (I, F):
        raise ValueError(f"bf16 expert: w1 {tuple(mats[0].shape)}, w3 {tuple(mats[1].shape)}, w2 "
                         f"{tuple(mats[2].shape)} do not form an expert of input width {I}")
    return _contiguous(mats)


def _mxfp4_mats(w, I: int) -> list[torch.Tensor]:
    mats = [w.w1_packed, w.w1_scale, w.w3_packed, w.w3_scale, w.w2_packed, w.w2_scale]
    if mats[0].shape[1] * 2 != I:
        raise ValueError(f"MXFP4 expert of input width {mats[0].shape[1] * 2} given inputs of width {I}")
    if not all(t.is_cpu for t in mats):  # (is_cpu: no device object per tensor; this runs on every load)
        raise ValueError("MXFP4 expert: the CPU kernel needs CPU tensors")
    return _contiguous(mats)


def _quant_mats(w, I: int) -> list[torch.Tensor]:
    if quant_shape(w, "w1")[1] != I:
        kind = "fp8" if is_fp8(w) else "int4"
        raise ValueError(f"{kind} expert of input width {quant_shape(w, 'w1')[1]} given inputs of width {I}")
    return _contiguous([t for p in KERNEL_PROJS for t in quant_parts(w, p)])


# form -> (its kernel kind or None, the matrices in the kernels' order for input width I)
_LAYOUTS = {ExpertWeights: (_float_kind, _float_mats), MXFP4ExpertWeights: (_mxfp4_kind, _mxfp4_mats),
            FP8ExpertWeights: (_quant_kind, _quant_mats), Int4ExpertWeights: (_quant_kind, _quant_mats)}


def kernel_kind(w) -> str | None:
    """"mxfp4", "bf16", "fp8" or "int4": which grouped CPU kernel runs expert w (cpu_kernels' format codes);
    None: none does (another form, not on the CPU, or a layout the kernel does not take)."""
    layout = _LAYOUTS.get(type(w))
    return None if layout is None else layout[0](w)


def kernel_mats(w, I: int) -> list[torch.Tensor]:
    """The matrices the CPU kernels read of expert w, in their order, contiguous, for input width I."""
    return _LAYOUTS[type(w)][1](w, I)
