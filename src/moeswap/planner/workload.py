"""Workload and precision knobs for a plan: one small frozen dataclass each, mirrored by CLI flags.

Knows nothing of hardware. Storage formats become bytes in formats.py (`bytes_per_param` here reads it).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .errors import PlanError
from .formats import FORMATS, ROW, bytes_per_weight

# --offload-compute; the runtime's --expert-compute (options.EXPERT_COMPUTE) names the same choices gpu
# (swap), cpu (host) and auto
OFFLOAD_COMPUTE = ("swap", "host", "auto")

# Bytes per weight of the formats whose scales do not depend on a matrix's shape (formats.FORMATS is the
# one table; per-row scaled int8 needs a matrix: bytes_per_param(fmt, in_features)). Also the KV cache's.
BYTES = {name: f.bytes_per_weight() for name, f in FORMATS.items() if f.group != ROW}
WEIGHT_FORMATS = ("mxfp4", "mxfp8", "fp8", "int4", "bf16")  # routed experts
# Dense (non-expert) weights as moeswap runs them: bf16, or quantised on load to int8 / int4; fp8 only where
# the checkpoint ships block-FP8 dense weights (DeepSeek-V3, Kimi K2), which moeswap keeps as stored.
DENSE_FORMATS = ("bf16", "int8", "int4", "fp8")
DENSE_AS_STORED = {"fp8": "fp8_block"}  # dense format -> the checkpoint quantization format it needs
CACHE_FORMATS = ("bf16", "fp8")
COMPUTE = ("bf16", "fp8", "fp4")


def bytes_per_param(fmt: str, in_features: int | None = None) -> float:
    """Stored bytes per weight (formats.py); `in_features`: the matrix's row length, for per-row scales."""
    return bytes_per_weight(fmt, in_features)


@dataclass(frozen=True)
class Precision:
    experts: str | None = None  # routed experts; None: as the checkpoint stores them (K3: MXFP4)
    dense: str = "bf16"  # everything else (attention, shared experts, dense MLP, embeddings)
    kv_cache: str = "bf16"  # MLA latent cache
    expert_matmul: str = "bf16"  # tensor-core dtype the expert matmuls run in
    expert_kernel: str = "fused"  # "fused": dequantise inside the GEMM; "materialize": write bf16 first

    def for_model(self, cfg) -> "Precision":
        """Fill in the expert format from the config's quantization scheme when not chosen."""
        if self.experts is not None:
            return self
        fmt = cfg.quant.format if cfg.quant is not None else ""
        stored = {"fp8_block": "fp8", "pack-quantized": "int4"}.get(fmt, "mxfp4" if fmt.startswith("mxfp4") else "bf16")
        return replace(self, experts=stored)

    def expert_format(self, cfg) -> str:
        """The routed experts' weight format: the chosen one, else the checkpoint's."""
        fmt = self.for_model(cfg).experts
        assert fmt is not None  # for_model always fills it
        return fmt

    def check_model(self, cfg) -> None:
        """Dense formats moeswap keeps only as stored need a checkpoint that stores them."""
        need = DENSE_AS_STORED.get(self.dense)
        # compressed-tensors checkpoints (K3's MXFP4) quantise routed experts only: their dense weights are bf16
        have = cfg.quant.format if cfg.quant is not None else "bf16"
        if need is not None and have != need:
            others = ", ".join(f for f in DENSE_FORMATS if f not in DENSE_AS_STORED)
            raise PlanError(f"--dense {self.dense}: moeswap keeps {self.dense} dense weights only as a {need} "
                            f"checkpoint stores them, and this checkpoint's dense weights are bf16 (choose {others})")

    def check(self) -> None:
        for name, val, allowed in (("experts", self.experts or "mxfp4", WEIGHT_FORMATS),
                                   ("dense", self.dense, DENSE_FORMATS),
                                   ("kv_cache", self.kv_cache, CACHE_FORMATS),
                                   ("expert_matmul", self.expert_matmul, COMPUTE),
                                   ("expert_kernel", self.expert_kernel, ("fused", "materialize"))):
            if val not in allowed:
                raise PlanError(f"precision {name}={val!r} is not one of {', '.join(allowed)}")


