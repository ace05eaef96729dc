"""What `bench decode` and `bench prefill` share: the peers in worker processes, the machine's memory
bandwidth, the decode roofline, and the JSON + markdown report.

Peers: moeswap (always), llama.cpp (llama-cpp-python 0.3.36, else the llama-server built from the same sources,
on a GGUF made by its own converter from the same checkpoint) and transformers (KimiLinearForCausalLM, Kimi
Linear checkpoints only). A peer that is not installed or cannot run the model is skipped and the report says
why. Every measurement runs each implementation in turn, `reps` rounds, and keeps each one's best round.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from moeswap import jsonio
from moeswap.bench import RESULTS_DIR
from moeswap.options import LoadOptions, add_load_flags, add_model_argument
from moeswap.procfs import cpu_model

BENCH_LOAD = LoadOptions(expert_memory=8 << 30)  # every expert of a bench model stays resident
PEERS = ("llama.cpp", "transformers")  # the default peers
# moeswap-reference: moeswap itself decoding through the model's modules (--reference-step), side by side
# with the native step: the native step's speed-up, and its tokens, in one run
KNOWN_PEERS = PEERS + ("moeswap-reference",)


@dataclass
class Setup:
    model: str
    threads: int
    peers: tuple[str, ...] = PEERS
    reps: int = 2
    load: LoadOptions = BENCH_LOAD  # how the moeswap workers load the model
    compile: bool = False
    reference_step: bool = False  # decode through the model's modules, not engine/native_step.py
    gguf: str | None = None  # an existing GGUF for llama.cpp; default: convert the checkpoint (cached in .peers/)
    moeswap_env: dict = field(default_factory=dict)  # extra environment for the moeswap worker


def git_revision() -> str:
    try:
        root = Path(__file__).resolve().parents[3]
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True).stdout.strip()
        return rev + ("+dirty" if dirty else "") if rev else "unknown"
    except OSError:
        return "unknown"


def machine_info(threads: int, device: str = "cpu") -> dict:
    import torch

    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("transformers", "llama_cpp"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:
            versions[mod] = None
    gpu = torch.cuda.get_device_name(torch.device(device)) if torch.device(device).type == "cuda" else None
    return {"git": git_revision(), "cpu": cpu_model(), "cores": os.cpu_count(), "threads": threads, "gpu": gpu,
            "load_average": os.getloadavg(), "versions": versions, "date": time.strftime("%Y-%m-%dT%H:%M:%S")}


def _timer(device: str):
    """A clock for work on `device`: perf_counter, after the device's queued work is done (CUDA)."""
    import torch

    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)

    def now() -> float:
        sync()
        return time.perf_counter()

    return now


