"""Load options: how a model is loaded and where its routed experts are kept, as one frozen dataclass.

Each field is one CLI flag (`--expert-memory` for `expert_memory`), declared once here with its help and
its choices, which come from the registry that owns them (cache policies, prefetch modes, ...).
Every command that loads a model adds the flags with `add_load_flags` and reads them back with
`LoadOptions.from_args`; a child process gets them as flags again with `to_argv`. Torch-free, so the
CLI builds its parser without importing torch. Entry point: `LoadOptions`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from moeswap.experts.hybrid import EXPERT_COMPUTE, EXPERT_GPU_MIN_TOKENS  # torch-free, as is everything here
from moeswap.experts.read_modes import DEFAULT_THREADS, EXPERT_READS
from moeswap.hub import resolve_model
from moeswap.ops.gemm_precision import GEMM_PRECISIONS
from moeswap.units import human_bytes, parse_bytes
from moeswap.weights import dense_quant

NO_CACHE = "none"  # --expert-policy none: no cache tier, every expert read from disk every time
PREFETCH_MODES = ("none", "next-layer")
DENSE_WEIGHTS = ("auto", "compute", *dense_quant.FORMATS)  # int8/int4: quantised at load (weights.dense_quant)
EXPERT_ACTIVATIONS = ("fp32", "int8")


def _policy_choices() -> tuple[str, ...]:
    from moeswap.experts.policy import POLICIES  # torch-free; read when asked, so registrations count

    return (*POLICIES, NO_CACHE)


def _option(default: Any, help: str, *, choices: Callable[[], Iterable[str]] | tuple[str, ...] | None = None,
            kind: str = "str", metavar: str | None = None, flag: bool = True):
    """A field with its flag: kind is str, int (>= 1), float (checked by its own rule), bytes (parsed '2GiB') or
    bool (a switch); flag=False keeps it out of the CLI (set by code only)."""
    return field(default=default, metadata={"help": help, "choices": choices, "kind": kind, "metavar": metavar,
                                            "flag": flag})


@dataclass(frozen=True)
class LoadOptions:
    dtype: str = _option("auto", "compute dtype: auto (fp32 on CPU, bf16 on GPU), float32, bfloat16")
    device: str = _option("cpu", "torch device, e.g. cpu or cuda")
    dense_weights: str = _option(
        "auto", "auto: keep bf16-stored Linear weights in bf16, and block-FP8 ones as their codes and scales, "
                "under fp32 math where a CPU kernel runs them (fewer bytes per decode step, same values); "
                "compute: convert to --dtype (torch's GEMM then: a row's numbers may depend on its batch, "
                "docs/numerics.md); int8 / int4: store the large dense matrices as int8 codes per row "
                "(int4: per 32 inputs) with a scale, quantised at load (compressed-tensors names, C kernels for "
                "decode; a checkpoint from `moeswap quantize --dense` loads as is)", choices=DENSE_WEIGHTS)
    expert_activations: str = _option(
        "fp32", "MXFP4 experts on the CPU: fp32 activations (default), or int8 per 32-value block with integer "
                "dot products, as llama.cpp computes them (faster; AVX-512 VNNI only)", choices=EXPERT_ACTIVATIONS)
    gemm_precision: str = _option(
        "fp32", "CPU matmuls with bf16 weights: fp32 (default, exact), or inputs rounded to bf16 as llama.cpp "
                "does (bf16 GEMM for prefill, bf16 dot products for decode batches; ~2x with AVX512-BF16)",
        choices=GEMM_PRECISIONS)
    # the expert store (experts/build.py)
    expert_memory: int = _option(1 << 30, "bytes of routed experts kept in the fast tier: accelerator memory, "
                                          "or host memory without one", kind="bytes")
    host_memory: int = _option(0, "bytes of a host-memory tier between the fast tier and disk (0: none)",
                               kind="bytes")
    expert_policy: str = _option(
        "lfru", "which expert a full tier gives up (lfru: frequency with decay); static needs --expert-profile; "
                "none keeps no cache and reads every expert from disk every time", choices=_policy_choices)
    prefetch: str = _option("none", "next-layer: guess the next layer's experts with its router and load them "
                                    "while this layer computes", choices=PREFETCH_MODES)
    decoded_experts: bool = _option(False, "keep decoded copies in the fast tier instead of the stored MXFP4, "
                                           "block-FP8 or INT4 bytes", kind="bool")
    expert_profile: str | None = _option(None, "routing trace (moeswap trace) for --expert-policy static",
                                         metavar="TRACE")
    expert_compute: str = _option(
        "gpu", "where a routed expert the fast tier lacks is computed: gpu copies it up into the fast tier and "
               "computes it there; cpu computes it on the CPU with the C kernels from host memory or disk (its "
               "token rows copied down, the result back; the fast tier keeps what it holds, filling only free "
               "room); auto picks per layer step: cpu below --expert-gpu-min-tokens tokens (decode), gpu from "
               "there (long prefill). Same on a CPU-only machine, where the fast tier is host memory",
        choices=EXPERT_COMPUTE)
    expert_gpu_min_tokens: int = _option(
        EXPERT_GPU_MIN_TOKENS, "--expert-compute auto: layer steps of at least this many tokens copy missing "
                               "experts up; fewer compute them on the CPU (llama.cpp's switch is 32 too)",
        kind="int", metavar="N")
    expert_reads: str = _option(
        "auto", "how routed experts are read from the checkpoint: direct (O_DIRECT, bypassing the page cache), "
                "buffered (through it), auto (direct where the file system allows, else buffered dropping what "
                "was read)", choices=EXPERT_READS)
    read_threads: int = _option(DEFAULT_THREADS, "reader threads: expert reads in flight at once (prefetch and "
                                                 "--expert-policy none)", kind="int", metavar="N")
    expert_top_p: float = _option(
        1.0, "skip each token's tail of routed experts: keep the fewest, by descending routing weight, whose share "
             "of its weight reaches P, renormalised as the architecture does (1: off; fewer experts read, "
             "perplexity cost in docs/swap.md)", kind="float", metavar="P")
    # benchmarks: every disk read comes from the device, not the OS page cache
    drop_page_cache: bool = _option(False, "", kind="bool", flag=False)

    def __post_init__(self):
        for f in fields(self):
            value, choices = getattr(self, f.name), _choices(f)
            if choices is not None and value not in choices:
                raise ValueError(f"{_flag(f)} {value!r}: expected one of {', '.join(choices)}")
            if f.metadata["kind"] == "bytes" and not (isinstance(value, int) and value >= 0):
                raise ValueError(f"{_flag(f)} must be a byte count >= 0, got {value!r}")
            if f.metadata["kind"] == "int" and not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{_flag(f)} must be an integer >= 1, got {value!r}")
        if not (isinstance(self.expert_top_p, (int, float)) and 0 < self.expert_top_p <= 1):
            raise ValueError(f"--expert-top-p must be a number in (0, 1], got {self.expert_top_p!r}")
        if self.expert_compute == "cpu" and self.prefetch != "none":
            raise ValueError("--expert-compute cpu computes missing experts where they are; --prefetch would copy "
                             "them up anyway (use --expert-compute auto, or --prefetch none)")

    @property
    def caching(self) -> bool:
        return self.expert_policy != NO_CACHE

    @property
    def keep_bf16(self) -> bool:
        """bf16-stored weights (dense, and float experts) stay bf16 where a CPU kernel runs them."""
        return self.dense_weights != "compute"

    def replace(self, **changes) -> LoadOptions:
        return replace(self, **changes)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides) -> LoadOptions:
        """The options a parser built with `add_load_flags` read; fields it did not add keep their defaults."""
        given = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        return cls(**{**given, **overrides})

    def to_argv(self) -> list[str]:
        """These options as flags for `add_load_flags` (those that differ from the defaults)."""
        argv: list[str] = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value == f.default:
                continue
            if not f.metadata["flag"]:
                raise ValueError(f"{f.name} has no flag; it cannot be passed on a command line")
            argv += [_flag(f)] if f.metadata["kind"] == "bool" else [_flag(f), str(value)]
        return argv


def _flag(f) -> str:
    return "--" + f.name.replace("_", "-")


def _choices(f) -> tuple[str, ...] | None:
    choices = f.metadata["choices"]
    return tuple(choices() if callable(choices) else choices) if choices is not None else None


def load_flag_names() -> tuple[str, ...]:
    return tuple(f.name for f in fields(LoadOptions) if f.metadata["flag"])


def add_load_flags(parser: argparse.ArgumentParser, *, only: Iterable[str] | None = None,
                   defaults: dict[str, Any] | None = None, title: str = "loading and the expert store") -> None:
    """Adds LoadOptions' flags to `parser` as one argument group: all of them, or the fields named in
    `only`; `defaults` overrides a field's default for this command (its help says so)."""
    defaults = dict(defaults or {})
    names = load_flag_names() if only is None else tuple(only)
    known = {f.name: f for f in fields(LoadOptions) if f.metadata["flag"]}
    unknown = [n for n in (*names, *defaults) if n not in known]
    if unknown:
        raise ValueError(f"no load option {unknown[0]!r}; known: {', '.join(known)}")
    group = parser.add_argument_group(title)
    for name in names:
        f = known[name]
        meta, default = f.metadata, defaults.get(name, f.default if f.default is not MISSING else None)
        kw: dict[str, Any] = {"dest": name, "default": default}
        if meta["kind"] == "bool":
            group.add_argument(_flag(f), action="store_true", help=meta["help"], **kw)
            continue
        shown = human_bytes(default) if meta["kind"] == "bytes" and default else default
        kw["help"] = meta["help"] + (f" (default {shown})" if shown not in (None, "") else "")
        if meta["kind"] == "bytes":
            kw["type"] = parse_bytes
        elif meta["kind"] == "int":
            kw["type"] = int
        elif meta["kind"] == "float":
            kw["type"] = float
        if meta["choices"] is not None:
            kw["choices"] = _choices(f)
        if meta["metavar"]:
            kw["metavar"] = meta["metavar"]
        group.add_argument(_flag(f), **kw)


