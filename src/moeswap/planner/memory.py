"""Memory per device: weights by component and precision, KDA state, MLA cache, activations, reserve,
LoRA adapters/gradients/optimizer/checkpoints, and where routed experts live (HBM / host / NVMe).

Owns byte arithmetic only; knows nothing of time. Entry point: `device_memory` for one pipeline
stage's device; `model_bytes` for whole-model totals.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moeswap.weights import dense_quant

from .hardware import Hardware
from .layouts import Layout
from .params import Linear, ModelParams, kda_state_bytes_per_seq, mla_cache_values_per_token
from .workload import BYTES, Lora, Offload, Precision, bytes_per_param

GB = 1e9


@dataclass
class DeviceMemory:
    stage: int
    capacity: float  # accelerator memory, bytes
    parts: dict[str, float] = field(default_factory=dict)  # HBM use by component
    expert_need: float = 0.0  # bytes of routed experts this device is responsible for
    expert_host: float = 0.0  # of those, kept in host RAM
    expert_nvme: float = 0.0  # of those, kept on NVMe
    working_set: float = 0.0  # expert bytes that must sit in HBM at once when experts spill
    problem: str | None = None  # why this device does not fit (None: it fits)

    @property
    def used(self) -> float:
        return sum(self.parts.values())

    @property
    def expert_resident(self) -> float:
        return self.parts.get("experts", 0.0)

    @property
    def resident_fraction(self) -> float:
        return 1.0 if self.expert_need == 0 else self.expert_resident / self.expert_need


def linear_bytes(l: Linear, fmt: str) -> float:
    """Stored bytes of one matrix in `fmt`, its scales included (formats.py)."""
    return l.params * bytes_per_param(fmt, l.in_dim)


def expert_bytes(mp: ModelParams, prec: Precision) -> float:
    """Stored bytes of one routed expert in the experts' format."""
    fmt = prec.expert_format(mp.cfg)
    return sum(linear_bytes(l, fmt) for l in mp.expert)




def head_bytes(mp: ModelParams, prec: Precision) -> float:
    """The output head: in the --dense format where moeswap quantises it (int8, int4: weights/dense_quant.py's
    rule takes lm_head), else bf16."""
    fmt = prec.dense if prec.dense in dense_quant.FORMATS else "bf16"
    return mp.lm_head * bytes_per_param(fmt, mp.cfg.hidden_size)


def embedding_bytes(mp: ModelParams, prec: Precision, hw: Hardware | None = None) -> float:
    """The embedding table's resident bytes: bf16; none on a CPU-only machine (no host beside the device)
    under int8/int4 dense weights, where moeswap keeps the table as the checkpoint's mapping and a lookup
    reads a row (models/layers/basic.py StoredEmbedding) unless the head is tied to it."""
    mapped = prec.dense in dense_quant.FORMATS and hw is not None and hw.host is None and not mp.cfg.tie_word_embeddings
    return 0.0 if mapped else mp.embed * 2


def model_bytes(mp: ModelParams, prec: Precision) -> dict[str, float]:
    """Whole-model weight bytes by component at the given precision."""
    attn = sum(linear_bytes(l, prec.dense) for lp in mp.layers for l in lp.attn)
    mlp = sum(linear_bytes(l, prec.dense) for lp in mp.layers for l in lp.mlp)
    vec = sum(l.vectors * 2 + l.vectors_fp32 * 2 for l in mp.layers) + mp.final_vectors * 2
    return {
        "attention": attn,
        "dense/shared MLP": mlp,
        "norms and vectors": vec,
        "embed + lm_head": mp.embed * 2 + head_bytes(mp, prec),
        "routed experts": mp.num_experts_total * expert_bytes(mp, prec),
    }


def _linear_share(l: Linear, tp: int) -> float:
    """Fraction of a matrix one TP rank holds."""
    return 1.0 if l.split == "rep" else 1.0 / tp


def _lora_params(l: Linear, rank: int, tp: int) -> float:
    # A is [r, in] and B is [out, r]; the split dimension of the base matrix splits one of them.
    if l.split == "col":
        return rank * (l.in_dim + l.out_dim / tp)
    if l.split == "row":
        return rank * (l.in_dim / tp + l.out_dim)
    return rank * (l.in_dim + l.out_dim)


