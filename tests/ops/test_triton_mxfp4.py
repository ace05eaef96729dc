"""ops/triton_mxfp4: the Triton MXFP4 kernels equal the plain-torch reference (formats.mxfp4.decode in fp32,
then a matmul): on the CPU under Triton's interpreter (TRITON_INTERPRET=1, which tests/conftest.py sets
without a GPU before triton is imported), and compiled on CUDA (marked cuda). Every nibble is tried under
every E8M0 scale byte, bit for bit; the FMA (few rows) and tl.dot (more than FMA_MAX_ROWS) paths, single and
grouped launches, and the expert and MoE-step entry points. Skipped where triton does not import."""

from __future__ import annotations

import pytest
import torch

from moeswap.formats import mxfp4
from moeswap.ops import expert_mxfp4 as em
from moeswap.ops import triton_mxfp4 as tm
from moeswap.ops.expert import MXFP4ExpertWeights

BETAS = (4.0, 25.0)
EPS32 = 2.0**-24

needs_triton = pytest.mark.skipif(not tm.importable(), reason="triton does not import here")
interpreted = pytest.mark.skipif(not tm.interpreted(), reason="needs Triton's interpreter (TRITON_INTERPRET=1 "
                                 "set before triton was imported)")
cuda_only = pytest.mark.skipif(not tm.available(), reason="needs triton and a CUDA device")


def every_nibble_under_every_scale() -> tuple[torch.Tensor, torch.Tensor]:
    """[128, 32] packed + [128, 2] scale (in = 64): scale byte 2o + b for block b of row o (all 256 bytes);
    each block's 16 bytes hold all 16 nibbles in the low half and, rotated by the row, in the high half."""
    o = torch.arange(128)[:, None]
    j = torch.arange(32)[None, :]
    low, high = j % 16, (j % 16 + o) % 16
    packed = (low | (high << 4)).to(torch.uint8)
    scale = (2 * o + torch.arange(2)[None, :]).to(torch.uint8)
    return packed, scale


