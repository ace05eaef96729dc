"""MXFP4 codec (OCP MX v1.0: E2M1 elements, one E8M0 scale byte per 32) in the compressed-tensors layout.

Pure functions on tensors; knows nothing of checkpoints or module names. Layout: `packed` uint8 [..., n/2]
(column 2j in the low nibble of byte j, 2j+1 in the high nibble), `scale` uint8 [..., n/32].
Entry points: `decode(packed, scale)` and `encode(w, mode)`; see docs/formats.md for the vectors.
"""

from __future__ import annotations

from typing import Literal

import torch

BLOCK = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of codes 0-7; code | 8 negates
E2M1_MAX = 6.0
E2M1_EMAX = 2  # floor(log2(6)): the exponent of the largest element
SCALE_NAN = 0xFF
Mode = Literal["even", "floor", "rceil"]
MODES: tuple[str, ...] = ("even", "floor", "rceil")


def _e8m0_table() -> torch.Tensor:
    """fp32 value of every scale byte, built from bit patterns so byte 0 stays the subnormal 2^-127."""
    bits = torch.arange(256, dtype=torch.int32) << 23  # byte s -> exponent field s -> 2^(s-127)
    bits[0] = 1 << 22  # 2^-127 has exponent field 0: it is the fp32 subnormal 0x00400000
    bits[SCALE_NAN] = 0x7FC00000  # quiet NaN (the bare exponent pattern would be +Inf)
    return bits.view(torch.float32)


def _pair_table() -> torch.Tensor:
    """[256, 2] fp32: the (low nibble, high nibble) element values of every packed byte."""
    signed = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32)
    byte = torch.arange(256)
    return torch.stack((signed[byte & 0xF], signed[byte >> 4]), dim=-1)


