"""MXFP8 codec (OCP MX v1.0: FP8 E4M3 or E5M2 elements, one E8M0 scale byte per 32) as compressed-tensors
stores it (`mxfp8-quantized`): `weight` float8 [..., n] and `weight_scale` uint8 [..., n/32].

Pure functions on tensors; knows nothing of checkpoints or module names.
Entry points: `decode(data, scale)` and `encode(w, mode, element)`; see docs/formats.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeswap.formats import mx
from moeswap.formats.mx import BLOCK, MODES, Mode  # noqa: F401 (re-exported)


@dataclass(frozen=True)
class Element:
    name: str
    dtype: torch.dtype
    max: float  # largest finite value, 1.m * 2^emax
    emax: int


ELEMENTS = {
    "e4m3": Element("e4m3", torch.float8_e4m3fn, 448.0, 8),  # NaN only at S.1111.111, no Inf
    "e5m2": Element("e5m2", torch.float8_e5m2, 57344.0, 15),  # IEEE-like: has Inf and NaNs
}
_BY_DTYPE = {e.dtype: e for e in ELEMENTS.values()}


def element(name: str) -> Element:
    if name not in ELEMENTS:
        raise ValueError(f"unknown MXFP8 element format {name!r}; expected one of {', '.join(ELEMENTS)}")
    return ELEMENTS[name]


def decode(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """data float8 (E4M3 or E5M2) [..., n] + scale uint8 [..., n/32] -> weights [..., n] in `dtype`.

    Exact in fp32 (an FP8 value times a power of two), then cast once. A 0xFF scale makes the whole
    block NaN; NaN elements stay NaN.
    """
    if data.dtype not in _BY_DTYPE:
        raise ValueError(
            f"MXFP8 data must be float8_e4m3fn or float8_e5m2, got dtype {data.dtype} "
            f"(uint8 bytes: view them with .view(torch.float8_e4m3fn) first)"
        )
    scale = mx.as_scale_bytes(scale, "MXFP8")
    mx.check_blocks("MXFP8", data, scale, BLOCK, "data")
    blocks = data.float().reshape(*scale.shape, BLOCK) * mx.scale_to_float(scale).unsqueeze(-1)
    return blocks.reshape(data.shape).to(dtype)


def encode(w: torch.Tensor, mode: Mode = "even", element_format: str = "e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """w float [..., n] (n a multiple of 32) -> (data float8 [..., n], scale uint8 [..., n/32]).

    The block exponent follows `mode` (see mx.block_exponents) with emax 8 for E4M3 (max 448) and 15 for
    E5M2 (max 57344); "even" matches compressed-tensors bit for bit. Elements round to nearest even,
    saturating at ±max; nonzero values that round to zero keep their sign (-0), exact zeros encode as +0.
    A zero block gets scale byte 0 and +0 elements; a block holding NaN or Inf gets scale 0xFF and +0
    elements. Computed in fp32; bf16/fp16 inputs are divided in their own dtype first, as compressed-tensors
    does (this only matters below 2^-126).
    """
    mx.check_mode(mode)
    mx.check_encodable("MXFP8", w)
    elem = element(element_format)
    blocks = w.float().reshape(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK)
    scales = mx.block_exponents(blocks, mode, elem.emax, elem.max)
    scaled = blocks * mx.power_of_two(-scales.exponent).unsqueeze(-1)
    if w.dtype in (torch.bfloat16, torch.float16):
        scaled = scaled.to(w.dtype).float()
    scaled = scaled + 0.0  # -0.0 -> +0.0, as compressed-tensors' zero-point add does; nonzero values keep their sign
    scaled = torch.where(scales.finite.unsqueeze(-1), scaled, 0.0).clamp(-elem.max, elem.max)
    return scaled.to(elem.dtype).reshape(w.shape), scales.scale_byte
