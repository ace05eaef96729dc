"""`moeswap bench kernels`: µs per routed-expert call from MXFP4, block-FP8 and INT4 bytes against named
baselines, with the machine's read bandwidth measured in the same run; each format's headline is its direct
kernel's stored bytes per second at the fewest tokens as a share of that bandwidth (the project's goals for it
are in docs/benchmarks.md, not in the report). Entry points: `add_parser`, `run`.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

from moeswap import jsonio

K3_EXPERT = (3584, 3072)  # (I latent input width, F expert width) of Kimi K3


def measure_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> dict:
    """Best-of read bandwidth (sum of a large fp32 tensor) and copy bandwidth (read + write), GB/s, per
    wall second and per CPU second of this process (the latter is steadier on a shared machine)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    src.sum()
    dst.copy_(src)
    read, read_cpu, copy = [], [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        src.sum()
        read.append(nbytes / (time.perf_counter() - t0) / 1e9)
        read_cpu.append(nbytes / max(time.process_time() - c0, 1e-9) / 1e9)
        t0 = time.perf_counter()
        dst.copy_(src)
        copy.append(2 * nbytes / (time.perf_counter() - t0) / 1e9)
    return {"read_GBps": max(read), "read_GBps_per_cpu_s": max(read_cpu), "copy_GBps": max(copy), "bytes": nbytes}


def random_experts(n: int, in_dim: int, expert_dim: int, seed: int = 0):
    """n MXFP4 experts with random codes and scales giving weights of std ~ 1/sqrt(fan_in)."""
    from moeswap.ops.expert import MXFP4ExpertWeights

    gen = torch.Generator().manual_seed(seed)

    def matrix(out_dim: int, fan_in: int):
        packed = torch.randint(0, 256, (out_dim, fan_in // 2), dtype=torch.uint8, generator=gen)
        centre = 127 + round(math.log2(1 / (3.0 * math.sqrt(fan_in))))
        return packed, torch.randint(centre - 1, centre + 2, (out_dim, fan_in // 32), dtype=torch.uint8, generator=gen)

    experts = []
    for _ in range(n):
        (a, b), (c, d), (e, f) = matrix(expert_dim, in_dim), matrix(expert_dim, in_dim), matrix(in_dim, expert_dim)
        experts.append(MXFP4ExpertWeights(a, b, c, d, e, f))
    return experts


def random_quant_experts(kind: str, n: int, in_dim: int, expert_dim: int, seed: int = 0) -> list:
    """n block-FP8 ("fp8": random non-NaN E4M3 codes, fp32 scales per 128 x 128) or INT4 ("int4": random
    nibbles, bf16 scales per 32) experts whose weights have std ~ 1/sqrt(fan_in)."""
    from moeswap.formats import fp8_block, int4
    from moeswap.ops.expert import FP8ExpertWeights, Int4ExpertWeights

    gen = torch.Generator().manual_seed(seed)

    def matrix(out_dim: int, fan_in: int):
        if kind == "fp8":
            codes = torch.randint(0, 256, (out_dim, fan_in), dtype=torch.uint8, generator=gen)
            codes = torch.where((codes | 0x80) == 0xFF, codes ^ 0x01, codes)  # no NaN codes
            scale = torch.full(fp8_block.scale_shape((out_dim, fan_in)), 1 / (60 * math.sqrt(fan_in)))
            return codes.view(torch.float8_e4m3fn), scale
        words = torch.randint(0, 256, (out_dim, fan_in // 2), dtype=torch.uint8, generator=gen).view(torch.int32)
        return words, torch.full(int4.scale_shape((out_dim, fan_in)), 1 / (4.6 * math.sqrt(fan_in))).bfloat16()

    cls = FP8ExpertWeights if kind == "fp8" else Int4ExpertWeights
    return [cls(*matrix(expert_dim, in_dim), *matrix(expert_dim, in_dim), *matrix(in_dim, expert_dim))
            for _ in range(n)]


def _compiled_variant(act: str, betas: tuple[float, float]):
    """torch.compile of decode + matmul (inductor fuses the table lookup into the GEMV loops)."""
    from moeswap.formats import mxfp4
    from moeswap.ops.activation import glu

    table = mxfp4._BYTE_TO_PAIR

    def linear(x, packed, scale):
        values = table[packed.long()].reshape(packed.shape[0], -1, 32)
        blocks = values * mxfp4.mx.E8M0_TO_FP32[scale.long()].unsqueeze(-1)
        return x @ blocks.reshape(packed.shape[0], -1).T

    def expert(x, a, b, c, d, e, f):
        return linear(glu(act, linear(x, a, b), linear(x, c, d), betas), e, f)

    return torch.compile(expert, dynamic=False)


def _bf16_resident(w):
    from moeswap.formats import mxfp4
    from moeswap.ops.expert import ExpertWeights

    dec = lambda p, s: mxfp4.decode(p, s, torch.bfloat16)  # noqa: E731
    return ExpertWeights(dec(w.w1_packed, w.w1_scale), dec(w.w3_packed, w.w3_scale), dec(w.w2_packed, w.w2_scale))


def run_bench(in_dim: int = K3_EXPERT[0], expert_dim: int = K3_EXPERT[1], tokens=(1, 4, 16), n_experts: int = 16,
              rounds: int = 5, min_seconds: float = 0.2, act: str = "situ", slow_variants: bool = True,
              with_compile: bool = False, formats: tuple[str, ...] = ("mxfp4", "fp8", "int4")) -> dict:
    """Variants: "mxfp4 direct" (every available ops.expert_mxfp4 implementation), "fp8 direct" and "int4 direct"
    (ops.expert_quant's kernel path: csrc/quant.c), "dequantise then matmul" for each (the formats' torch
    references) and "bf16 resident" (a decoded bf16 expert, ops.expert.ExpertWeights). Experts are cycled so
    their bytes come from DRAM, not cache; the read bandwidth is a large fp32 sum. Variants are interleaved
    round by round and the median is reported."""
    from moeswap.ops import cpu_kernels, expert_mxfp4, expert_quant
    from moeswap.weights.registry import run_expert

    betas = (4.0, 25.0)
    experts = random_experts(n_experts, in_dim, expert_dim)
    packed_bytes = experts[0].nbytes
    variants: dict[str, tuple] = {}  # name -> (callable(i, x32, x16), bytes read per call)
    for name, ok in expert_mxfp4.available().items():
        if ok and name not in ("reference", "triton") and (slow_variants or name == "cpu_c"):  # triton: CUDA only
            impl = expert_mxfp4.IMPLEMENTATIONS[name]
            variants[f"mxfp4 direct ({name})"] = (lambda i, x, xb, impl=impl: impl(experts[i], x, act, betas),
                                                  packed_bytes)
    if slow_variants:
        variants["dequantise then matmul"] = (
            lambda i, x, xb: expert_mxfp4.reference(experts[i], x, act, betas), packed_bytes)
    compile_seconds = None
    if with_compile:
        compiled = _compiled_variant(act, betas)
        fields = lambda w: (w.w1_packed, w.w1_scale, w.w3_packed, w.w3_scale, w.w2_packed, w.w2_scale)  # noqa: E731
        t0 = time.perf_counter()
        for t in tokens:  # one graph per token count (dynamic=False)
            compiled(torch.zeros(t, in_dim), *fields(experts[0]))
        compile_seconds = time.perf_counter() - t0
        variants["mxfp4 direct (torch.compile)"] = (lambda i, x, xb: compiled(x, *fields(experts[i])), packed_bytes)
    stored = {"mxfp4": packed_bytes}
    for kind in (k for k in ("fp8", "int4") if k in formats):
        quant = random_quant_experts(kind, n_experts, in_dim, expert_dim)
        stored[kind] = quant[0].nbytes
        variants[f"{kind} direct (cpu_c)"] = (lambda i, x, xb, q=quant: run_expert(q[i], x, act, betas), stored[kind])
        if slow_variants:
            variants[f"{kind} dequantise then matmul"] = (
                lambda i, x, xb, q=quant: expert_quant.reference(q[i], x, act, betas), stored[kind])
    resident = [_bf16_resident(w) for w in experts]
    variants["bf16 resident"] = (lambda i, x, xb: run_expert(resident[i], xb, act, betas), resident[0].nbytes)

    bandwidth = measure_bandwidth()
    rows = []
    for t in tokens:
        x = torch.randn(t, in_dim, generator=torch.Generator().manual_seed(t))
        xb = x.to(torch.bfloat16)
        samples: dict[str, list[float]] = {name: [] for name in variants}
        cpu: dict[str, list[float]] = {name: [] for name in variants}
        for fn, _ in variants.values():
            fn(0, x, xb)  # warm up (and build the kernel)
        for _ in range(rounds):
            for name, (fn, _) in variants.items():
                calls, t0, c0, i = 0, time.perf_counter(), time.process_time(), 0
                while True:
                    fn(i, x, xb)
                    calls, i = calls + 1, (i + 1) % n_experts
                    elapsed = time.perf_counter() - t0
                    if elapsed >= min_seconds and calls >= min(n_experts, 4) or elapsed >= 10 * min_seconds:
                        break
                samples[name].append(elapsed / calls)
                cpu[name].append((time.process_time() - c0) / calls)
        for name, (_, nbytes) in variants.items():
            seconds = statistics.median(samples[name])
            rows.append({"tokens": t, "variant": name, "us_per_call": seconds * 1e6, "bytes_per_call": nbytes,
                         "cpu_us_per_call": statistics.median(cpu[name]) * 1e6,
                         "GBps": nbytes / seconds / 1e9, "packed_GBps": packed_bytes / seconds / 1e9,
                         "spread": (min(samples[name]) * 1e6, max(samples[name]) * 1e6)})
    selected = f"mxfp4 direct ({expert_mxfp4.best_name()})"
    best = next(r for r in rows if r["tokens"] == min(tokens) and r["variant"] == selected)
    kernel = cpu_kernels.kernel()
    shares = {}
    for kind in (k for k in ("fp8", "int4") if k in formats):
        row = next(r for r in rows if r["tokens"] == min(tokens) and r["variant"] == f"{kind} direct (cpu_c)")
        shares[kind] = {"tokens": row["tokens"], "variant": row["variant"], "stored_bytes": stored[kind],
                        "GBps": row["GBps"], "fraction_of_read_bandwidth": row["GBps"] / bandwidth["read_GBps"],
                        "fraction_per_cpu_s": (stored[kind] / (row["cpu_us_per_call"] * 1e-6) / 1e9)
                        / bandwidth["read_GBps_per_cpu_s"]}
    return {
        "expert": {"in_dim": in_dim, "expert_dim": expert_dim, "act": act, "packed_bytes": packed_bytes,
                   "stored_bytes": stored, "bf16_bytes": resident[0].nbytes, "experts_cycled": n_experts},
        "format_bandwidth_shares": shares,
        "bandwidth": bandwidth, "rows": rows,
        "bandwidth_share": {"tokens": best["tokens"], "variant": best["variant"], "packed_GBps": best["packed_GBps"],
                            "fraction_of_read_bandwidth": best["packed_GBps"] / bandwidth["read_GBps"],
                            "fraction_per_cpu_s": (packed_bytes / (best["cpu_us_per_call"] * 1e-6) / 1e9)
                            / bandwidth["read_GBps_per_cpu_s"]},
        "machine": machine_facts(), "kernel_isa": kernel.isa if kernel else None, "compile_seconds": compile_seconds,
    }


def machine_facts() -> dict:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=os.path.dirname(__file__), timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        rev = None
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"git": rev, "cpu": cpu, "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(),
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None}


def format_report(r: dict) -> str:
    e, bw, g = r["expert"], r["bandwidth"], r["bandwidth_share"]
    lines = [
        f"expert I={e['in_dim']} F={e['expert_dim']} ({e['act']}): {e['packed_bytes'] / 1e6:.2f} MB MXFP4, "
        f"{e['bf16_bytes'] / 1e6:.2f} MB bf16; {e['experts_cycled']} experts cycled; "
        f"{r['machine']['threads']} threads on {r['machine']['cpu']} (kernel: {r['kernel_isa']})",
        f"memory bandwidth (same run): read {bw['read_GBps']:.1f} GB/s ({bw['read_GBps_per_cpu_s']:.1f} GB per CPU "
        f"second), copy {bw['copy_GBps']:.1f} GB/s",
        "",
        "| tokens | variant | µs / call | CPU µs / call | GB/s over its bytes | GB/s over packed bytes "
        "| vs bf16 resident |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for row in r["rows"]:
        base = next(b for b in r["rows"] if b["tokens"] == row["tokens"] and b["variant"] == "bf16 resident")
        lines.append(f"| {row['tokens']} | {row['variant']} | {row['us_per_call']:,.0f} | "
                     f"{row['cpu_us_per_call']:,.0f} | "
                     f"{row['GBps']:.2f} | "
                     f"{row['packed_GBps']:.2f} | {base['us_per_call'] / row['us_per_call']:.2f}x |")
    lines += ["", f"{g['variant']} at {g['tokens']} token reads packed bytes at {g['packed_GBps']:.1f} GB/s = "
              f"{g['fraction_of_read_bandwidth']:.0%} of the measured read bandwidth; per CPU second: "
              f"{g['fraction_per_cpu_s']:.0%}"]
    for fg in r.get("format_bandwidth_shares", {}).values():
        lines.append(f"{fg['variant']} at {fg['tokens']} token reads its {fg['stored_bytes'] / 1e6:.2f} MB of "
                     f"stored bytes at {fg['GBps']:.1f} GB/s = {fg['fraction_of_read_bandwidth']:.0%} of the measured "
                     f"read bandwidth; per CPU second: {fg['fraction_per_cpu_s']:.0%}")
    if r.get("compile_seconds") is not None:
        graphs = len({x["tokens"] for x in r["rows"]})
        lines.append(f"torch.compile variant: {r['compile_seconds']:.0f} s to compile {graphs} graphs")
    load = r["machine"].get("load_average")
    if load:
        lines.append(f"load average during the run: {load[0]:.2f} (a shared machine: compare ratios, not absolutes)")
    return "\n".join(lines)


def add_shape_flags(b, tokens: str, tokens_help: str) -> None:
    """The expert shape and token counts of a kernel benchmark (`shape_args` reads them back)."""
    b.add_argument("--in-dim", type=int, default=K3_EXPERT[0], help="expert input width (K3 latent: 3584)")
    b.add_argument("--expert-dim", type=int, default=K3_EXPERT[1], help="expert width (K3: 3072)")
    b.add_argument("--tokens", default=tokens, help=tokens_help)


def shape_args(args: argparse.Namespace) -> tuple[int, ...]:
    """--tokens as a tuple, once it and the widths are valid (else a ValueError naming the flag)."""
    tokens = tuple(int(t) for t in args.tokens.split(",") if t.strip())
    if not tokens or min(tokens) < 1:
        raise ValueError(f"--tokens must list positive integers, got {args.tokens!r}")
    if args.in_dim % 32 or args.expert_dim % 32:
        raise ValueError(f"--in-dim and --expert-dim must be multiples of 32, got {args.in_dim} and {args.expert_dim}")
    return tokens


def add_parser(benches) -> None:
    b = benches.add_parser("kernels", help="µs per MXFP4 / block-FP8 / INT4 expert call: direct kernel vs "
                                           "dequantise+matmul vs bf16")
    add_shape_flags(b, "1,4,16", "comma-separated token counts per call")
    b.add_argument("--experts", type=int, default=16, help="experts cycled (enough to overflow the caches)")
    b.add_argument("--rounds", type=int, default=5)
    b.add_argument("--threads", type=int, default=None, help="torch / kernel threads (default: torch's)")
    b.add_argument("--act", default="situ", choices=("situ", "silu"))
    b.add_argument("--fast-only", action="store_true", help="skip the slow torch variants")
    b.add_argument("--with-compile", action="store_true", help="add a torch.compile variant (compiles for minutes)")
    b.add_argument("--formats", default="mxfp4,fp8,int4",
                   help="stored formats besides MXFP4 to measure: fp8 (block FP8), int4 (pack-quantized)")
    b.add_argument("--json", metavar="FILE", help="also write the result as JSON to FILE")


def run(args: argparse.Namespace) -> int:
    tokens = shape_args(args)
    formats = tuple(f.strip() for f in args.formats.split(",") if f.strip())
    unknown = [f for f in formats if f not in ("mxfp4", "fp8", "int4")]
    if unknown:
        raise ValueError(f"--formats: unknown format {unknown[0]!r} (expected mxfp4, fp8 or int4)")
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run_bench(args.in_dim, args.expert_dim, tokens, args.experts, args.rounds, act=args.act,
                       slow_variants=not args.fast_only, with_compile=args.with_compile, formats=formats)
    print(format_report(result))
    if args.json:
        with open(args.json, "w") as f:
            jsonio.dump(result, f, indent=2)
    sys.stdout.flush()
    return 0