def lora_params_per_device(mp: ModelParams, layers: range, lay: Layout, lora: Lora) -> float:
    n = 0.0
    for i in layers:
        lp = mp.layers[i]
        if "attn" in lora.targets:
            n += sum(_lora_params(l, lora.rank, lay.tp) for l in lp.attn)
        if "mlp" in lora.targets:
            n += sum(_lora_params(l, lora.rank, lay.tp) for l in lp.mlp if l.name != "gate")
        if "experts" in lora.targets and lp.num_experts:
            per_expert = sum(_lora_params(l, lora.rank, lay.expert_tp) for l in mp.expert)
            n += per_expert * lp.num_experts / lay.ep
    return n


def activation_bytes(mp: ModelParams, lay: Layout, tokens: float, values: float) -> float:
    """Peak live activations inside one layer for `tokens` tokens on each DP rank (bf16).

    The MoE intermediates of all DP ranks' tokens spread over the stage's tp * dp devices.
    """
    cfg = mp.cfg
    d = cfg.hidden_size
    moe = cfg.moe.top_k * 3 * cfg.moe.expert_dim / lay.tp if "moe" in cfg.mlp_kinds else 0
    return tokens * 2 * (values * d + moe)


def device_memory(mp: ModelParams, lay: Layout, stage: int, layers: range, hw: Hardware, prec: Precision,
                  off: Offload, *, seqs: float = 0.0, ctx: int = 0, act_tokens: float = 0.0,
                  logit_tokens: float = 0.0, lora: Lora | None = None,
                  ws_tokens: float | None = None) -> DeviceMemory:
    """Memory of one device of pipeline stage `stage` (owning `layers`).

    seqs: sequences whose state this device keeps; ctx: cached tokens per sequence;
    act_tokens: tokens in flight through one layer at once (prefill chunk or micro-batch);
    ws_tokens: tokens whose experts must be in HBM together when experts spill (default: all experts).
    """
    cfg, eng = mp.cfg, hw.engine
    last = stage == lay.pp - 1
    mem = DeviceMemory(stage, hw.hbm_bytes)
    parts = mem.parts

    w = 0.0
    for i in layers:
        lp = mp.layers[i]
        w += sum(linear_bytes(l, prec.dense) * _linear_share(l, lay.tp) for l in lp.attn + lp.mlp)
        w += lp.vectors * 2 + lp.vectors_fp32 * 2  # fp32 vectors take 4 bytes: 2 counted here, 2 above
    parts["dense weights"] = w
    emb = (embedding_bytes(mp, prec, hw) if stage == 0 else 0) + (head_bytes(mp, prec) + mp.final_vectors * 2
                                                                  if last else 0)
    parts["embed + lm_head"] = emb / lay.tp

    # Per-sequence state: KDA state splits over TP by heads; the MLA latent is shared by all heads,
    # so TP ranks each keep a copy unless DCP splits it by tokens.
    n_kda = sum(1 for i in layers if cfg.attn_kinds[i] == "kda")
    n_mla = sum(1 for i in layers if cfg.attn_kinds[i] == "mla")
    if n_kda:
        state, conv = kda_state_bytes_per_seq(cfg)
        per_layer = (state + conv) / cfg.attn_kinds.count("kda")
        parts["KDA state"] = seqs * n_kda * per_layer / lay.tp
    if n_mla:
        per_tok = mla_cache_values_per_token(cfg) / cfg.attn_kinds.count("mla") * BYTES[prec.kv_cache]
        parts["MLA cache"] = seqs * ctx * n_mla * per_tok / (lay.tp if lay.dcp else 1)

    act = activation_bytes(mp, lay, act_tokens, eng.activation_values)
    if lora is not None:
        n_ad = lora_params_per_device(mp, layers, lay, lora)
        parts["LoRA adapters (fp32)"] = n_ad * 4
        parts["adapter grads (fp32)"] = n_ad * 4
        parts["optimizer state (Adam)"] = n_ad * 8
        in_flight = lay.pp - stage  # 1F1B: stage s holds pp - s micro-batches' inputs
        t = lora.tokens_per_micro_batch(lay.dp) / lay.dp
        if lora.checkpointing:
            bank = len(range(0, cfg.num_layers, cfg.attn_res_block_size)) if cfg.attn_res_block_size else 0
            parts["checkpoints"] = in_flight * t * (len(layers) + bank) * cfg.hidden_size * 2
            act = 2 * activation_bytes(mp, lay, t, eng.activation_values)  # recompute + its backward
        else:
            parts["stored activations"] = in_flight * len(layers) * activation_bytes(mp, lay, t, eng.activation_values)
            act = activation_bytes(mp, lay, t, eng.activation_values)
        logit_tokens = t if last else 0
    parts["activations"] = act + logit_tokens * cfg.vocab_size / lay.tp * 4
    parts["runtime reserve"] = eng.reserve_gb * GB + eng.reserve_fraction * hw.hbm_bytes

    if lora is not None and ws_tokens is None:
        ws_tokens = lora.tokens_per_micro_batch(lay.dp)
    _place_experts(mp, lay, layers, hw, prec, off, mem, ws_tokens)
    return mem