_E8M0_TO_FP32 = _e8m0_table()
_BYTE_TO_PAIR = _pair_table()
# Element code of each magnitude in units of 0.5 (index = 2·|value| for grid values 0..6).
_HALF_UNITS_TO_CODE = torch.tensor([0, 1, 2, 3, 4, 0, 5, 0, 6, 0, 0, 0, 7], dtype=torch.uint8)


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> fp32 2^(s-127); 0xFF -> NaN, 0x00 -> 2^-127 (not flushed)."""
    scale = _as_scale_bytes(scale)
    return _E8M0_TO_FP32.to(scale.device)[scale.long()]


def decode(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """packed uint8 [..., n/2] + scale uint8 [..., n/32] -> weights [..., n] in `dtype`.

    Computed exactly in fp32 (every product is representable), then cast once.
    """
    scale = _as_scale_bytes(scale)
    _check_packed_matches_scale(packed, scale)
    # index_select on the flat bytes: about twice as fast as advanced indexing on CPU.
    pairs = _BYTE_TO_PAIR.to(packed.device).index_select(0, packed.reshape(-1).int())  # [numel, 2]
    blocks = pairs.reshape(*scale.shape, BLOCK)
    blocks = blocks * scale_to_float(scale).unsqueeze(-1)
    return blocks.reshape(*packed.shape[:-1], packed.shape[-1] * 2).to(dtype)


def encode(w: torch.Tensor, mode: Mode = "even") -> tuple[torch.Tensor, torch.Tensor]:
    """w float [..., n] (n a multiple of 32) -> (packed uint8 [..., n/2], scale uint8 [..., n/32]).

    mode picks the shared exponent of each block of 32 (elements always round to nearest even on the
    E2M1 grid, saturating at ±6):
      "floor": floor(log2(amax)) - 2, the OCP spec rule (may clip values in (6, 8)·2^e to 6);
      "even":  like floor after rounding amax to one mantissa bit (what compressed-tensors writes);
      "rceil": ceil(log2(amax / 6)), never clips.
    A zero block gets scale byte 0 and codes 0; a block holding NaN or Inf gets scale 0xFF and codes 0.
    Negative values that round to zero keep the sign (code 8); an input -0.0 encodes as +0 (code 0).
    Computed in fp32 (exact for bf16/fp16 inputs; float64 is rounded to fp32 first).
    """
    if mode not in MODES:
        raise ValueError(f"MXFP4 encode mode must be one of {MODES}, got {mode!r}")
    if not w.is_floating_point():
        raise ValueError(f"MXFP4 encode needs a floating-point tensor, got dtype {w.dtype}")
    if w.ndim == 0 or w.shape[-1] % BLOCK != 0:
        size = w.shape[-1] if w.ndim else "a 0-d tensor"
        raise ValueError(f"MXFP4 encode needs the last dim to be a multiple of {BLOCK}, got {size}")

    blocks = w.float().reshape(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1)
    finite = torch.isfinite(blocks).all(dim=-1)  # amax alone misses NaN: max() may drop it
    nonzero = finite & (amax > 0)

    shared_exp = _shared_exponent(torch.where(nonzero, amax, torch.ones_like(amax)), mode)
    # Multiply by the exact fp32 2^-shared_exp (a table lookup: 2^127 down to the subnormal 2^-127).
    inverse_scale = _E8M0_TO_FP32.to(w.device)[127 - shared_exp].unsqueeze(-1)
    # Zero and NaN/Inf blocks are zeroed first so rounding only ever sees finite grid inputs.
    scaled = torch.where(nonzero.unsqueeze(-1), blocks * inverse_scale, 0.0)
    if w.dtype in (torch.bfloat16, torch.float16):
        # Only changes values that underflow the input dtype to ±0: their sign is then that of the zero,
        # as when compressed-tensors divides in the input dtype. Magnitudes are unaffected.
        scaled = scaled.to(w.dtype).float()
    codes = torch.where(nonzero.unsqueeze(-1), _round_to_e2m1_codes(scaled), 0)
    scale = torch.where(nonzero, shared_exp + 127, 0)
    scale = torch.where(finite, scale, SCALE_NAN).to(torch.uint8)

    codes = codes.reshape(*w.shape[:-1], w.shape[-1] // 2, 2)
    packed = codes[..., 0] | (codes[..., 1] << 4)
    return packed, scale


def _shared_exponent(amax: torch.Tensor, mode: str) -> torch.Tensor:
    """int32 block exponent for positive finite fp32 amax, clamped to the E8M0 range [-127, 127]."""
    mantissa, exponent = torch.frexp(amax)  # amax = mantissa · 2^exponent, mantissa in [0.5, 1)
    floor_log2 = exponent - 1
    if mode == "floor":
        exp = floor_log2 - E2M1_EMAX
    elif mode == "even":
        # Rounding 1.m to one mantissa bit carries into the exponent when 1.m >= 1.75 (ties up).
        exp = floor_log2 + (mantissa >= 0.875).int() - E2M1_EMAX
    else:  # rceil
        m6, e6 = torch.frexp(amax / E2M1_MAX)  # exact enough: amax/6 never rounds onto a power of two
        exp = torch.where(m6 == 0.5, e6 - 1, e6)  # ceil(log2(amax/6))
    return exp.clamp(-127, 127).to(torch.int32)


def _round_to_e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest even on the E2M1 grid, saturating at ±6, and return 4-bit codes (uint8).

    The grid spacing is 0.5 below 2, 1 in [2, 4) and 2 from 4 up, so rounding each range at its own
    step with torch.round (half to even) is exactly round-to-nearest-even on the grid.
    """
    magnitude = x.abs()
    step = torch.where(magnitude < 2, 0.5, torch.where(magnitude < 4, 1.0, 2.0))
    rounded = (torch.round(magnitude / step) * step).clamp(max=E2M1_MAX)
    code = _HALF_UNITS_TO_CODE.to(x.device)[(rounded * 2).long()]
    # Sign of the value, not of its bits, as compressed-tensors writes: -0.25 -> code 8 (-0), -0.0 -> code 0.
    return code | ((x < 0).to(torch.uint8) << 3)


def _as_scale_bytes(scale: torch.Tensor) -> torch.Tensor:
    if scale.dtype == torch.float8_e8m0fnu:  # same bits, typed
        return scale.view(torch.uint8)
    if scale.dtype != torch.uint8:
        raise ValueError(f"MXFP4 scale must be uint8 E8M0 bytes, got dtype {scale.dtype}")
    return scale


def _check_packed_matches_scale(packed: torch.Tensor, scale: torch.Tensor) -> None:
    if packed.dtype != torch.uint8:
        raise ValueError(f"MXFP4 packed weights must be uint8, got dtype {packed.dtype}")
    shapes = f"packed {tuple(packed.shape)} and scale {tuple(scale.shape)}"
    if packed.ndim == 0 or packed.ndim != scale.ndim or packed.shape[:-1] != scale.shape[:-1]:
        raise ValueError(f"MXFP4 {shapes} must agree in every dim but the last")
    if packed.shape[-1] != scale.shape[-1] * (BLOCK // 2):
        raise ValueError(
            f"MXFP4 {shapes}: packed last dim must be {BLOCK // 2}x the scale's "
            f"(one scale byte per {BLOCK} weights = {BLOCK // 2} packed bytes)"
        )
