"""MXFP4 codec (OCP MX v1.0: E2M1 elements, one E8M0 scale byte per 32) in the compressed-tensors layout.

Pure functions on tensors; knows nothing of checkpoints or module names. Layout: `packed` uint8 [..., n/2]
(column 2j in the low nibble of byte j, 2j+1 in the high nibble), `scale` uint8 [..., n/32].
Entry points: `decode(packed, scale)` and `encode(w, mode)`; see docs/formats.md for the vectors.
"""

from __future__ import annotations

import torch

from moeswap.formats import mx
from moeswap.formats.mx import BLOCK, MODES, SCALE_NAN, Mode, scale_to_float  # noqa: F401 (re-exported)

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of codes 0-7; code | 8 negates
E2M1_MAX = 6.0
E2M1_EMAX = 2  # floor(log2(6)): the exponent of the largest element
MAX_SCALE_BYTE = mx.max_finite_scale_byte(E2M1_MAX)  # 252 = 2^125: 6 * 2^126 is past fp32's range


def _pair_table() -> torch.Tensor:
    """[256, 2] fp32: the (low nibble, high nibble) element values of every packed byte."""
    signed = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32)
    byte = torch.arange(256)
    return torch.stack((signed[byte & 0xF], signed[byte >> 4]), dim=-1)


_BYTE_TO_PAIR = _pair_table()
# Element code of each magnitude in units of 0.5 (index = 2·|value| for grid values 0..6).
_HALF_UNITS_TO_CODE = torch.tensor([0, 1, 2, 3, 4, 0, 5, 0, 6, 0, 0, 0, 7], dtype=torch.uint8)


def decode(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """packed uint8 [..., n/2] + scale uint8 [..., n/32] -> weights [..., n] in `dtype`.

    Computed exactly in fp32 (every product is representable), then cast once.
    """
    scale = mx.as_scale_bytes(scale, "MXFP4")
    if packed.dtype != torch.uint8:
        raise ValueError(f"MXFP4 packed weights must be uint8, got dtype {packed.dtype}")
    mx.check_blocks("MXFP4", packed, scale, BLOCK // 2, "packed")
    # index_select on the flat bytes: faster than advanced indexing on CPU (docs/benchmarks.md).
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
    mx.check_mode(mode)
    mx.check_encodable("MXFP4", w)
    blocks = w.float().reshape(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK)
    scales = mx.block_exponents(blocks, mode, E2M1_EMAX, E2M1_MAX)
    nonzero = scales.nonzero.unsqueeze(-1)
    # Zero and NaN/Inf blocks are zeroed first so rounding only ever sees finite grid inputs.
    scaled = torch.where(nonzero, blocks * mx.power_of_two(-scales.exponent).unsqueeze(-1), 0.0)
    if w.dtype in (torch.bfloat16, torch.float16):
        # Only changes values that underflow the input dtype to ±0: their sign is then that of the zero,
        # as when compressed-tensors divides in the input dtype. Magnitudes are unaffected.
        scaled = scaled.to(w.dtype).float()
    codes = torch.where(nonzero, _round_to_e2m1_codes(scaled), 0)
    codes = codes.reshape(*w.shape[:-1], w.shape[-1] // 2, 2)
    packed = codes[..., 0] | (codes[..., 1] << 4)
    return packed, scales.scale_byte


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
