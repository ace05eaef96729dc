"""`moeswap bench gpu-kernels`: one layer step of routed MXFP4 experts on a CUDA device (µs per step, tokens/s,
GB/s of expert bytes read) for the Triton kernels (ops/triton_mxfp4.py) against named baselines, with the
device's read bandwidth measured in the same run. `--device cpu` runs it under Triton's interpreter, only to
check this code on tiny shapes. Entry points: `add_parser`, `run`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moeswap import jsonio
from moeswap.bench.kernels import K3_EXPERT, add_shape_flags, machine_facts, random_experts, shape_args

VARIANTS = ("triton grouped", "triton per expert", "torch_rows per expert", "bf16 resident")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_device_bandwidth(device: torch.device, nbytes: int = 4 << 30, repeats: int = 5) -> float:
    """Best-of GB/s of summing an fp32 tensor of `nbytes` on the device."""
    src = torch.ones(nbytes // 4, device=device)
    src.sum()
    best = 0.0
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        src.sum()
        _sync(device)
        best = max(best, nbytes / (time.perf_counter() - t0) / 1e9)
    del src
    return best


def run_bench(in_dim: int = K3_EXPERT[0], expert_dim: int = K3_EXPERT[1], tokens=(1, 4, 16, 64), n_experts: int = 16,
              rounds: int = 5, min_seconds: float = 0.1, act: str = "situ", dtype: torch.dtype = torch.bfloat16,
              device: str = "cuda", bandwidth_bytes: int = 4 << 30) -> dict:
    """A step routes `tokens` tokens to the same `experts` experts (each expert's bytes are read once per step).
    Variants: "triton grouped" (the MoE block's path on CUDA: three launches for all experts), "triton per
    expert", "torch_rows per expert" (the torch fallback: decode ~1 MB of rows, matmul) and "bf16 resident"
    (decoded bf16 experts, torch matmuls: 3.8x the bytes). Experts are bench.kernels' random K3-sized ones."""
    from moeswap.formats import mxfp4
    from moeswap.ops import expert_mxfp4, triton_mxfp4
    from moeswap.ops.expert import ExpertWeights, MXFP4ExpertWeights, tensors
    from moeswap.weights.registry import run_expert

    dev = torch.device(device)
    betas = (4.0, 25.0)
    experts = [MXFP4ExpertWeights(**{k: t.to(dev) for k, t in tensors(w).items()})
               for w in random_experts(n_experts, in_dim, expert_dim)]
    resident = [ExpertWeights(*(mxfp4.decode(getattr(w, f"{p}_packed"), getattr(w, f"{p}_scale"), torch.bfloat16)
                                for p in ("w1", "w3", "w2"))) for w in experts]
    packed_bytes, bf16_bytes = experts[0].nbytes * n_experts, resident[0].nbytes * n_experts
    rows = []
    for t in tokens:
        gen = torch.Generator().manual_seed(t)
        h = torch.randn(t, in_dim, generator=gen).to(device=dev, dtype=dtype)
        token_ids = torch.arange(t, device=dev).repeat(n_experts)  # expert g's pairs: tokens 0..t-1
        offsets = [g * t for g in range(n_experts + 1)]
        weights = torch.full((n_experts * t,), 1.0 / n_experts, device=dev)

        def per_expert(fn, ws, t=t, h=h):  # bound now: called within this iteration only
            out = torch.zeros(t, in_dim, device=dev)
            for w in ws:
                out += fn(w, h, act, betas).float() / n_experts
            return out

        def grouped(t=t, h=h, token_ids=token_ids, offsets=offsets, weights=weights):
            out = torch.zeros(t, in_dim, device=dev)
            triton_mxfp4.grouped_experts(h, experts, token_ids, offsets, weights, act, betas, out)
            return out

        variants = {"triton grouped": (grouped, packed_bytes),
                    "triton per expert": (lambda: per_expert(triton_mxfp4.expert, experts), packed_bytes),
                    "torch_rows per expert": (lambda: per_expert(expert_mxfp4.torch_rows, experts), packed_bytes),
                    "bf16 resident": (lambda: per_expert(run_expert, resident), bf16_bytes)}
        outputs = {name: fn().float() for name, (fn, _) in variants.items()}  # warm-up: compiles each shape
        ref = outputs["torch_rows per expert"]
        scale = ref.abs().max().item() or 1.0
        samples: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(rounds):  # interleaved round by round: drift on a shared machine hits all alike
            for name, (fn, _) in variants.items():
                calls = 0
                _sync(dev)
                t0 = time.perf_counter()
                while True:
                    fn()
                    calls += 1
                    _sync(dev)
                    elapsed = time.perf_counter() - t0
                    if elapsed >= min_seconds or calls >= 1000:
                        break
                samples[name].append(elapsed / calls)
        for name, (_, nbytes) in variants.items():
            seconds = statistics.median(samples[name])
            rows.append({"tokens": t, "variant": name, "us_per_step": seconds * 1e6, "tokens_per_s": t / seconds,
                         "bytes_per_step": nbytes, "GBps": nbytes / seconds / 1e9,
                         "max_rel_diff_vs_torch_rows": (outputs[name] - ref).abs().max().item() / scale,
                         "spread_us": (min(samples[name]) * 1e6, max(samples[name]) * 1e6)})
    bandwidth = measure_device_bandwidth(dev, bandwidth_bytes)
    machine = machine_facts()
    machine["device"] = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (Triton interpreter)"
    machine["triton"] = getattr(triton_mxfp4.triton, "__version__", None)
    return {"expert": {"in_dim": in_dim, "expert_dim": expert_dim, "act": act, "dtype": str(dtype).removeprefix("torch."),
                       "experts_per_step": n_experts, "packed_bytes_per_step": packed_bytes,
                       "bf16_bytes_per_step": bf16_bytes},
            "read_GBps": bandwidth, "rows": rows, "machine": machine}


def format_report(r: dict) -> str:
    e = r["expert"]
    lines = [f"{e['experts_per_step']} experts per step, I={e['in_dim']} F={e['expert_dim']} ({e['act']}, "
             f"{e['dtype']} activations): {e['packed_bytes_per_step'] / 1e6:.1f} MB MXFP4 per step; "
             f"{r['machine']['device']}, triton {r['machine']['triton']}",
             f"device read bandwidth (same run): {r['read_GBps']:.0f} GB/s", "",
             "| tokens | variant | µs / step | tokens/s | GB/s read | of read bandwidth | max rel diff vs torch_rows |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for row in r["rows"]:
        lines.append(f"| {row['tokens']} | {row['variant']} | {row['us_per_step']:,.1f} | {row['tokens_per_s']:,.0f} | "
                     f"{row['GBps']:,.1f} | {row['GBps'] / r['read_GBps']:.0%} | {row['max_rel_diff_vs_torch_rows']:.1e} |")
    return "\n".join(lines)


def add_parser(benches) -> None:
    b = benches.add_parser("gpu-kernels", help="µs per layer step of MXFP4 experts on CUDA: Triton kernels vs the "
                                               "torch fallback vs bf16 resident")
    add_shape_flags(b, "1,4,16,64", "comma-separated tokens per step")
    b.add_argument("--experts", type=int, default=16, help="experts per step (K3 routes each token to 16)")
    b.add_argument("--rounds", type=int, default=5)
    b.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="activation dtype")
    b.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: Triton's interpreter, to check this benchmark itself on tiny shapes")
    b.add_argument("--json", metavar="FILE", help="also write the result as JSON to FILE")


def run(args: argparse.Namespace) -> int:
    from moeswap.ops import triton_mxfp4

    tokens = shape_args(args)
    ready = triton_mxfp4.available() if args.device == "cuda" else triton_mxfp4.interpreted()
    if not ready:
        raise ValueError(f"--device {args.device}: the Triton kernels cannot run here (" +
                         ("needs triton, a CUDA device and TRITON_INTERPRET unset)" if args.device == "cuda"
                          else "needs triton and TRITON_INTERPRET=1)"))
    result = run_bench(args.in_dim, args.expert_dim, tokens, args.experts, args.rounds, dtype=getattr(torch, args.dtype),
                       device=args.device, bandwidth_bytes=(4 << 30) if args.device == "cuda" else (64 << 20))
    print(format_report(result))
    if args.json:
        with open(args.json, "w") as f:
            jsonio.dump(result, f, indent=2)
    return 0
