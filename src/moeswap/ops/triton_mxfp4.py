"""MXFP4 expert matmuls in Triton for CUDA tensors: the packed E2M1 and E8M0 scale bytes (formats/mxfp4.py's
layout) dequantised in registers, no decoded copy ever written. Knows nothing of models or stores; triton is
optional (`available`); CPU tensors run under Triton's interpreter, for parity tests only (very slow).
Entry points: `linear`, `grouped_linear(s)`, `expert`, `grouped_experts` (ops.expert_mxfp4's signatures), and
for CUDA graphs (tables of addresses on the device) `sorted_linears` and `pair_linears`.
Shapes: P rows (pairs), N input width, O output width, G experts.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch

from moeswap.ops.activation import glu

try:
    import triton
    import triton.language as tl
except Exception:  # not installed, or an install that does not load here: either way "not available"
    triton = tl = None

FMA_MAX_ROWS = 8  # up to this many rows per expert multiply as broadcast FMAs (GEMV-like); more in tl.dot (M >= 16)
# tl.dot multiplies bf16 inputs on the tensor cores and fp32 ones as 3-pass TF32: the decoded weights are exact
# in both.
# Tiles sized so that no configuration spills registers on sm_90 (compiled without a GPU by triton's
# bundled ptxas; register counts in docs/benchmarks.md): tests/ops/test_triton_mxfp4.py checks.
# Their speed is not tuned: no GPU has run them yet.
GEMV_TILE = 4096  # elements of one [rows, BLOCK_N, BLOCK_K] product tile in the FMA path (registers)
FP32_DOT_PRECISION = "tf32x3"  # fp32 inputs: x split in two TF32 halves, the weights exact in one


def importable() -> bool:
    return triton is not None


def interpreted() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1 when triton was imported: the
    mode of its own library functions is fixed then), which takes CPU tensors and no CUDA ones."""
    if not importable():
        return False
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4; before it, the variable alone said it
    return bool(knobs.runtime.interpret) if knobs is not None else os.environ.get("TRITON_INTERPRET") == "1"


def available() -> bool:
    """Whether the kernels can run on CUDA tensors here (triton imports, compiles, and a CUDA device is present)."""
    return importable() and not interpreted() and torch.cuda.is_available()