@dataclass(frozen=True)
class Serve:
    isl: int = 8192  # input (prompt) tokens per request
    osl: int = 1024  # output tokens per request
    concurrency: tuple[int, ...] = (1, 16, 64)  # requests in flight over the whole deployment
    context: int | None = None  # tokens of cache to reserve per sequence; default isl + osl
    arrival: str = "burst"  # "burst": each wave of `concurrency` requests arrives at once; "steady": staggered

    @property
    def ctx(self) -> int:
        return self.context or (self.isl + self.osl)

    def check(self) -> None:
        if self.isl < 1 or self.osl < 1:
            raise PlanError("--isl and --osl must be at least 1 token")
        if not self.concurrency or min(self.concurrency) < 1:
            raise PlanError("--concurrency needs one or more positive request counts")
        if self.arrival not in ("burst", "steady"):
            raise PlanError(f"--arrival {self.arrival!r} is not 'burst' or 'steady'")


LORA_TARGETS = ("attn", "mlp", "experts")


@dataclass(frozen=True)
class Lora:
    rank: int = 16
    targets: tuple[str, ...] = ("attn", "mlp")  # attention linears; dense/shared/latent MLP; routed experts
    seq_len: int = 4096
    micro_batch: int = 1  # sequences per micro-batch per replica
    grad_accum: int = 8  # micro-batches per optimizer step per replica
    checkpointing: bool = True  # keep only layer inputs, recompute each layer in backward

    def seqs_per_micro_batch(self, dp: int = 1) -> int:
        """Sequences per micro-batch per replica: at least one per attention-DP rank, a multiple of dp."""
        return -(-max(self.micro_batch, dp) // dp) * dp

    def tokens_per_micro_batch(self, dp: int = 1) -> int:
        return self.seq_len * self.seqs_per_micro_batch(dp)

    def check(self) -> None:
        bad = [t for t in self.targets if t not in LORA_TARGETS]
        if bad or not self.targets:
            raise PlanError(f"--lora-targets {','.join(self.targets)!r}: choose from {', '.join(LORA_TARGETS)}")
        if self.rank < 1 or self.seq_len < 1 or self.micro_batch < 1 or self.grad_accum < 1:
            raise PlanError("--rank, --seq-len, --micro-batch and --grad-accum must be positive")


@dataclass(frozen=True)
class Offload:
    spill: str = "none"  # where experts that do not fit in HBM may go: "none" | "host" | "nvme"
    # spilled experts: "swap" them into HBM, compute them on the "host" CPU, or "auto": host for passes of
    # fewer tokens than the runtime's --expert-gpu-min-tokens default, swap from there (Placement.compute_for)
    compute: str = "swap"
    hit_rate: float | None = None  # expert-cache hit rate; default: the resident fraction (uniform routing)
    trace_counts: tuple[tuple[float, ...], ...] = field(default=(), compare=False)  # per-layer expert counts
    swap_overlap: float = 0.0  # fraction of swap time hidden behind compute by prefetch (0: on demand)

    def check(self) -> None:
        if self.spill not in ("none", "host", "nvme"):
            raise PlanError(f"--spill {self.spill!r} is not one of none, host, nvme")
        if self.compute not in OFFLOAD_COMPUTE:
            raise PlanError(f"--offload-compute {self.compute!r} is not one of {', '.join(OFFLOAD_COMPUTE)}")
        if self.hit_rate is not None and not 0.0 <= self.hit_rate <= 1.0:
            raise PlanError(f"--hit-rate {self.hit_rate} must be between 0 and 1")
        if not 0.0 <= self.swap_overlap <= 1.0:
            raise PlanError(f"--swap-overlap {self.swap_overlap} must be between 0 and 1")
