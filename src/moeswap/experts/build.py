"""Building an expert store for a loaded model: each expert's sizes from the checkpoint header, the
tiers and their budgets (checked at start-up), the cache policy per tier, and the prefetcher.

Reads its settings from the load options (`StoreSettings`: the fields of options.LoadOptions it uses). Knows
nothing of models beyond the config's top-k. Entry point: `build_store(ckpt, index, config, dtype, device, options)`.
"""

from __future__ import annotations

from functools import partial
from typing import Protocol

import torch

from moeswap.config import ModelConfig
from moeswap.experts.keys import Key
from moeswap.experts.policy import lfru_half_life, make_policy
from moeswap.experts.source import ExpertIndex
from moeswap.experts.store import ExpertStore
from moeswap.experts.tiers import CheckpointTier, MemoryTier, Tier, convert
from moeswap.formats.checkpoint import Checkpoint
from moeswap.units import human_bytes
from moeswap.weights.floating import keeps_bf16


class StoreSettings(Protocol):
    """What the builder reads of the load options (options.LoadOptions has every one): the store sits below the
    flags layer and names no type of it."""

    @property
    def caching(self) -> bool: ...
    @property
    def keep_bf16(self) -> bool: ...
    @property
    def decoded_experts(self) -> bool: ...
    @property
    def drop_page_cache(self) -> bool: ...
    @property
    def expert_memory(self) -> int: ...
    @property
    def host_memory(self) -> int: ...
    @property
    def expert_policy(self) -> str: ...
    @property
    def expert_profile(self) -> str | None: ...
    @property
    def expert_compute(self) -> str: ...
    @property
    def expert_gpu_min_tokens(self) -> int: ...
    @property
    def prefetch(self) -> str: ...
    @property
    def expert_reads(self) -> str: ...
    @property
    def read_threads(self) -> int: ...


def _expert_sizes(ckpt: Checkpoint, index: ExpertIndex, key: Key, itemsize: int) -> tuple[int, int]:
    """(stored bytes, decoded bytes at `itemsize`) of one expert, from the checkpoint header and its format."""
    fmt = index.format
    infos = [{kind: ckpt.info(name) for kind, name in kinds.items()} for kinds in index.names(*key).values()]
    return sum(fmt.stored_bytes(i) for i in infos), sum(fmt.decoded_bytes(i, itemsize) for i in infos)


def _stored_bf16(ckpt: Checkpoint, index: ExpertIndex, key: Key) -> bool:
    """Whether the expert's weights are plain bf16 tensors (not quantised) in the checkpoint."""
    return index.format.name == "float" and all(
        ckpt.info(kinds["weight"]).dtype == torch.bfloat16 for kinds in index.names(*key).values())