def random_matrix(out_dim: int, in_dim: int, gen: torch.Generator, scale_range=(118, 134)):
    packed = torch.randint(0, 256, (out_dim, in_dim // 2), dtype=torch.uint8, generator=gen)
    return packed, torch.randint(*scale_range, (out_dim, in_dim // 32), dtype=torch.uint8, generator=gen)


def random_expert(in_dim: int, expert_dim: int, seed: int, device="cpu") -> MXFP4ExpertWeights:
    gen = torch.Generator().manual_seed(seed)
    mats = [random_matrix(expert_dim, in_dim, gen), random_matrix(expert_dim, in_dim, gen),
            random_matrix(in_dim, expert_dim, gen)]
    return MXFP4ExpertWeights(*(t.to(device) for pair in mats for t in pair))


def reference_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.float() @ mxfp4.decode(packed, scale, torch.float32).T


def assert_within_bound(got: torch.Tensor, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> None:
    """got = x W^T up to what reordering an fp32 sum may change (n u sum |x||w|), plus the rounding of the
    output to got's dtype (and of x to bf16: exact here, x is made in bf16)."""
    W = mxfp4.decode(packed, scale, torch.float32)
    want = x.float() @ W.T
    bound = 2 * x.shape[-1] * EPS32 * (x.float().abs() @ W.abs().T)
    if got.dtype == torch.bfloat16:
        bound = bound + 2.0**-8 * want.abs()
    assert got.shape == want.shape
    if got.numel() == 0:
        return
    excess = ((got.float() - want).abs() - bound).max().item()
    assert excess <= 0, f"off by more than the summation bound (excess {excess})"


# -- on the CPU, under the interpreter -----------------------------------------------------------------


@needs_triton
@interpreted
@pytest.mark.filterwarnings("ignore:overflow encountered", "ignore:invalid value encountered")  # numpy: Inf, NaN
@pytest.mark.parametrize("rows,dtype", [(1, torch.float32), (4, torch.float32), (64, torch.float32),
                                        (2, torch.bfloat16), (64, torch.bfloat16)])  # FMA path; tl.dot at 64
def test_every_nibble_under_every_scale_byte_bit_for_bit(rows, dtype):
    """One-hot inputs pick single weights: the kernel's decode must be the reference's, bit for bit, from
    the subnormal 2^-127 (byte 0) up, with ±Inf (products past fp32) and NaN (byte 255) where it has them
    (every decoded weight is exact in bf16 too)."""
    packed, scale = every_nibble_under_every_scale()
    eye = torch.eye(64, dtype=dtype)
    W = mxfp4.decode(packed, scale, torch.float32)
    for r in range(0, 64, rows):
        x = eye[r : r + rows]
        got = tm.linear(x, packed, scale)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), x.float() @ W.T, rtol=0, atol=0, equal_nan=True)
        finite = W.isfinite().all(1)  # columns whose other products are not 0 x Inf or NaN
        assert torch.equal(got[:, finite].float(), W[finite, r : r + rows].T)
    assert finite.sum() == 126 and W[~W.isfinite()].numel() > 0  # rows 0-125 (scale bytes 0-251) are finite


@needs_triton
@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,N,O", [(1, 64, 32), (2, 128, 96), (3, 96, 40), (5, 64, 96), (17, 128, 40)])
def test_linear_matches_the_reference(T, N, O, dtype):
    gen = torch.Generator().manual_seed(T * 1000 + N + O)
    packed, scale = random_matrix(O, N, gen)
    x = torch.randn(T, N, generator=gen).to(dtype)
    got = tm.linear(x, packed, scale)
    assert got.dtype == dtype
    assert_within_bound(got, x, packed, scale)


@needs_triton
@interpreted
def test_all_256_bytes_and_leading_dims():
    gen = torch.Generator().manual_seed(3)
    packed = (torch.arange(32 * 64) % 256).to(torch.uint8).reshape(32, 64)[torch.randperm(32, generator=gen)]
    scale = torch.randint(110, 140, (32, 4), dtype=torch.uint8, generator=gen)
    x = torch.randn(2, 3, 128, generator=gen)
    got = tm.linear(x, packed, scale)
    assert got.shape == (2, 3, 32)
    assert_within_bound(got.reshape(6, 32), x.reshape(6, 128), packed, scale)


@needs_triton
@interpreted
@pytest.mark.parametrize("counts", [[2, 0, 5], [1, 1, 1, 1], [17, 3], [0, 20]])
def test_grouped_linear_is_each_expert_on_its_rows(counts):
    gen = torch.Generator().manual_seed(sum(counts))
    mats = [random_matrix(40, 64, gen) for _ in counts]
    offsets = [0]
    for n in counts:
        offsets.append(offsets[-1] + n)
    x = torch.randn(offsets[-1], 64, generator=gen)
    got = tm.grouped_linear(x, offsets, mats)
    for g, (packed, scale) in enumerate(mats):
        rows = slice(offsets[g], offsets[g + 1])
        assert_within_bound(got[rows], x[rows], packed, scale)


@needs_triton
@interpreted
def test_grouped_linears_share_rows_across_sets():
    """Gate and up in one launch: set s of expert g multiplies the same rows as set 0 does."""
    gen = torch.Generator().manual_seed(11)
    offsets = [0, 3, 4, 4, 6]
    sets = [[random_matrix(48, 96, gen) for _ in range(4)] for _ in range(2)]
    x = torch.randn(6, 96, generator=gen).bfloat16()
    got = tm.grouped_linears(x, offsets, sets)
    assert got.shape == (2, 6, 48) and got.dtype == torch.bfloat16
    for s, mats in enumerate(sets):
        for g, (packed, scale) in enumerate(mats):
            rows = slice(offsets[g], offsets[g + 1])
            assert_within_bound(got[s, rows], x[rows], packed, scale)


@needs_triton
@interpreted
def test_grouped_linear_names_bad_input():
    gen = torch.Generator().manual_seed(0)
    a, b = random_matrix(32, 64, gen), random_matrix(40, 64, gen)
    x = torch.randn(3, 64)
    with pytest.raises(ValueError, match="expected uint8 \\[32, 32\\]"):
        tm.grouped_linear(x, [0, 1, 3], [a, b])
    with pytest.raises(ValueError, match="3 offsets for \\[1\\] experts"):
        tm.grouped_linear(x, [0, 1, 3], [a])
    with pytest.raises(ValueError, match="must rise from 0 to the 3 rows"):
        tm.grouped_linear(x, [0, 2], [a])
    with pytest.raises(ValueError, match="fp32 or bf16"):
        tm.grouped_linear(x.double(), [0, 3], [a])


def _tables(sets) -> tuple[torch.Tensor, torch.Tensor]:
    """[S, E] int64 addresses of sets[s][e]'s packed bytes (or float matrix) and scale bytes (or 0); None: absent."""
    packed = torch.zeros(len(sets), len(sets[0]), dtype=torch.int64)
    scale = torch.zeros_like(packed)
    for s, mats in enumerate(sets):
        for e, m in enumerate(mats):
            if isinstance(m, tuple):
                packed[s, e], scale[s, e] = m[0].data_ptr(), m[1].data_ptr()
            elif m is not None:
                packed[s, e] = m.data_ptr()
    return packed, scale


@needs_triton
@interpreted
@pytest.mark.filterwarnings("ignore:invalid value encountered")  # numpy: the absent expert's NaN
@pytest.mark.parametrize("dtype,ids_dtype", [(torch.float32, torch.int64), (torch.bfloat16, torch.int32)])
def test_pair_linears_is_each_rows_expert_from_the_device_table(dtype, ids_dtype):
    """Row p times set s of expert experts[p], the expert's bytes found through the table (as a graphed decode
    step finds them: engine/cuda_graph.py); an expert whose address is 0 gives a NaN row, never zeros."""
    gen = torch.Generator().manual_seed(5)
    sets = [[random_matrix(40, 96, gen) for _ in range(5)] for _ in range(2)]
    sets[0][3] = sets[1][3] = None  # not resident
    experts = torch.tensor([4, 0, 4, 1, 3, 2, 0], dtype=ids_dtype)
    x = torch.randn(7, 96, generator=gen).to(dtype)
    got = tm.pair_linears(x, experts, *_tables(sets), 40)
    assert got.shape == (2, 7, 40) and got.dtype == dtype
    zeroed = tm.pair_linears(x, experts, *_tables(sets), 40, absent_zero=True)  # hybrid experts' rows: the CPU's
    assert (zeroed[:, 4] == 0).all() and torch.equal(zeroed[:, :4], got[:, :4])
    for s, mats in enumerate(sets):
        for p, e in enumerate(experts.tolist()):
            if mats[e] is None:
                assert got[s, p].isnan().all()
            else:
                assert_within_bound(got[s, p : p + 1], x[p : p + 1], *mats[e])


@needs_triton
@interpreted
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
def test_pair_linears_takes_float_experts(wdtype):
    """bf16 and fp32 experts (Kimi Linear's), input width not a multiple of the tile (masked along k)."""
    gen = torch.Generator().manual_seed(6)
    mats = [torch.randn(24, 80, generator=gen).to(wdtype) for _ in range(3)]
    experts = torch.tensor([2, 2, 0, 1])
    x = torch.randn(4, 80, generator=gen)
    got = tm.pair_linears(x, experts, *_tables([mats]), 24, wdtype)[0]
    want = torch.stack([x[p] @ mats[e].float().T for p, e in enumerate(experts.tolist())])
    bound = 2 * 80 * EPS32 * torch.stack([x[p].abs() @ mats[e].float().abs().T for p, e in enumerate(experts.tolist())])
    assert ((got - want).abs() <= bound).all()


@needs_triton
@interpreted
def test_pair_linears_names_bad_input():
    x, experts, table = torch.randn(3, 64), torch.zeros(3, dtype=torch.int64), torch.zeros(2, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="tables must be contiguous int64 \\[S, E\\]"):
        tm.pair_linears(x, experts, table.int(), table, 32)
    with pytest.raises(ValueError, match="packed \\[2, 4\\] and scale \\[2, 3\\] tables differ"):
        tm.pair_linears(x, experts, table, table[:, :3].contiguous(), 32)
    with pytest.raises(ValueError, match="experts must be int32/int64 \\[3\\]"):
        tm.pair_linears(x, experts[:2], table, table, 32)
    with pytest.raises(ValueError, match="not a multiple of the MXFP4 block"):
        tm.pair_linears(torch.randn(3, 40), experts, table, table, 32)
    with pytest.raises(ValueError, match="weights torch.float16 is none of"):
        tm.pair_linears(x, experts, table, table, 32, torch.float16)
    with pytest.raises(ValueError, match="offsets must be int32 \\[5\\]"):
        tm.sorted_linears(x, torch.zeros(4, dtype=torch.int32), table, table, 32, 3)


@needs_triton
@interpreted
@pytest.mark.filterwarnings("ignore:invalid value encountered")  # numpy: the absent expert's NaN
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sorted_linears_groups_rows_by_expert_on_the_device(dtype):
    """Rows sorted by expert, offsets and addresses as device tensors, the grid bounded by max_rows (FMA rows at 3,
    tl.dot at 20): each expert's rows times its matrices; experts without rows untouched, an absent expert's rows
    NaN (zero with absent_zero)."""
    gen = torch.Generator().manual_seed(9)
    E = 6
    sets = [[random_matrix(40, 64, gen) for _ in range(E)] for _ in range(2)]
    sets[0][4] = sets[1][4] = None
    for counts in ([3, 0, 1, 2, 1, 0], [20, 0, 0, 17, 0, 3]):
        offsets = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32)
        x = torch.randn(offsets[-1], 64, generator=gen).to(dtype)
        got = tm.sorted_linears(x, offsets, *_tables(sets), 40, max(counts))
        zeroed = tm.sorted_linears(x, offsets, *_tables(sets), 40, max(counts), absent_zero=True)
        for s, mats in enumerate(sets):
            for e, m in enumerate(mats):
                rows = slice(int(offsets[e]), int(offsets[e + 1]))
                if m is None:
                    assert got[s, rows].isnan().all() and (zeroed[s, rows] == 0).all()
                else:
                    assert_within_bound(got[s, rows], x[rows], *m)
                    assert torch.equal(zeroed[s, rows], got[s, rows])


@needs_triton
@interpreted
@pytest.mark.parametrize("tokens", [1, 3, 18])
@pytest.mark.parametrize("act", ["situ", "silu"])
def test_expert_matches_the_reference(tokens, act):
    w = random_expert(64, 96, seed=tokens)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(1))
    got, want = em.IMPLEMENTATIONS["triton"](w, x, act, BETAS), em.reference(w, x, act, BETAS)
    # fp32 sums in another order: a few ulps of the largest output (as tests/ops/test_expert_mxfp4.py)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6 * want.abs().max().item())


@needs_triton
@interpreted
def test_grouped_experts_is_the_weighted_sum_of_references():
    """The MoE step's grouped form (ops.expert_mxfp4.grouped's signature) adds each pair's weighted expert
    output to its token's row, as a loop over experts with the reference does."""
    T, I, F = 5, 64, 32
    experts = [random_expert(I, F, seed=s) for s in range(3)]
    gen = torch.Generator().manual_seed(7)
    h = torch.randn(T, I, generator=gen)
    tokens = torch.tensor([0, 2, 4, 1, 0, 3, 4])  # expert 0: tokens 0 2 4; expert 1: 1 0; expert 2: 3 4
    offsets = [0, 3, 5, 7]
    weights = torch.rand(7, generator=gen)
    out = torch.full((T, I), 0.5)
    tm.grouped_experts(h, experts, tokens, offsets, weights, "situ", BETAS, out)
    want = torch.full((T, I), 0.5)
    for g, e in enumerate(experts):
        rows = tokens[offsets[g] : offsets[g + 1]]
        want.index_add_(0, rows, em.reference(e, h[rows], "situ", BETAS) * weights[offsets[g] : offsets[g + 1], None])
    torch.testing.assert_close(out, want, rtol=2e-6, atol=2e-6 * want.abs().max().item())


@needs_triton
@interpreted
def test_moe_block_groups_experts_through_the_triton_step(tiny_k3_dir, monkeypatch):
    """The tiny K3's MoE blocks with the CUDA grouping (ops.expert_mxfp4.grouped / group_kind as they answer
    for CUDA tensors) swapped in on CPU tensors: the same routed outputs as the CPU kernels give."""
    from moeswap.models.layers.moe import MoE
    from moeswap.models.loader import LoadOptions, load_model

    model, _ = load_model(tiny_k3_dir, LoadOptions(dtype="float32"))
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    gen = torch.Generator().manual_seed(5)
    from moeswap.experts.executors import ResidentTableExecutor

    monkeypatch.setattr(ResidentTableExecutor, "step_table", lambda self, h, ids: None)  # the CPU kernel's table
    with torch.no_grad():
        cases = []
        for m in moes[:2]:
            h = torch.randn(3, m.routed_expert_down_proj.out_features if hasattr(m, "routed_expert_down_proj")
                            else model.config.hidden_size, generator=gen)
            ids, w = m.gate(torch.randn(3, model.config.hidden_size, generator=gen))
            cases.append((m, h, ids, w, m.run_experts(h, ids, w)))
        calls = []

        def grouped(device_type="cpu"):
            def run(*args, **kwargs):
                calls.append(len(args[1]))
                return tm.grouped_experts(*args, **kwargs)
            return run

        monkeypatch.setattr(em, "grouped", grouped)
        monkeypatch.setattr(em, "group_kind", lambda w, device_type: "mxfp4" if isinstance(w, MXFP4ExpertWeights) else None)
        for m, h, ids, w, want in cases:
            got = m.run_experts(h, ids, w)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert len(calls) == len(cases) and all(n == len(set(ids.flatten().tolist())) for n, (_, _, ids, _, _) in zip(calls, cases))


COMPILE_FOR_SM90 = r"""
import json, os, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from moeswap.ops import triton_mxfp4 as tm

fn, pair = tm._kernels()
bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
result = []


def usage(kernel, sig, const, warps, config):  # registers and stack bytes of the sm_90 cubin (cuobjdump)
    k = triton.compile(triton.compiler.ASTSource(kernel, sig, const), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps})
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    out = subprocess.run([os.path.join(bindir, "cuobjdump"), "-res-usage", f.name], capture_output=True,
                         text=True).stdout
    os.unlink(f.name)
    fields = dict(kv.split(":") for kv in next(l for l in out.splitlines() if "REG:" in l).split())
    result.append({"config": config, "regs": int(fields["REG"]), "stack": int(fields["STACK"])})


for dtype in ("bf16", "fp32"):
    for bm, bn, bk, dot, warps in tm.configs(bf16=dtype == "bf16"):
        if dtype == "fp32" and not dot:
            continue  # the FMA path differs from bf16's only in how x loads
        sig = {"x_ptr": "*" + dtype, "out_ptr": "*" + dtype, "packed_tab": "*i64", "scale_tab": "*i64",
               "offsets_ptr": "*i32", **{k: "i32" for k in ("G", "N", "O", "stride_x", "stride_out", "stride_set")},
               **{k: "constexpr" for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "DOT", "BF16", "BF16_DOT", "FP32_PRECISION",
                                           "ABSENT_ZERO")}}
        const = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "DOT": dot, "BF16": dtype == "bf16",
                 "BF16_DOT": dtype == "bf16", "FP32_PRECISION": tm.FP32_DOT_PRECISION, "ABSENT_ZERO": False}
        usage(fn, sig, const, warps, [dtype, bm, bn, bk, dot, warps])
for dtype in ("bf16", "fp32"):  # the pair kernel (graphed decode steps): one tile per input width and weights
    for weights, N in ((0, 3584), (1, 2048), (2, 2048)):
        bn, bk = tm.pair_tiles(N, "mxfp4" if weights == 0 else None)
        sig = {"x_ptr": "*" + dtype, "experts_ptr": "*i64", "packed_tab": "*i64", "scale_tab": "*i64",
               "out_ptr": "*" + dtype,
               **{k: "i32" for k in ("P", "E", "N", "O", "stride_x", "stride_out", "stride_set")},
               **{k: "constexpr" for k in ("BLOCK_N", "BLOCK_K", "WEIGHTS", "BF16", "ABSENT_ZERO")}}
        const = {"BLOCK_N": bn, "BLOCK_K": bk, "WEIGHTS": weights, "BF16": dtype == "bf16", "ABSENT_ZERO": False}
        usage(pair, sig, const, 4, [dtype, "pair", weights, bn, bk])
print(json.dumps(result))
"""


@needs_triton
@pytest.mark.slow
def test_every_tile_configuration_compiles_for_hopper_without_spills(tmp_path):
    """Compiled for sm_90 (H100/H200) by the ptxas in triton's wheel, without a GPU: every tile configuration
    the launcher picks builds (the pair kernel's for each weight kind too), and none spills registers to the
    stack (cuobjdump -res-usage)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import triton

    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not (bindir / "ptxas").exists() or not (bindir / "cuobjdump").exists():
        pytest.skip("this triton install carries no ptxas / cuobjdump")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, do not interpret
    env.update(TRITON_CACHE_DIR=str(tmp_path), PYTHONPATH=str(Path(tm.__file__).parents[2]))
    run = subprocess.run([sys.executable, "-c", COMPILE_FOR_SM90], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.splitlines()[-1])
    assert len(result) == len(tm.configs(True)) + sum(c[3] for c in tm.configs(False)) + 6
    assert all(r["stack"] == 0 for r in result), [r for r in result if r["stack"]]


def test_cpu_selection_does_not_change():
    """Without CUDA tensors nothing routes to triton: CPU experts group on cpu_c as before, CUDA grouping is
    unavailable without a GPU, and forcing triton there is an error naming what it needs."""
    w = random_expert(64, 32, seed=0)
    assert em.group_kind(w, "cpu") == em.kernel_experts.grouped_kind(w)
    assert em.group_kind(w, "cuda") is None  # CPU bytes never go to the CUDA kernel
    if not torch.cuda.is_available():
        assert em.grouped("cuda") is None and not em.available()["triton"]
        with pytest.raises(RuntimeError, match="triton package and a CUDA device"):
            em.select("triton")


# -- on CUDA, compiled ---------------------------------------------------------------------------------


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("rows", [1, 4, 64])
def test_cuda_every_nibble_under_every_scale(rows):
    packed, scale = every_nibble_under_every_scale()
    W = mxfp4.decode(packed, scale, torch.float32)
    finite = W.isfinite().all(1)
    eye = torch.eye(64)
    for r in range(0, 64, rows):
        got = tm.linear(eye[r : r + rows].cuda(), packed.cuda(), scale.cuda()).cpu()
        # bit for bit, but for weights below 2^-126 that a GPU may flush to zero
        torch.testing.assert_close(got[:, finite], W[finite, r : r + rows].T, rtol=0, atol=2.0**-126)
        assert got[:, ~finite].isnan().all()


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,N,O", [(1, 64, 32), (5, 128, 96), (17, 128, 40), (3, 3584, 3072), (70, 3072, 3584)])
def test_cuda_linear_matches_the_reference(T, N, O, dtype):
    gen = torch.Generator().manual_seed(T + N + O)
    packed, scale = random_matrix(O, N, gen)
    x = torch.randn(T, N, generator=gen).to(dtype)
    got = tm.linear(x.cuda(), packed.cuda(), scale.cuda()).cpu()
    assert_within_bound(got, x, packed, scale)


@pytest.mark.cuda
@cuda_only
def test_cuda_grouped_experts_match_the_cpu_reference():
    T, I, F = 6, 128, 64
    experts = [random_expert(I, F, seed=s) for s in range(4)]
    gen = torch.Generator().manual_seed(2)
    h = torch.randn(T, I, generator=gen)
    tokens = torch.tensor([0, 5, 1, 2, 3, 4, 0, 1, 5])
    offsets, weights = [0, 2, 6, 7, 9], torch.rand(9, generator=gen)
    want = torch.zeros(T, I)
    for g, e in enumerate(experts):
        rows = tokens[offsets[g] : offsets[g + 1]]
        want.index_add_(0, rows, em.reference(e, h[rows], "situ", BETAS) * weights[offsets[g] : offsets[g + 1], None])
    out = torch.zeros(T, I, device="cuda")
    cuda_experts = [MXFP4ExpertWeights(*(t.cuda() for t in (e.w1_packed, e.w1_scale, e.w3_packed, e.w3_scale,
                                                            e.w2_packed, e.w2_scale))) for e in experts]
    assert em.group_kind(cuda_experts[0], "cuda") == "mxfp4" and em.grouped("cuda") is tm.grouped_experts
    tm.grouped_experts(h.cuda(), cuda_experts, tokens.cuda(), offsets, weights.cuda(), "situ", BETAS, out)
    torch.testing.assert_close(out.cpu(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.cuda
@cuda_only
def test_cuda_moe_layers_on_triton_equal_torch_rows(tmp_path, monkeypatch):
    """The tiny K3's MoE blocks on CUDA: the triton path (grouped and per expert) against torch_rows
    (MOESWAP_EXPERT_KERNEL=torch_rows), decode-sized and prefill-sized inputs."""
    from moeswap.models.layers.moe import MoE
    from moeswap.models.loader import LoadOptions, load_model
    from moeswap.tiny import write_tiny_model

    model, _ = load_model(write_tiny_model(tmp_path / "k3", "kimi_k3", "tiny", seed=1),
                          LoadOptions(dtype="float32", device="cuda"))
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    assert moes
    for tokens in (1, 3, 40):
        x = torch.randn(1, tokens, model.config.hidden_size, generator=torch.Generator().manual_seed(tokens)).cuda()
        with torch.no_grad():
            monkeypatch.delenv(em.ENV_KERNEL, raising=False)
            got = [m(x) for m in moes]
            monkeypatch.setenv(em.ENV_KERNEL, "torch_rows")
            want = [m(x) for m in moes]
            monkeypatch.delenv(em.ENV_KERNEL)
        for g, w in zip(got, want):
            assert (g - w).abs().max().item() <= 1e-5 * max(1.0, w.abs().max().item())
