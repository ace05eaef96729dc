"""The forms an expert is kept in: `ExpertWeights` (decoded matrices) and its stored bytes:
`MXFP4ExpertWeights`, `FP8ExpertWeights` (block FP8) and `Int4ExpertWeights` (INT4 pack-quantized). All
compute y = w2 (act(w1 x) * w3 x) when called, through `fmt`, the format object of their form
(ops/expert_format.py: FLOAT, MXFP4, FP8_BLOCK, INT4), which owns the kernels and checks the bytes.
Shapes: T tokens, I expert input width (latent or model width), F expert width.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from moeswap.formats import mx
from moeswap.ops.kernel_abi import KERNEL_PROJS


_TENSOR_FIELDS: dict[type, tuple[str, ...]] = {}  # class -> its init fields (dataclasses.fields is slow per call)


def tensors(w) -> dict[str, torch.Tensor]:
    """The weight tensors of an expert by field name (what a tier moves, pins or frees)."""
    names = _TENSOR_FIELDS.get(type(w))
    if names is None:
        names = _TENSOR_FIELDS[type(w)] = tuple(f.name for f in fields(w) if f.init)
    return {name: getattr(w, name) for name in names}


class _Format:
    """`cls.fmt`: the ops.expert_format object that computes this form, looked up at first use (that module
    builds on these classes) and then a plain class attribute."""

    def __init__(self, name: str):
        self.name = name

    def __set_name__(self, owner, attr: str):
        self.attr = attr

    def __get__(self, obj, owner):
        from moeswap.ops import expert_format

        value = getattr(expert_format, self.name)
        setattr(owner, self.attr, value)  # replaces this descriptor: later lookups cost nothing extra
        return value


@dataclass
class ExpertWeights:
    w1_FI: torch.Tensor  # gate
    w3_FI: torch.Tensor  # up
    w2_IF: torch.Tensor  # down
    nbytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        self.nbytes = sum(t.numel() * t.element_size() for t in (self.w1_FI, self.w3_FI, self.w2_IF))

    fmt = _Format("FLOAT")

    def __call__(self, x_TI: torch.Tensor, act: str, situ_betas: tuple[float, float]) -> torch.Tensor:
        return self.fmt.forward(self, x_TI, act, situ_betas)


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
        """Without __post_init__'s checks (~40 us): for tensors laid out exactly like ones that passed
        them (the expert store's reads, whose layout it checked once). nbytes: theirs, if known."""
        w = cls.__new__(cls)
        w.__dict__.update(parts)
        w.nbytes = sum(t.numel() for t in parts.values()) if nbytes is None else nbytes  # all uint8
        return w

    fmt = _Format("MXFP4")

    def __call__(self, x_TI: torch.Tensor, act: str, situ_betas: tuple[float, float]) -> torch.Tensor:
        return self.fmt.forward(self, x_TI, act, situ_betas)


def _unchecked(cls, parts: dict[str, torch.Tensor]):
    w = cls.__new__(cls)
    for name, t in parts.items():
        setattr(w, name, t)
    w.nbytes = sum(t.numel() * t.element_size() for t in parts.values())
    return w


@dataclass
class FP8ExpertWeights:
    """An expert kept as its stored block-FP8 bytes (1 byte per weight, fp32 scales per 128 x 128 block);
    computes from them (ops.expert_quant). Made by ops.expert_format.FP8_BLOCK, which checks the layout."""

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

    fmt = _Format("FP8_BLOCK")

    def __call__(self, x_TI: torch.Tensor, act: str, situ_betas: tuple[float, float]) -> torch.Tensor:
        return self.fmt.forward(self, x_TI, act, situ_betas)


@dataclass
class Int4ExpertWeights:
    """An expert kept as its stored INT4 pack-quantized bytes (int32 words of 8 codes, bf16 scales per 32
    inputs; 4.5 bits per weight); computes from them (ops.expert_quant). Made by ops.expert_format.INT4."""

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

    fmt = _Format("INT4")

    def __call__(self, x_TI: torch.Tensor, act: str, situ_betas: tuple[float, float]) -> torch.Tensor:
        return self.fmt.forward(self, x_TI, act, situ_betas)
