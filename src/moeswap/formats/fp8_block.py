"""DeepSeek-V3 / Kimi K2 block FP8: float8_e4m3fn weight [out, in] + fp32 `weight_scale_inv`
[ceil(out/128), ceil(in/128)]; despite the name, dequantisation MULTIPLIES: W = fp8 * scale_inv.

Pure functions on tensors plus the quantization_config check; knows nothing of module names.
Entry points: `decode(weight, scale_inv)`, `encode(w)` and `block_size(quantization_config)`.
"""

from __future__ import annotations

import math

import torch

BLOCK = (128, 128)
E4M3_MAX = 448.0


def block_size(q: dict, source: str = "config.json") -> tuple[int, int]:
    """The [rows, cols] block of a DeepSeek-style `quant_method: fp8` quantization_config."""
    if q.get("quant_method") != "fp8":
        raise ValueError(f"{source}: expected quantization_config.quant_method 'fp8', got {q.get('quant_method')!r}")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"{source}: block FP8 fmt {fmt!r} is not supported (expected e4m3)")
    size = q.get("weight_block_size")
    if (not isinstance(size, list) or len(size) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in size)):
        raise ValueError(f"{source}: quantization_config.weight_block_size must be [rows, cols] of positive "
                         f"ints (DeepSeek uses [128, 128]), got {size!r}")
    return size[0], size[1]


def scale_shape(shape: tuple[int, ...], block: tuple[int, int] = BLOCK) -> tuple[int, int]:
    out_dim, in_dim = shape
    return math.ceil(out_dim / block[0]), math.ceil(in_dim / block[1])


def decode(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = BLOCK,
           dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """weight float8_e4m3fn [out, in] * scale_inv fp32 per block -> [out, in] in `dtype` (products in fp32)."""
    check(weight, scale_inv, block)
    return (weight.float() * _expand(scale_inv.float(), weight.shape, block)).to(dtype)


def check(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = BLOCK) -> None:
    """ValueError naming the problem unless `weight` and `scale_inv` are a block-FP8 pair `decode` takes."""
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"block FP8 weight must be float8_e4m3fn, got dtype {weight.dtype}")
    if weight.ndim != 2:
        raise ValueError(f"block FP8 weight must be 2-D [out, in], got shape {tuple(weight.shape)}")
    if scale_inv.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise ValueError(f"block FP8 weight_scale_inv must be a float tensor, got dtype {scale_inv.dtype}")
    expected = scale_shape(tuple(weight.shape), block)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"block FP8 weight {tuple(weight.shape)} with block {list(block)} needs weight_scale_inv of shape "
            f"{list(expected)}, found {list(scale_inv.shape)}: wrong block size or a mismatched scale tensor"
        )


def encode(w: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w float [out, in] -> (float8_e4m3fn [out, in], scale_inv fp32 per block) with scale = amax / 448.

    Elements round to nearest even and saturate at ±448. An all-zero block gets scale 1; a block with
    NaN/Inf gets a NaN scale (it decodes to NaN).
    """
    if not w.is_floating_point() or w.ndim != 2:
        raise ValueError(f"block FP8 encode needs a 2-D float tensor, got {w.dtype} of shape {tuple(w.shape)}")
    out_dim, in_dim = w.shape
    rows, cols = scale_shape((out_dim, in_dim), block)
    padded = torch.zeros(rows * block[0], cols * block[1], dtype=torch.float32, device=w.device)
    padded[:out_dim, :in_dim] = w.float()
    tiles = padded.reshape(rows, block[0], cols, block[1])
    amax = tiles.abs().amax(dim=(1, 3))
    finite = torch.isfinite(tiles).all(dim=3).all(dim=1)
    scale = torch.where(amax > 0, amax / E4M3_MAX, 1.0)
    scale = torch.where(finite, scale, float("nan"))
    q = (w.float() / _expand(scale, w.shape, block)).nan_to_num(0.0).clamp(-E4M3_MAX, E4M3_MAX)
    return q.to(torch.float8_e4m3fn), scale


def _expand(per_block: torch.Tensor, shape: torch.Size, block: tuple[int, int]) -> torch.Tensor:
    out_dim, in_dim = shape
    return per_block.repeat_interleave(block[0], 0)[:out_dim].repeat_interleave(block[1], 1)[:, :in_dim]