def memory_bandwidth(threads: int, mib: int = 512, reps: int = 5, device: str = "cpu") -> dict:
    """Best of `reps`: read (sum of a large fp32 tensor) and copy (read + write) bandwidth in GB/s, of the
    memory of `device` (the host's, or a GPU's HBM)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    now = _timer(device)
    try:
        n = mib * 2**20 // 4
        src = torch.ones(n, device=device)
        dst = torch.empty(n, device=device)
        src.sum(), dst.copy_(src)  # touch the pages
        read = copy = float("inf")
        for _ in range(reps):
            t = now()
            src.sum()
            read = min(read, now() - t)
            t = now()
            dst.copy_(src)
            copy = min(copy, now() - t)
        nbytes = n * 4
        return {"read_GBps": nbytes / read / 1e9, "copy_GBps": 2 * nbytes / copy / 1e9, "buffer_MiB": mib}
    finally:
        torch.set_num_threads(before)


def decode_bytes(model_dir: str) -> dict:
    """Bytes one batch-1 decode step must read: every dense weight but the embedding (a row gather; its stored
    bytes are `embed_bytes`), plus
    top-k routed experts in each MoE layer, as stored (bf16 dense, MXFP4 experts for K3; block FP8 or INT4 and
    their scales for DeepSeek-V3 / Kimi K2 checkpoints)."""
    import re

    from moeswap.config import load_config
    from moeswap.formats.checkpoint import Checkpoint

    cfg = load_config(model_dir)
    ckpt = Checkpoint.open(model_dir)
    expert = re.compile(r".*\.experts\.(\d+)\.")
    dense = dense_params = expert_bytes = expert_params = embed = 0
    for name in ckpt.names():
        info = ckpt.info(name)
        if expert.match(name):
            expert_bytes += info.nbytes
            if name.endswith("weight_packed"):  # MXFP4 and INT4 packs: two weights a byte, whatever the dtype
                expert_params += 2 * info.nbytes
            elif not name.endswith(("_scale", "_scale_inv", "weight_shape", "weight_zero_point")):
                expert_params += info.nbytes // info.dtype.itemsize
        elif name.endswith("embed_tokens.weight"):
            embed += info.nbytes
        elif not name.startswith(("vision_tower", "mm_projector")):
            dense += info.nbytes
            dense_params += info.nbytes // info.dtype.itemsize
    moe_layers = sum(1 for k in cfg.mlp_kinds if k == "moe")
    experts = max(1, moe_layers * cfg.moe.num_experts)
    per_expert = expert_bytes / experts
    active = cfg.moe.top_k * moe_layers * per_expert
    ckpt.close()
    return {"dense_bytes": dense, "dense_params": dense_params, "embed_bytes": embed, "active_expert_bytes": active,
            "per_token_bytes": dense + active, "expert_bytes": per_expert,
            "active_params": dense_params + cfg.moe.top_k * moe_layers * expert_params / experts,
            "moe_layers": moe_layers, "num_experts": cfg.moe.num_experts, "top_k": cfg.moe.top_k, "arch": cfg.arch}


def matmul_gflops(threads: int, size: int = 1024, reps: int = 5, device: str = "cpu", dtype=None) -> float:
    """Best-of GEMM rate (torch.mm of two size x size matrices, fp32 unless `dtype`), GFLOP/s: the machine's
    compute ceiling for the math moeswap does by default (on a GPU, in the dtype it computes in)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    now = _timer(device)
    try:
        a = torch.randn(size, size, device=device, dtype=dtype or torch.float32)
        b = torch.randn(size, size, device=device, dtype=dtype or torch.float32)
        a @ b
        best = float("inf")
        for _ in range(reps):
            t = now()
            a @ b
            best = min(best, now() - t)
        return 2 * size**3 / best / 1e9
    finally:
        torch.set_num_threads(before)


def batch_roofline(by: dict, read_GBps: float, gflops: float, batch: int) -> dict:
    """Ceiling of decode tokens/s at `batch` sequences: a step reads the dense weights once and each
    expert any sequence routes to (expected distinct experts under uniform routing), and does
    2 x active parameters FLOPs per token; it takes at least the longer of the two at the measured
    read bandwidth and GEMM rate (common_report's: fp32 on the CPU, the model's dtype on a GPU)."""
    E, K = by["num_experts"], by["top_k"]
    distinct = E * (1 - (1 - K / E) ** batch) if E else 0
    step_bytes = by["dense_bytes"] + by["moe_layers"] * distinct * by["expert_bytes"]
    memory_s, compute_s = step_bytes / (read_GBps * 1e9), 2 * by["active_params"] * batch / (gflops * 1e9)
    return {"batch": batch, "step_bytes": step_bytes, "tokens_per_s": batch / max(memory_s, compute_s),
            "bound": "memory" if memory_s >= compute_s else "compute"}


def llama_engine(setup: Setup) -> tuple[str | None, str]:
    """(worker kind, why none) for the llama.cpp peer: llama-cpp-python where it is installed, else llama-server
    (the same llama.cpp sources, scripts/setup-peers.sh builds both); either needs the converter unless --gguf."""
    from moeswap.bench.peers import llamacpp, llamaserver

    ok, why = llamacpp.available()
    if ok:
        return "llama.cpp", ""
    binary, why_not = llamaserver.find()
    if binary is None:
        return None, f"{why}; {why_not}"
    if setup.gguf is None and not (llamacpp.converter_dir() / "convert_hf_to_gguf.py").is_file():
        return None, f"llama.cpp's converter is not in {llamacpp.converter_dir()}; run scripts/setup-peers.sh"
    return "llama-server", ""


