"""The random values of init-tiny's tensors, deterministic by (seed, tensor name): dense initial values that
keep a random model numerically tame, and MXFP4 routed experts drawn as random codes and scale bytes (not
encoded from floats, so large sizes write fast). Used by model.py (every size) and k3_slice.py (k3-slice).
Entry points: `generator(seed, name)`, `stored_dtype(name)`, `init_dense(name, shape, gen)`, `init_dense_as(name, shape, gen,
dtype)`, `random_bf16(shape, gen, std)`, `random_mxfp4(shape, gen)`.
"""

from __future__ import annotations

import math
import zlib

import torch

from moeswap.formats import mxfp4

# Projections larger than this many elements are drawn a block of rows at a time (init_dense_as): K3's
# embedding is 1.17 G elements, 4.7 GB as one fp32 draw.
CHUNK_ELEMENTS = 1 << 24


# Stored in fp32 as the published checkpoints do; every other dense tensor is bf16
_FP32 = ("A_log", "dt_bias", "e_score_correction_bias", "conv1d.weight")


def stored_dtype(param_name: str) -> torch.dtype:
    return torch.float32 if param_name.endswith(_FP32) else torch.bfloat16


def generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def _special(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor | None:
    """The tensors that are not plain projections (norms, gates, KDA's decay parameters); None for a projection."""
    leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".", 1)[-1]
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log()
    if name.endswith("dt_bias"):
        dt = torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp()
        return dt + torch.log(-torch.expm1(-dt))  # inverse softplus
    if name.endswith("e_score_correction_bias"):
        return torch.randn(shape, generator=gen) * 0.01
    if "norm" in leaf or leaf.endswith("res_proj"):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if name.endswith("block_sparse_moe.gate.weight"):  # decisive routing: few near-ties between experts
        return torch.randn(shape, generator=gen) * (4.0 / math.sqrt(shape[-1]))
    if "conv1d" in leaf:
        return torch.randn(shape, generator=gen) * 0.3
    return None


def _projection_std(shape: tuple[int, ...]) -> float:
    return 0.5 / math.sqrt(shape[-1])


def init_dense(name: str, shape: tuple[int, ...], gen: torch.Generator, num_heads: int = 0) -> torch.Tensor:
    """Initial values (fp32) that keep a random model numerically tame (norms 1, small projections)."""
    special = _special(name, shape, gen)
    if special is not None:
        return special
    return torch.randn(shape, generator=gen) * _projection_std(shape)


def init_dense_as(name: str, shape: tuple[int, ...], gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """init_dense's values in `dtype`, for GBs of weights (k3-slice): a bf16 projection is drawn as random bits
    (random_bf16: 4-5x faster than normals), another a block of rows at a time, so memory stays near the
    output's size."""
    special = _special(name, shape, gen)
    if special is not None:
        return special.to(dtype)
    if dtype == torch.bfloat16:
        return random_bf16(shape, gen, _projection_std(shape))
    out = torch.empty(shape, dtype=dtype)
    rows = out.reshape(-1, shape[-1])
    step = max(1, CHUNK_ELEMENTS // shape[-1])
    std = _projection_std(shape)
    for r in range(0, rows.shape[0], step):
        block = rows[r:r + step]
        block.copy_(torch.randn(block.shape, generator=gen).mul_(std))
    return out


# bf16 bits: the sign, the exponent's lowest bit and the 7 mantissa bits (random_bf16 keeps them random)
_SIGN_EXP0_MANTISSA = 0x80FF - (1 << 16)  # as an int16


def random_bf16(shape: tuple[int, ...], gen: torch.Generator, std: float) -> torch.Tensor:
    """Random bf16 values with an rms within a factor 2 of `std`, drawn as bits (int64 words): random sign and
    mantissa, exponent one of two neighbours, so magnitudes are uniform-ish over [2^e, 2^(e+2)).
    rms = 2^e * sqrt(E[(1 + k/128)^2] * (1 + 4) / 2) = 2.41 * 2^e; e rounded to even (the upper exponent bits
    are fixed, the lowest is drawn)."""
    n = math.prod(shape)
    want = math.log2(std / 2.41)
    e = math.floor(want)
    e -= (e + 127) % 2  # the stored exponent e + 127 even: its lowest bit is the random one
    e += 2 if want - e > 1 else 0  # the nearer of the two even neighbours: within 1 of log2, a factor 2
    if not -126 <= e <= 125:
        raise ValueError(f"std {std} is outside bf16's normal range")
    words = torch.randint(-(1 << 63), (1 << 63) - 1, (-(-n // 4),), dtype=torch.int64, generator=gen)
    bits = words.view(torch.int16)[:n]
    bits.bitwise_and_(_SIGN_EXP0_MANTISSA).bitwise_or_((e + 127) << 7)
    return bits.view(torch.bfloat16).reshape(shape)


def random_mxfp4(shape: tuple[int, int], gen: torch.Generator, wide: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Random E2M1 codes with block scales giving weights of std ~ 1/sqrt(fan_in). Codes are drawn
    directly, not encoded from random floats, so large sizes write fast (docs/benchmarks.md). wide: draw the
    code bytes eight at a time as int64 words, 3-6x faster (GBs of experts: k3-slice); other values."""
    out_dim, in_dim = shape
    if wide and (out_dim * in_dim // 2) % 8 == 0:
        words = torch.randint(-(1 << 63), (1 << 63) - 1, (out_dim * in_dim // 16,), dtype=torch.int64, generator=gen)
        packed = words.view(torch.uint8).reshape(out_dim, in_dim // 2)
    else:
        packed = torch.randint(0, 256, (out_dim, in_dim // 2), dtype=torch.uint8, generator=gen)
    code_rms = math.sqrt(sum(v * v for v in mxfp4.E2M1_VALUES) / len(mxfp4.E2M1_VALUES))
    exponent = round(math.log2(1.0 / (math.sqrt(in_dim) * code_rms)))
    jitter = torch.randint(-1, 2, (out_dim, in_dim // 32), generator=gen)
    return packed, (127 + exponent + jitter).to(torch.uint8)