def _dequantize(b, s, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """A [BLOCK_N, BLOCK_K] fp32 weight tile from its packed bytes b [BLOCK_N, BLOCK_K/2] and E8M0 scale bytes
    s [BLOCK_N, BLOCK_K/32] (jitted in `_kernels`, for both kernels)."""
    # byte j holds column 2j in its low nibble: join puts (low, high) last, so reshape interleaves them
    c = tl.join(b & 0xF, b >> 4).reshape(BLOCK_N, BLOCK_K).to(tl.uint32)
    # E2M1 as fp32 bits: index i = c & 7 is 0, 0.5 (biased exponent 126), or (1 + (i & 1) / 2) * 2^((i >> 1) - 1)
    mag = c & 7
    bits = tl.where(mag >= 2, ((126 + (mag >> 1)) << 23) | ((mag & 1) << 22), (mag & 1) * (126 << 23))
    val = (bits | ((c & 8) << 28)).to(tl.float32, bitcast=True)
    # E8M0 byte s is 2^(s - 127): byte 0 is the subnormal 2^-127, 0xFF is NaN
    sb = s.to(tl.uint32)
    sbits = tl.where(sb == 0, 0x400000, tl.where(sb == 255, 0x7FC00000, sb << 23))
    sf = sbits.to(tl.float32, bitcast=True)
    return (val.reshape(BLOCK_N, BLOCK_K // 32, 32) * sf[:, :, None]).reshape(BLOCK_N, BLOCK_K)


def _store(out, acc, mask, BF16: tl.constexpr):
    """Stores fp32 acc, or as bf16 rounded to nearest even on the bits, as torch rounds (Triton's interpreter
    casts by truncating)."""
    if BF16:
        bits = acc.to(tl.uint32, bitcast=True)
        bits = tl.where(acc != acc, 0x7FC00000, bits + 0x7FFF + ((bits >> 16) & 1))
        tl.store(out, (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(out, acc, mask=mask)


def _body(x_ptr, out_ptr, packed_tab, scale_tab, offsets_ptr, G, N, O, stride_x, stride_out, stride_set,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr,
          BF16: tl.constexpr, BF16_DOT: tl.constexpr, FP32_PRECISION: tl.constexpr, ABSENT_ZERO: tl.constexpr):
    """Program (s G + g, n, m): rows offsets[g] + m*BLOCK_M ... of expert g times columns n*BLOCK_N ... of its
    matrix s (gate, up) transposed, into out + s * stride_set. packed_tab / scale_tab [S G]: int64 addresses
    of each matrix's packed [O, N/2] and scale [O, N/32] bytes; address 0 (an expert a graphed step's device
    table lacks): its rows come out NaN, or zero with ABSENT_ZERO, and nothing is read (annotations are
    strings, from __future__: this module imports without triton)."""
    pid = tl.program_id(0)
    g = pid % G
    pid_n = tl.program_id(1)
    pid_m = tl.program_id(2)
    row_end = tl.load(offsets_ptr + g + 1)
    m0 = tl.load(offsets_ptr + g) + pid_m * BLOCK_M
    if m0 < row_end:  # the grid is sized for the largest expert's rows
        addr = tl.load(packed_tab + pid)
        out_ptr = out_ptr + (pid // G).to(tl.int64) * stride_set
        rows = m0 + tl.arange(0, BLOCK_M)
        rmask = rows < row_end
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < O
        out = out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
        if addr == 0:  # absent (a branch, not masks: the compute below keeps its registers)
            absent = tl.full((BLOCK_M, BLOCK_N), 0.0 if ABSENT_ZERO else float("nan"), dtype=tl.float32)
            _store(out, absent, rmask[:, None] & cmask[None, :], BF16)
        else:
            packed = addr.to(tl.pointer_type(tl.uint8))
            scale = tl.load(scale_tab + pid).to(tl.pointer_type(tl.uint8))
            half = tl.arange(0, BLOCK_K // 2)
            blk = tl.arange(0, BLOCK_K // 32)
            kk = tl.arange(0, BLOCK_K)
            w_row = cols.to(tl.int64)[:, None]
            x_row = rows.to(tl.int64)[:, None] * stride_x
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, N, BLOCK_K):  # N is a multiple of BLOCK_K (chosen so): no mask along k
                b = tl.load(packed + w_row * (N // 2) + (k0 // 2 + half)[None, :], mask=cmask[:, None], other=0)
                s = tl.load(scale + w_row * (N // 32) + (k0 // 32 + blk)[None, :], mask=cmask[:, None], other=127)
                w = _dequantize(b, s, BLOCK_N, BLOCK_K)
                x = tl.load(x_ptr + x_row + (k0 + kk)[None, :], mask=rmask[:, None], other=0.0)
                if DOT:
                    if BF16_DOT:  # x is bf16; E2M1 times a power of two is exact in bf16
                        acc = tl.dot(x.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)), acc)
                    else:
                        acc = tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision=FP32_PRECISION)
                else:
                    acc += tl.sum(x.to(tl.float32)[:, None, :] * w[None, :, :], axis=2)
            _store(out, acc, rmask[:, None] & cmask[None, :], BF16)


def _pair_body(x_ptr, experts_ptr, packed_tab, scale_tab, out_ptr, P, E, N, O, stride_x, stride_out, stride_set,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WEIGHTS: tl.constexpr, BF16: tl.constexpr,
               ABSENT_ZERO: tl.constexpr):
    """Program (s P + p, n): row p of x times columns n*BLOCK_N ... of matrix s of expert experts[p] transposed,
    into out + s * stride_set. The expert's bytes come from tables [S, E] on the device (int64 addresses:
    MXFP4 packed [O, N/2] and scale [O, N/32] bytes, or a float [O, N] matrix and 0; WEIGHTS 0 MXFP4, 1 bf16,
    2 fp32), so nothing of a step's routing is read by the host: the launch can be captured in a CUDA graph.
    A row whose expert has address 0 (not resident) comes out NaN, which the step's finite check reports, or
    zero with ABSENT_ZERO (hybrid experts: the CPU computes those); nothing is read at address 0."""
    pid = tl.program_id(0)
    s = pid // P
    p = pid % P
    e = tl.load(experts_ptr + p).to(tl.int64)
    addr = tl.load(packed_tab + s * E + e)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < O
    out = out_ptr + s.to(tl.int64) * stride_set + p.to(tl.int64) * stride_out + cols
    if addr == 0:  # absent (a branch, as in _body)
        _store(out, tl.full((BLOCK_N,), 0.0 if ABSENT_ZERO else float("nan"), dtype=tl.float32), cmask, BF16)
    else:
        w_row = cols.to(tl.int64)[:, None]
        kk = tl.arange(0, BLOCK_K)
        x_row = x_ptr + p.to(tl.int64) * stride_x
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        if WEIGHTS == 0:
            packed = addr.to(tl.pointer_type(tl.uint8))
            scale = tl.load(scale_tab + s * E + e).to(tl.pointer_type(tl.uint8))
            half = tl.arange(0, BLOCK_K // 2)
            blk = tl.arange(0, BLOCK_K // 32)
            for k0 in range(0, N, BLOCK_K):  # N is a multiple of BLOCK_K (chosen so): no mask along k
                b = tl.load(packed + w_row * (N // 2) + (k0 // 2 + half)[None, :], mask=cmask[:, None], other=0)
                sc = tl.load(scale + w_row * (N // 32) + (k0 // 32 + blk)[None, :], mask=cmask[:, None], other=127)
                x = tl.load(x_row + k0 + kk).to(tl.float32)
                acc += tl.sum(_dequantize(b, sc, BLOCK_N, BLOCK_K) * x[None, :], axis=1)
        else:
            weights = addr.to(tl.pointer_type(tl.bfloat16 if WEIGHTS == 1 else tl.float32))
            for k0 in range(0, N, BLOCK_K):
                kmask = (k0 + kk) < N
                w = tl.load(weights + w_row * N + (k0 + kk)[None, :], mask=cmask[:, None] & kmask[None, :],
                            other=0.0)
                x = tl.load(x_row + k0 + kk, mask=kmask, other=0.0).to(tl.float32)
                acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        _store(out, acc, cmask, BF16)


@functools.cache
def _kernels():
    """The kernels (grouped, pair), decorated at first use (so that importing this module costs nothing more);
    their shared device functions are decorated in place first, as the kernels call them by name."""
    globals()["_dequantize"] = triton.jit(_dequantize)
    globals()["_store"] = triton.jit(_store)
    return triton.jit(_body), triton.jit(_pair_body)


def _kernel():
    return _kernels()[0]


def _check_device(device: torch.device) -> None:
    if triton is None:
        raise RuntimeError("the Triton MXFP4 kernels need the triton package, which does not import here")
    # the interpreter reads the pointer table's addresses as host memory; compiled kernels as device memory
    if device.type == "cpu" and not interpreted():
        raise RuntimeError("the Triton MXFP4 kernels take CPU tensors only under Triton's interpreter: set "
                           "TRITON_INTERPRET=1 before triton is imported")
    if device.type == "cuda" and interpreted():
        raise RuntimeError("the Triton MXFP4 kernels take CUDA tensors only compiled: TRITON_INTERPRET=1 is set")
    if device.type not in ("cpu", "cuda"):
        raise RuntimeError(f"the Triton MXFP4 kernels take CUDA tensors, got {device.type} ones")


def _block_k(N: int) -> int:
    return next(b for b in (128, 64, 32) if N % b == 0)


def _tiles(max_rows: int, N: int, bf16: bool) -> tuple[int, int, int, bool, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, DOT, num_warps) for experts of at most max_rows rows, input width N, bf16
    or fp32 inputs (3-pass TF32 holds more registers: BLOCK_K 32)."""
    if max_rows > FMA_MAX_ROWS:
        block_m = 16 if max_rows <= 16 else 32 if max_rows <= 32 else 64
        return block_m, 64, min(64 if bf16 else 32, _block_k(N)), True, 4 if block_m == 16 else 8
    block_m = 1 << max(0, (max_rows - 1).bit_length())
    block_k = min(_block_k(N), max(32, 128 // block_m))
    block_n = max(16, min(64, GEMV_TILE // (block_m * block_k)))
    return block_m, block_n, block_k, False, 4


def configs(bf16: bool, N: int = 3584) -> list[tuple[int, int, int, bool, int]]:
    """Every tile configuration `_tiles` gives for input width N and this input dtype (what a GPU compiles)."""
    return sorted({_tiles(rows, N, bf16) for rows in range(1, 65)})


def grouped_linear(x_PN: torch.Tensor, offsets: Sequence[int], mats: Sequence[tuple[torch.Tensor, torch.Tensor]],
                   ) -> torch.Tensor:
    """y[P, O]: rows offsets[g]:offsets[g+1] of x (fp32 or bf16, rows sorted by expert) times expert g's W^T,
    mats[g] = (packed uint8 [O, N/2], scale uint8 [O, N/32]), all on x's device, all of one shape. One launch."""
    return grouped_linears(x_PN, offsets, [mats])[0]


def grouped_linears(x_PN: torch.Tensor, offsets: Sequence[int],
                    sets: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]]) -> torch.Tensor:
    """y[S, P, O]: `grouped_linear` for S matrices per expert on the same rows (an expert's gate and up), in one
    launch: sets[s][g] is expert g's matrix s."""
    G = len(offsets) - 1
    if G < 0 or any(len(mats) != G for mats in sets):
        raise ValueError(f"grouped_linear: {len(offsets)} offsets for {[len(m) for m in sets]} experts; "
                         f"expected one more offset than experts")
    _check_x(x_PN, "grouped_linear")
    _check_device(x_PN.device)
    P, N = x_PN.shape
    if offsets and (offsets[0] != 0 or offsets[-1] != P or any(b < a for a, b in zip(offsets, offsets[1:]))):
        raise ValueError(f"grouped_linear: offsets {list(offsets)} must rise from 0 to the {P} rows of x")
    O = sets[0][0][0].shape[0] if sets and G else 0
    held = []  # contiguous copies (if any) live until the launch is done
    for packed, scale in (m for mats in sets for m in mats):
        if (packed.dtype != torch.uint8 or tuple(packed.shape) != (O, N // 2) or tuple(scale.shape) != (O, N // 32)
                or packed.device != x_PN.device or scale.device != x_PN.device):
            raise ValueError(f"grouped_linear: expert bytes {packed.dtype} {list(packed.shape)} + scales "
                             f"{list(scale.shape)} on {packed.device}; expected uint8 [{O}, {N // 2}] + [{O}, {N // 32}] "
                             f"on {x_PN.device}")
        held.append((packed.contiguous(), scale.contiguous().view(torch.uint8)))
    out = torch.empty(len(sets), P, O, dtype=x_PN.dtype, device=x_PN.device)
    if P == 0 or O == 0 or G == 0 or not sets:
        return out
    max_rows = max(offsets[g + 1] - offsets[g] for g in range(G))
    dev = x_PN.device
    tables = torch.tensor([[p.data_ptr() for p, _ in held], [s.data_ptr() for _, s in held]], dtype=torch.int64)
    offs = torch.tensor(list(offsets), dtype=torch.int32)
    if dev.type != "cpu":
        tables, offs = tables.to(dev, non_blocking=True), offs.to(dev, non_blocking=True)
    _launch_grouped(x_PN, out, tables[0], tables[1], offs, G, O, max_rows, absent_zero=False)
    return out


def _launch_grouped(x_PN: torch.Tensor, out: torch.Tensor, packed_tab: torch.Tensor, scale_tab: torch.Tensor,
                    offsets: torch.Tensor, G: int, O: int, max_rows: int, absent_zero: bool) -> None:
    """The grouped kernel over S = out.shape[0] matrices of G experts (tables of S G addresses, int32 offsets
    [G + 1], all on x's device), its grid sized for `max_rows` rows per expert."""
    x = x_PN if x_PN.stride(-1) == 1 else x_PN.contiguous()
    N = x.shape[1]
    bf16 = x.dtype == torch.bfloat16
    block_m, block_n, block_k, dot, warps = _tiles(max_rows, N, bf16)
    grid = (out.shape[0] * G, -(-O // block_n), -(-max_rows // block_m))
    # Triton 3.8's interpreter multiplies bf16 tl.dot operands as their uint16 bits: there bf16 tiles
    # multiply as fp32 instead, which gives the same exact products and fp32 sums
    _kernel()[grid](
        x, out, packed_tab, scale_tab, offsets, G, N, O, x.stride(0), out.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT=dot, BF16=bf16, BF16_DOT=bf16 and not interpreted(),
        FP32_PRECISION=FP32_DOT_PRECISION, ABSENT_ZERO=absent_zero, num_warps=warps)


PAIR_WEIGHTS = {"mxfp4": 0, torch.bfloat16: 1, torch.float32: 2}  # `pair_linears`' weight kinds -> WEIGHTS


def pair_tiles(N: int, weights) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) of `pair_linears` for input width N: the FMA path's tiles for one row."""
    block_k = _block_k(N) if weights == "mxfp4" else 64  # float rows are masked along k: any N
    return max(16, min(64, GEMV_TILE // block_k)), block_k


def _check_tables(x_PN: torch.Tensor, packed_SE: torch.Tensor, scale_SE: torch.Tensor, name: str) -> None:
    for t in (packed_SE, scale_SE):
        if t.dim() != 2 or t.dtype != torch.int64 or not t.is_contiguous() or t.device != x_PN.device:
            raise ValueError(f"{name}: tables must be contiguous int64 [S, E] on {x_PN.device}, got "
                             f"{t.dtype} {list(t.shape)} on {t.device}")
    if packed_SE.shape != scale_SE.shape:
        raise ValueError(f"{name}: packed {list(packed_SE.shape)} and scale {list(scale_SE.shape)} tables differ")


def _check_x(x_PN: torch.Tensor, name: str, mxfp4: bool = True) -> None:
    """x is fp32 or bf16 [P, N], N a whole number of MXFP4 blocks where it multiplies MXFP4 matrices."""
    if x_PN.dim() != 2 or x_PN.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"{name}: x must be fp32 or bf16 [P, N], got {x_PN.dtype} {list(x_PN.shape)}")
    if mxfp4 and x_PN.shape[1] % 32:
        raise ValueError(f"{name}: input width {x_PN.shape[1]} is not a multiple of the MXFP4 block (32)")


def pair_linears(x_PN: torch.Tensor, experts_P: torch.Tensor, packed_SE: torch.Tensor, scale_SE: torch.Tensor,
                 O: int, weights="mxfp4", absent_zero: bool = False) -> torch.Tensor:
    """y[S, P, O]: row p of x (fp32 or bf16) times matrix s of expert experts_P[p] transposed, for every s of the
    tables [S, E] (int64 addresses on x's device of each expert's matrix s: MXFP4 packed [O, N/2] and scale
    [O, N/32] bytes, or a float [O, N] matrix and 0; `weights` is "mxfp4", torch.bfloat16 or torch.float32;
    address 0: not resident, its rows come out NaN, or zero with `absent_zero`). One launch; the host reads
    no tensor's data (only shapes), so a CUDA graph can capture it while the tables change between replays.
    Each row reads its expert's weights: best where few rows share an expert (`sorted_linears` otherwise)."""
    if weights not in PAIR_WEIGHTS:
        raise ValueError(f"pair_linears: weights {weights!r} is none of {list(PAIR_WEIGHTS)}")
    _check_x(x_PN, "pair_linears", mxfp4=weights == "mxfp4")
    P, N = x_PN.shape
    _check_tables(x_PN, packed_SE, scale_SE, "pair_linears")
    if experts_P.shape != (P,) or experts_P.dtype not in (torch.int32, torch.int64) or experts_P.device != x_PN.device:
        raise ValueError(f"pair_linears: experts must be int32/int64 [{P}] on {x_PN.device}, got "
                         f"{experts_P.dtype} {list(experts_P.shape)} on {experts_P.device}")
    _check_device(x_PN.device)
    S, E = packed_SE.shape
    out = torch.empty(S, P, O, dtype=x_PN.dtype, device=x_PN.device)
    if P == 0 or O == 0 or S == 0:
        return out
    x = x_PN if x_PN.stride(-1) == 1 else x_PN.contiguous()
    experts = experts_P if experts_P.is_contiguous() else experts_P.contiguous()
    block_n, block_k = pair_tiles(N, weights)
    _kernels()[1][(S * P, -(-O // block_n))](
        x, experts, packed_SE, scale_SE, out, P, E, N, O, x.stride(0), out.stride(1), out.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, WEIGHTS=PAIR_WEIGHTS[weights], BF16=x.dtype == torch.bfloat16,
        ABSENT_ZERO=absent_zero, num_warps=4)
    return out


def sorted_linears(x_PN: torch.Tensor, offsets_E1: torch.Tensor, packed_SE: torch.Tensor, scale_SE: torch.Tensor,
                   O: int, max_rows: int, absent_zero: bool = False) -> torch.Tensor:
    """y[S, P, O]: `grouped_linears` with everything on the device, for a CUDA graph: rows of x sorted by expert,
    expert e's rows offsets_E1[e]:offsets_E1[e+1] (int32 [E + 1], on x's device, made there), its MXFP4 matrix
    s at packed_SE / scale_SE[s, e] (address 0: NaN rows, or zero with `absent_zero`). The grid covers every
    expert and `max_rows` rows of each (a bound the caller knows: a step's tokens, as a token routes to an
    expert once), so nothing is read on the host; the experts without rows end at once. An expert's weights
    are read once for all its rows (tl.dot above FMA_MAX_ROWS), which `pair_linears` does not."""
    _check_x(x_PN, "sorted_linears")
    _check_tables(x_PN, packed_SE, scale_SE, "sorted_linears")
    P = x_PN.shape[0]
    S, E = packed_SE.shape
    if offsets_E1.shape != (E + 1,) or offsets_E1.dtype != torch.int32 or offsets_E1.device != x_PN.device:
        raise ValueError(f"sorted_linears: offsets must be int32 [{E + 1}] on {x_PN.device}, got "
                         f"{offsets_E1.dtype} {list(offsets_E1.shape)} on {offsets_E1.device}")
    _check_device(x_PN.device)
    out = torch.empty(S, P, O, dtype=x_PN.dtype, device=x_PN.device)
    if P == 0 or O == 0 or S == 0 or E == 0 or max_rows < 1:
        return out
    _launch_grouped(x_PN, out, packed_SE, scale_SE, offsets_E1, E, O, max_rows, absent_zero)
    return out


def linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x @ W^T for one MXFP4 matrix (x [..., N] fp32 or bf16; the result in x's dtype)."""
    x_PN = x.reshape(-1, x.shape[-1])
    y = grouped_linear(x_PN, [0, x_PN.shape[0]], [(packed, scale)])
    return y.reshape(*x.shape[:-1], packed.shape[0])


def expert(w, x_TI: torch.Tensor, act: str, situ_betas: tuple[float, float]) -> torch.Tensor:
    """w2 act(w1 x, w3 x) for one MXFP4ExpertWeights, in x's dtype (the activation in torch, as the reference)."""
    x_PI = x_TI.reshape(-1, x_TI.shape[-1])
    offsets = [0, x_PI.shape[0]]
    gate, up = grouped_linears(x_PI, offsets, [[(w.w1_packed, w.w1_scale)], [(w.w3_packed, w.w3_scale)]])
    y_PI = grouped_linear(glu(act, gate, up, situ_betas), offsets, [(w.w2_packed, w.w2_scale)])
    return y_PI.reshape(*x_TI.shape[:-1], y_PI.shape[-1])


def grouped_experts(h_TI: torch.Tensor, experts: Sequence, tokens_P: torch.Tensor, offsets: Sequence[int],
                    weights_P: torch.Tensor, act: str, situ_betas: tuple[float, float], out_TI: torch.Tensor,
                    int8_activations: bool = False) -> None:
    """Adds each expert's weighted output to out_TI (fp32 [T, I]) for its pairs: two launches for all the
    experts of a group (gate and up together, then down), the activation in torch between them.
    int8_activations is the CPU kernel's option (ops.expert_mxfp4.reference_int8) and has no effect here."""
    dev = h_TI.device
    tokens = tokens_P.to(dev)
    x_PI = h_TI.index_select(0, tokens)
    gate, up = grouped_linears(x_PI, offsets, [[(e.w1_packed, e.w1_scale) for e in experts],
                                               [(e.w3_packed, e.w3_scale) for e in experts]])
    y_PI = grouped_linear(glu(act, gate, up, situ_betas), offsets, [(e.w2_packed, e.w2_scale) for e in experts])
    out_TI.index_add_(0, tokens, y_PI.float() * weights_P.to(device=dev, dtype=torch.float32)[:, None])