class Peers:
    """The workers of one benchmark run; `skipped` says which peers are missing and why."""

    def __init__(self, setup: Setup, max_seqs: int, max_len: int):
        from moeswap.bench.peers.worker import Worker
        from moeswap.config import load_config

        self.workers: dict[str, Worker] = {}
        self.max_len = max_len
        self.skipped: dict[str, str] = {}
        arch = load_config(setup.model).arch
        extra = setup.load.to_argv() + ["--compile"] * setup.compile + ["--reference-step"] * setup.reference_step
        self.workers["moeswap"] = Worker("moeswap", setup.model, setup.threads, extra, setup.moeswap_env)
        for peer in setup.peers:
            try:
                if peer == "llama.cpp":
                    kind, why = llama_engine(setup)
                    if kind is None:
                        self.skipped[peer] = why
                        continue
                    from moeswap.bench.peers import llamacpp

                    gguf = setup.gguf or str(llamacpp.ensure_gguf(setup.model))
                    self.workers[peer] = Worker(kind, setup.model, setup.threads, [
                        "--gguf", gguf, "--max-seqs", str(max_seqs), "--max-len", str(max_len)])
                elif peer == "moeswap-reference":
                    self.workers[peer] = Worker("moeswap", setup.model, setup.threads, extra + ["--reference-step"],
                                                setup.moeswap_env)
                elif peer == "transformers":
                    from moeswap.bench.peers import hf

                    ok, why = hf.available()
                    if not ok:
                        self.skipped[peer] = why
                    elif arch != "kimi_linear":
                        self.skipped[peer] = f"transformers has no {arch} model (its peer is for the Kimi Linear variant)"
                    else:
                        self.workers[peer] = Worker(peer, setup.model, setup.threads,  # moeswap's device, dtype
                                                    ["--device", setup.load.device, "--dtype", setup.load.dtype])
                else:
                    self.skipped[peer] = f"unknown peer {peer!r} (known: {', '.join(KNOWN_PEERS)})"
            except RuntimeError as err:
                self.skipped[peer] = f"could not start: {str(err)[-500:]}"

    def names(self) -> dict[str, str]:
        return {k: w.name for k, w in self.workers.items()}

    def warm_up(self, prompt: list[int]) -> None:
        """First touches: pages of mmap'd weights, experts into the store, lazy kernel builds."""
        prompt = prompt[: max(1, self.max_len - 8)]
        for w in self.workers.values():
            w.generate([prompt], 4)

    def close(self) -> None:
        for w in self.workers.values():
            w.close()


def random_prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=gen).tolist() for _ in range(batch)]