def _place_experts(mp: ModelParams, lay: Layout, layers: range, hw: Hardware, prec: Precision,
                   off: Offload, mem: DeviceMemory, ws_tokens: float | None) -> None:
    moe = mp.cfg.moe
    per_layer = moe.num_experts / lay.ep * expert_bytes(mp, prec) / lay.expert_tp
    n_moe = sum(1 for i in layers if mp.layers[i].num_experts)
    need = n_moe * per_layer
    mem.expert_need = need
    # Swapping needs the experts of the layer in use and of the next one (prefetch); computing on the
    # host needs none (auto swaps for prefill, so it needs them too). A batch of T tokens touches 1-(1-k/E)^T of a layer's experts.
    touched = 1.0 if ws_tokens is None else 1 - (1 - moe.top_k / moe.num_experts) ** max(ws_tokens, 1)
    mem.working_set = 0.0 if off.compute == "host" else min(need, 2 * per_layer * touched)
    budget = mem.capacity - mem.used
    if budget < 0:
        mem.parts["experts"] = 0.0
        mem.problem = (f"stage {mem.stage}: weights, state and activations need {mem.used / GB:.1f} GB, "
                       f"more than the {mem.capacity / GB:.0f} GB on each device, before any expert")
        return
    if budget >= need:
        mem.parts["experts"] = need
        return
    if off.spill == "none":
        mem.parts["experts"] = budget
        mem.problem = (f"stage {mem.stage}: routed experts need {need / GB:.1f} GB per device but only "
                       f"{budget / GB:.1f} GB remain; use more devices or allow --spill host")
        return
    if budget < mem.working_set:
        mem.parts["experts"] = budget
        mem.problem = (f"stage {mem.stage}: only {budget / GB:.1f} GB remain for experts, less than the "
                       f"two-layer working set of {mem.working_set / GB:.1f} GB that swapping needs")
        return
    mem.parts["experts"] = budget
    spilled = need - budget
    # Devices of different replicas on one server hold the same experts and can share host copies.
    share = max(1, hw.on_node(lay.devices) // lay.replica_devices)
    host_cap = hw.host_bytes_per_device(lay.devices) * share
    mem.expert_host = min(spilled, host_cap)
    rest = spilled - mem.expert_host
    if rest <= 0:
        return
    if off.spill != "nvme":
        mem.problem = (f"stage {mem.stage}: {spilled / GB:.0f} GB of experts per device spill but the host "
                       f"holds only {host_cap / GB:.0f} GB per device; allow --spill nvme or use more devices")
        return
    nvme_cap = hw.storage_bytes_per_device(lay.devices) * share
    mem.expert_nvme = min(rest, nvme_cap)
    if rest > nvme_cap:
        mem.problem = (f"stage {mem.stage}: {rest / GB:.0f} GB of experts per device exceed host RAM and the "
                       f"{nvme_cap / GB:.0f} GB of NVMe per device")