DEFAULT_MODEL = "stdlib-k3"  # the trained model the repository ships (models/stdlib-k3, stdlib_model/)


def default_model_dir() -> str:
    """models/stdlib-k3 of the checkout moeswap runs from (a pip-installed package has none: the loader
    then says that directory has no config.json)."""
    return str(Path(__file__).resolve().parents[2] / "models" / DEFAULT_MODEL)


def add_model_argument(parser: argparse.ArgumentParser,
                       help: str = "model directory (config.json + safetensors + tokenizer)") -> None:
    """The MODEL positional of the commands that run a model, optional: the shipped default model. A name
    `org/name[@revision]` that is no directory is the Hugging Face cache's snapshot (hub.resolve_model)."""
    parser.add_argument("model", nargs="?", default=default_model_dir(), type=resolve_model,
                        help=f"{help}, or a Hugging Face name ORG/NAME[@REVISION] from its cache (`moeswap "
                             f"download`) (default: the shipped {DEFAULT_MODEL}, models/{DEFAULT_MODEL})")


def add_sampling_flags(parser: argparse.ArgumentParser, *, max_tokens: int, seed_help: str = "sampling seed") -> None:
    """The sampling and stopping flags of the commands that generate (generate, chat), declared once;
    engine.sampling.from_flags(args) reads them back as SamplingParams, which owns their checks."""
    p = parser
    p.add_argument("--max-tokens", type=int, default=max_tokens, help=f"most tokens to generate (default {max_tokens})")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (default 0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default 1: off)")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="OpenAI's, in [-2, 2]: lowers each token generated so far by this (default 0: off)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="OpenAI's, in [-2, 2]: lowers each token by this times its count so far (default 0: off)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 0: divides a positive logit (multiplies a negative one) of each token of the prompt "
                        "and the output so far, as transformers and llama.cpp do (default 1: off)")
    p.add_argument("--seed", type=int, default=None, help=seed_help)
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end the text where TEXT appears (left out of it); give it several times for several")
