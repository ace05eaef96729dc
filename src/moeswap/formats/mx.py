"""What the MX codecs (mxfp4.py, mxfp8.py) share: E8M0 scale bytes and the choice of a block's exponent.

Pure functions on tensors. A block is 32 consecutive values along the last dim; its scale byte s means
2^(s - 127) (0xFF is NaN, byte 0 the fp32 subnormal 2^-127). Entry points: `scale_to_float`,
`block_exponents` (FLOOR / EVEN / RCEIL, see docs/formats.md), `max_finite_scale_byte` and the shape checks.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

BLOCK = 32
SCALE_NAN = 0xFF
Mode = Literal["even", "floor", "rceil"]
MODES: tuple[str, ...] = ("even", "floor", "rceil")


def _e8m0_table() -> torch.Tensor:
    """fp32 value of every scale byte, built from bit patterns so byte 0 stays the subnormal 2^-127."""
    bits = torch.arange(256, dtype=torch.int32) << 23  # byte s -> exponent field s -> 2^(s-127)
    bits[0] = 1 << 22  # 2^-127 has exponent field 0: it is the fp32 subnormal 0x00400000
    bits[SCALE_NAN] = 0x7FC00000  # quiet NaN (the bare exponent pattern would be +Inf)
    return bits.view(torch.float32)


E8M0_TO_FP32 = _e8m0_table()
FP32_MAX = torch.finfo(torch.float32).max


def max_finite_scale_byte(element_max: float) -> int:
    """The largest scale byte whose every block value is a finite fp32 for elements up to `element_max`:
    above it a block can decode to ±Inf (and 0xFF is NaN), which no trained model's weights are."""
    return max(s for s in range(SCALE_NAN) if element_max * 2.0 ** (s - 127) <= FP32_MAX)


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (uint8 or float8_e8m0fnu) -> fp32 2^(s-127); 0xFF -> NaN, 0x00 -> 2^-127 (not flushed)."""
    scale = as_scale_bytes(scale, "MX")
    return E8M0_TO_FP32.to(scale.device)[scale.long()]


def power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    """Exact fp32 2^e for int e in [-127, 127] (a table lookup, so 2^-127 is not flushed)."""
    return E8M0_TO_FP32.to(exponent.device)[(exponent + 127).long()]


class BlockScales(NamedTuple):
    exponent: torch.Tensor  # int32 [..., blocks], in [-127, 127]
    finite: torch.Tensor  # bool: no NaN/Inf in the block
    nonzero: torch.Tensor  # bool: finite and not all zero
    scale_byte: torch.Tensor  # uint8: exponent + 127; 0 for zero blocks, 0xFF for non-finite ones


def block_exponents(blocks: torch.Tensor, mode: str, emax: int, element_max: float) -> BlockScales:
    """Shared exponent of each block of fp32 `blocks` [..., 32] for an element type whose largest
    value is `element_max` = 1.m * 2^emax.

      floor: floor(log2(amax)) - emax (OCP spec; clips block values above element_max * 2^e);
      even:  the same after rounding amax to one mantissa bit (carry at 1.75), as compressed-tensors;
      rceil: ceil(log2(amax / element_max)), the smallest exponent that never clips.
    """
    check_mode(mode)
    amax = blocks.abs().amax(dim=-1)
    finite = torch.isfinite(blocks).all(dim=-1)  # amax alone misses NaN: max() may drop it
    nonzero = finite & (amax > 0)
    safe = torch.where(nonzero, amax, torch.ones_like(amax))
    mantissa, exp2 = torch.frexp(safe)  # amax = mantissa * 2^exp2, mantissa in [0.5, 1)
    exponent = exp2 - 1 - emax  # floor
    if mode == "even":
        exponent = exponent + (mantissa >= 0.875).int()
    elif mode == "rceil":
        # amax / 2^floor = mantissa * 2^(emax+1) is exact in fp32, so the clip test is exact too.
        exponent = exponent + (mantissa * 2.0 ** (emax + 1) > element_max).int()
    exponent = exponent.clamp(-127, 127).to(torch.int32)
    byte = torch.where(nonzero, exponent + 127, 0)
    byte = torch.where(finite, byte, SCALE_NAN).to(torch.uint8)
    return BlockScales(exponent, finite, nonzero, byte)


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"MX scale mode must be one of {', '.join(MODES)}, got {mode!r}")


def as_scale_bytes(scale: torch.Tensor, what: str) -> torch.Tensor:
    if scale.dtype == torch.float8_e8m0fnu:  # same bits, typed
        return scale.view(torch.uint8)
    if scale.dtype != torch.uint8:
        raise ValueError(f"{what} scale must be uint8 E8M0 bytes, got dtype {scale.dtype}")
    return scale


def check_blocks(what: str, data: torch.Tensor, scale: torch.Tensor, per_scale: int, data_name: str) -> None:
    """data [..., n * per_scale] against scale [..., n]; `per_scale` = data elements per scale byte."""
    if data.ndim and data.ndim == scale.ndim and data.shape[:-1] == scale.shape[:-1] \
            and data.shape[-1] == scale.shape[-1] * per_scale:
        return
    shapes = f"{data_name} {tuple(data.shape)} and scale {tuple(scale.shape)}"
    if data.ndim == 0 or data.ndim != scale.ndim or data.shape[:-1] != scale.shape[:-1]:
        raise ValueError(f"{what} {shapes} must agree in every dim but the last")
    if data.shape[-1] != scale.shape[-1] * per_scale:
        found = data.shape[-1] / scale.shape[-1] if scale.shape[-1] else float("inf")
        raise ValueError(
            f"{what} {shapes}: {data_name} last dim must be {per_scale}x the scale's (one scale byte per "
            f"{BLOCK} weights); these shapes imply {found:g} per scale byte: wrong group size or a "
            f"mismatched scale tensor"
        )


def check_encodable(what: str, w: torch.Tensor) -> None:
    if not w.is_floating_point():
        raise ValueError(f"{what} encode needs a floating-point tensor, got dtype {w.dtype}")
    if w.ndim == 0 or w.shape[-1] % BLOCK != 0:
        size = w.shape[-1] if w.ndim else "a 0-d tensor"
        raise ValueError(f"{what} encode needs the last dim to be a multiple of {BLOCK}, got {size}")