def _timed_form(form, store: ExpertStore, w):
    """The fast tier's form on CUDA, timed by events on the stream it runs on (StoreStats.copies)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    formed = form(w)
    end.record()
    side = getattr(store.prefetcher, "stream", None)
    store.stats.copies.record(start, end, w.nbytes, side is not None and torch.cuda.current_stream() == side)
    return formed


def build_store(ckpt: Checkpoint, index: ExpertIndex, config: ModelConfig, dtype: torch.dtype,
                device: str | torch.device, options: StoreSettings) -> ExpertStore:
    """The tiered store for a loaded model; fails at start-up on budgets that cannot work."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda" is the current device: named as its tensors say
        device = torch.device("cuda", torch.cuda.current_device())
    accelerator = device.type != "cpu"
    caching = options.caching
    sizes: dict[Key, tuple[int, int]] = {}
    first = min(index.entries)  # every expert has the same shapes and format (ExpertIndex.validate)
    packed = index.format.keeps_bytes  # kept as the stored bytes (else decoded when read)
    # bf16-stored float experts stay bf16 where a CPU kernel runs them under fp32 math (as dense weights do)
    expert_dtype = torch.bfloat16 if options.keep_bf16 and _stored_bf16(ckpt, index, first) and keeps_bf16(
        torch.bfloat16, dtype, device) else dtype

    def size(key: Key) -> tuple[int, int]:
        if key not in sizes:
            sizes[key] = _expert_sizes(ckpt, index, key, expert_dtype.itemsize)
        return sizes[key]

    def fast_cost(key: Key) -> int:
        stored, decoded = size(key)
        return stored if packed and not options.decoded_experts else decoded

    def host_cost(key: Key) -> int:
        stored, decoded = size(key)
        return stored if packed else decoded

    # spare read buffers: two layer steps' worth of misses, so a miss reuses an evicted expert's buffer
    spare = 2 * config.moe.top_k * size(Key(*first))[0]
    disk = CheckpointTier(ckpt, index, expert_dtype, options.drop_page_cache, spare_buffer_bytes=spare,
                          pin_background=device.type == "cuda", reads=options.expert_reads)
    # MXFP4 bytes kept on the CPU are the read buffer's views as they are: no form to make (and no per-load
    # check that they already are one)
    keep_as_read = device.type == "cpu" and packed and not options.decoded_experts
    fast = MemoryTier("fast", options.expert_memory if caching else 0, fast_cost,
                      (lambda w: w) if keep_as_read else
                      partial(convert, decoded=options.decoded_experts, dtype=expert_dtype, device=device), device)
    tiers: list[Tier] = [fast]
    if caching and options.host_memory:
        tiers.append(MemoryTier("host", options.host_memory, host_cost,
                                partial(convert, decoded=False, dtype=expert_dtype, device=torch.device("cpu"),
                                        pin=accelerator)))
    tiers.append(disk)

    top_k = config.moe.top_k
    slots = 0
    if caching:
        form = "decoded" if options.decoded_experts or not packed else index.format.label
        need = top_k * fast_cost(Key(*first))
        if options.expert_memory < need:
            raise ValueError(
                f"--expert-memory {human_bytes(options.expert_memory)} is smaller than one layer's active experts: "
                f"{top_k} x {human_bytes(fast_cost(Key(*first)))} ({form}) = {human_bytes(need)}; "
                f"give at least {human_bytes(need)}")
        host_need = top_k * host_cost(Key(*first))
        if options.host_memory and options.host_memory < host_need:
            raise ValueError(f"--host-memory {human_bytes(options.host_memory)} is smaller than one layer's active "
                             f"experts ({human_bytes(host_need)}); give at least that, or 0 for no host tier")
        slots = options.expert_memory // fast_cost(Key(*first))

    trace = None
    if options.expert_profile:
        from moeswap.experts.trace import read_trace

        trace = read_trace(options.expert_profile).check_model(config, f"--expert-profile {options.expert_profile}")
    policy = options.expert_policy if caching else "lru"
    kwargs = dict(profile=trace.profile() if trace else None, half_life=lfru_half_life(slots),
                  future=trace.accesses() if trace and policy == "belady" else None)
    policies = [make_policy(policy, **kwargs)]
    if len(tiers) == 3:  # the host tier sees only fast-tier misses: Belady's future does not apply there
        policies.append(make_policy("lru" if policy == "belady" else policy, **kwargs))
    store = ExpertStore(tiers, policies, max_hint=max(top_k, slots // 4))
    if device.type == "cuda":
        fast.form = partial(_timed_form, fast.form, store)
    store.can_evict = not caching or options.expert_memory < len(index.entries) * fast_cost(Key(*first))
    if options.expert_compute != "gpu":
        from moeswap.experts.hybrid import HybridExperts

        store.hybrid = HybridExperts(store, options.expert_compute, options.expert_gpu_min_tokens)
    # a store that keeps nothing streams: its reader threads read each layer step's misses together (and the
    # next layer's guess with --prefetch next-layer)
    if options.prefetch == "next-layer" or not caching:
        from moeswap.experts.prefetch import Prefetcher

        store.prefetcher = Prefetcher(store, options.read_threads, lookahead=options.prefetch == "next-layer")
    return store