def agreement(a: list[int], b: list[int]) -> int:
    """Leading tokens two greedy runs share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def write_report(kind: str, report: dict, markdown: str, out_dir: str | None, json_path: str | None,
                 md_path: str | None) -> list[str]:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    paths = []
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        json_path = json_path or str(Path(out_dir) / f"{kind}-{stamp}.json")
        md_path = md_path or str(Path(out_dir) / f"{kind}-{stamp}.md")
    if json_path:
        Path(json_path).write_text(jsonio.dumps(report, indent=2) + "\n")
        paths.append(json_path)
    if md_path:
        Path(md_path).write_text(markdown + "\n")
        paths.append(md_path)
    return paths


def header_markdown(report: dict) -> str:
    m, bw, by = report["machine"], report["bandwidth"], report["bytes"]
    lines = [f"model `{report['model']}` ({by['arch']}), {m['threads']} threads on {m['cores']} cores ({m['cpu']}"
             + (f"; GPU {m['gpu']}" if m.get("gpu") else "") + f"), git {m['git']}, load average "
             f"{m['load_average'][0]:.1f} at start",
             f"memory bandwidth (measured): read {bw['read_GBps']:.1f} GB/s, copy {bw['copy_GBps']:.1f} GB/s; "
             f"bytes per decode token (batch 1, as stored): {by['per_token_bytes'] / 1e6:.1f} MB "
             f"({by['dense_bytes'] / 1e6:.1f} dense + {by['active_expert_bytes'] / 1e6:.1f} routed experts) -> "
             f"decode roofline {report['roofline_tokens_per_s']:.1f} tokens/s"]
    for peer, name in report["peers"].items():
        lines.append(f"- {peer}: {name}")
    if report.get("settings", {}).get("expert_activations") == "int8":
        lines.append("- moeswap: `--expert-activations int8` (MXFP4 experts on int8 activations, as llama.cpp)")
    if report.get("settings", {}).get("gemm_precision") == "bf16":
        lines.append("- moeswap: `--gemm-precision bf16` (bf16-weight matmuls on bf16 inputs, as llama.cpp's)")
    for peer, why in report["skipped"].items():
        lines.append(f"- {peer}: SKIPPED, {why}")
    return "\n".join(lines)


def common_report(setup: Setup, peers: Peers) -> dict:
    """The machine, its memory bandwidth and GEMM rate where moeswap computes (a GPU's with --device cuda, in
    moeswap's dtype there), the model's bytes per decode token, the peers."""
    from moeswap.models.loader import resolve_dtype

    device = setup.load.device
    gpu = device.startswith("cuda")
    bw = memory_bandwidth(setup.threads, mib=2048 if gpu else 512, device=device)
    by = decode_bytes(setup.model)
    return {"model": setup.model, "machine": machine_info(setup.threads, device), "bandwidth": bw, "bytes": by,
            "roofline_tokens_per_s": bw["read_GBps"] * 1e9 / by["per_token_bytes"],
            "gemm_gflops": matmul_gflops(setup.threads, size=4096 if gpu else 1024, device=device,
                                         dtype=resolve_dtype(setup.load.dtype, device) if gpu else None),
            "peers": peers.names(), "skipped": peers.skipped, "reps": setup.reps,
            "settings": {**dataclasses.asdict(setup.load), "compile": setup.compile,
                         "reference_step": setup.reference_step, "moeswap_env": setup.moeswap_env}}


def add_common_flags(b) -> None:
    add_model_argument(b, "checkpoint directory (K3 or Kimi Linear layout)")
    b.add_argument("--threads", type=int, default=2, help="threads for every implementation (default 2)")
    b.add_argument("--peers", default=",".join(PEERS),
                   help="comma list of peers: llama.cpp,transformers,moeswap-reference ('' = none)")
    b.add_argument("--reps", type=int, default=2, help="rounds per measurement; each implementation's best is kept")
    add_load_flags(b, defaults={"expert_memory": BENCH_LOAD.expert_memory},
                   title="how moeswap loads the model (default --expert-memory: every expert of a bench model stays)")
    b.add_argument("--compile", action="store_true", help="moeswap: torch.compile the decode step")
    b.add_argument("--reference-step", action="store_true",
                   help="moeswap: decode through the model's modules (the reference), not the fast step (the C "
                        "step on the CPU, CUDA graphs on CUDA)")
    b.add_argument("--omp-passive", action="store_true",
                   help="moeswap worker with OMP_WAIT_POLICY=PASSIVE (see docs/benchmarks.md)")
    b.add_argument("--gguf", help="an existing GGUF for llama.cpp (default: convert MODEL with llama.cpp's converter)")
    b.add_argument("--out-dir", default=RESULTS_DIR,
                   help="where the JSON and markdown go ('' = only print; default %(default)s)")
    b.add_argument("--json", metavar="FILE", help="JSON path (default: OUT_DIR/<bench>-<time>.json)")
    b.add_argument("--markdown", metavar="FILE", help="markdown path (default: OUT_DIR/<bench>-<time>.md)")


def setup_from_args(args) -> Setup:
    peers = tuple(p for p in args.peers.split(",") if p)
    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    if args.reps < 1:
        raise ValueError(f"--reps must be >= 1, got {args.reps}")
    if not (Path(args.model) / "config.json").is_file():
        raise FileNotFoundError(f"{args.model}: no config.json; give a checkpoint directory")
    return Setup(args.model, args.threads, peers, args.reps, LoadOptions.from_args(args), args.compile,
                 args.reference_step, args.gguf, {"OMP_WAIT_POLICY": "PASSIVE"} if args.omp_passive else {})


def int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected a comma list of integers, e.g. 1,4,16") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} {text!r}: expected positive integers")
    return values
