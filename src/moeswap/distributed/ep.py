"""Expert parallelism applied from outside the model: each MoE block computes only the routed experts its
rank owns (distributed/placement.py) and the ranks exchange the results, so that every rank ends the
block with the same output a single process computes, bit for bit.

Every rank runs the same tokens through the replicated parts (embeddings, attention, dense MLPs, shared
experts, routers, latent projections); routing is therefore the same on every rank, and each rank knows
every other rank's share without asking. A rank computes its (token, expert) pairs, sends those outputs to
every other rank (all_to_all_single with uneven splits: a rank's pairs go to all the others, nothing
to itself), and every rank sums each token's pairs in the single process's order: experts ascending,
each `y += w * out` in fp32 from zero, as models/layers/moe.py and ops/csrc/moe.c do. Knows nothing of
launching or rendezvous (distributed/runtime.py). Entry point: `apply_expert_parallel(model, group, placement)`.
Shapes: T tokens, I expert input width, P (token, expert) pairs, K top-k.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from moeswap.distributed.placement import Placement
from moeswap.models.layers.moe import MoE, pairs_by_expert


class PeerLost(RuntimeError):
    """A collective failed or timed out: another rank died, hung, or left. The CLI prints it in one line."""

    exit_code = 1


@dataclass
class EPStats:
    """What the exchange cost this rank, summed over layer steps."""

    layer_steps: int = 0
    tokens: int = 0  # tokens through MoE layer steps (a token counts once per layer)
    pairs_local: int = 0  # (token, expert) pairs this rank computed
    bytes_sent: int = 0
    bytes_received: int = 0
    collective_s: float = 0.0
    expert_s: float = 0.0  # computing this rank's experts (store fetches included)
    combine_s: float = 0.0
    per_layer: dict = field(default_factory=dict)  # layer -> [tokens, bytes received]

    def as_dict(self) -> dict:
        per_token = self.bytes_received / self.tokens if self.tokens else None
        return {"layer_steps": self.layer_steps, "tokens_through_moe_layers": self.tokens,
                "pairs_local": self.pairs_local, "bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                "bytes_received_per_token_per_layer": per_token, "collective_s": round(self.collective_s, 6),
                "expert_s": round(self.expert_s, 6), "combine_s": round(self.combine_s, 6)}


class ExpertParallel:
    """One rank's part of expert parallelism over `group` (None: the default group)."""

    def __init__(self, group, placement: Placement):
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        if placement.world != self.world:
            raise ValueError(f"the expert placement is for {placement.world} ranks, the process group has {self.world}")
        self.placement = placement
        self.owners = [torch.tensor(row, dtype=torch.int64) if row else None for row in placement.owners]
        self.stats = EPStats()
        self.entered = 0  # exchanges this rank has entered (the heartbeat publishes it: who is behind)
        self.failed: PeerLost | None = None  # set when an exchange failed: the group is unusable
        # () -> a sentence naming the lost rank(s), set by runtime.init when it runs a heartbeat
        self.diagnose: Callable[[], str] | None = None

    def owns(self, layer: int, expert: int) -> bool:
        return self.placement.owner(layer, expert) == self.rank

    def run_experts(self, block: MoE, h_TI: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
        """MoE.run_experts under expert parallelism (installed on each block by apply_expert_parallel)."""
        if block.store is None:
            raise RuntimeError(f"layer {block.layer_idx}: MoE block has no expert store attached")
        if block._experts_in_torch(h_TI, w_TK) or "served_lora" in block._modules:
            raise NotImplementedError(f"layer {block.layer_idx}: expert parallelism runs inference without "
                                      f"expert adapters; training and served expert LoRA are not supported under it yet")
        L, T, I = block.layer_idx, h_TI.shape[0], h_TI.shape[-1]
        st = self.stats
        t0 = time.perf_counter()
        unique, counts, token_of, weights = pairs_by_expert(ids_TK, w_TK)
        P = token_of.numel()
        expert_of = torch.tensor(unique, dtype=torch.int64).repeat_interleave(torch.tensor(counts, dtype=torch.int64))
        owner_P = self.owners[L][expert_of]  # routing bookkeeping stays on the CPU; activations on h's device
        token_of = token_of.to(h_TI.device)
        sel = [(owner_P == q).nonzero().squeeze(1) for q in range(self.world)]  # each rank's pairs, in pair order
        mine = sel[self.rank]
        n = [int(s.numel()) for s in sel]
        if n[self.rank]:
            # one row per pair, weight 1: the block's own fast path returns each pair's expert output exactly
            # (0 + 1*y), computed by the same kernels on the same rows as in a single process
            h_PI = h_TI.index_select(0, token_of[mine.to(h_TI.device)])
            ones = torch.ones(n[self.rank], 1, dtype=w_TK.dtype, device=w_TK.device)
            y_mine = MoE._run_experts_fast(block, h_PI, expert_of[mine][:, None].to(ids_TK.device), ones)
        else:
            y_mine = h_TI.new_zeros(0, I)
        t1 = time.perf_counter()
        y_PI = h_TI.new_empty(P, I)
        y_PI[mine.to(h_TI.device)] = y_mine
        if self.world > 1:
            others = [q for q in range(self.world) if q != self.rank]
            send = [0 if q == self.rank else n[self.rank] for q in range(self.world)]
            recv = [0 if q == self.rank else n[q] for q in range(self.world)]
            inp = torch.cat([y_mine] * len(others)) if others else y_mine
            out = h_TI.new_empty(sum(recv), I)
            self.entered += 1
            try:
                dist.all_to_all_single(out, inp.contiguous(), recv, send, group=self.group)
            except Exception as err:  # gloo/NCCL raise RuntimeError subclasses whose names vary by version
                raise self._lost(L, err) from None
            at = 0
            for q in others:
                y_PI[sel[q].to(h_TI.device)] = out[at : at + n[q]]
                at += n[q]
            item = h_TI.element_size()
            st.bytes_sent += inp.numel() * item
            got = out.numel() * item
            st.bytes_received += got
            row = st.per_layer.setdefault(L, [0, 0])
            row[0] += T
            row[1] += got
        t2 = time.perf_counter()
        out_TI = _combine(y_PI, token_of, weights.to(h_TI.device), T, ids_TK.shape[1])
        t3 = time.perf_counter()
        st.layer_steps += 1
        st.tokens += T
        st.pairs_local += n[self.rank]
        st.expert_s += t1 - t0
        st.collective_s += t2 - t1
        st.combine_s += t3 - t2
        return out_TI.to(h_TI.dtype)

    def _lost(self, layer: int, err: BaseException) -> PeerLost:
        who = self.diagnose() if self.diagnose is not None else "another rank died, hung or left"
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        self.failed = PeerLost(f"rank {self.rank}: the expert exchange of layer {layer} failed: {who} ({first})")
        return self.failed


def _combine(y_PI: torch.Tensor, token_of: torch.Tensor, weights: torch.Tensor, T: int, K: int) -> torch.Tensor:
    """Each token's pairs summed as a single process sums them: in fp32 from zero, experts ascending,
    one rounded product then one rounded sum per pair (ops/csrc/moe.c: y[t] += w * out, no contraction;
    moe.py: index_add_ of y * w)."""
    I = y_PI.shape[-1]
    c_PI = y_PI.float() * weights.to(torch.float32)[:, None]
    out_TI = torch.zeros(T, I, dtype=torch.float32, device=y_PI.device)
    if token_of.numel() == T * K:  # every token has K distinct experts: K rounds of one add per token
        order = token_of.argsort(stable=True)  # stable: within a token, pair order = experts ascending
        c_TKI = c_PI.index_select(0, order).view(T, K, I)
        for j in range(K):
            out_TI += c_TKI[:, j]
        return out_TI
    for p in range(token_of.numel()):  # (never taken by the routers here; kept exact for any routing)
        out_TI[token_of[p]] += c_PI[p]
    return out_TI


def apply_expert_parallel(model, group=None, placement: Placement | None = None) -> ExpertParallel:
    """Makes every MoE block of `model` compute only its rank's routed experts and exchange the rest over
    `group` (None: the default process group). The model's files and classes are untouched: each block gets
    an instance-level `run_experts` and no resident table (whose C paths would compute every expert
    locally), and a next-layer prefetcher is limited to the rank's experts, so its store only ever loads
    experts this rank owns. Returns the ExpertParallel (its `stats`)."""
    from moeswap.distributed.placement import contiguous

    if placement is None:
        placement = contiguous(model.config, dist.get_world_size(group))
    ep = ExpertParallel(group, placement)
    for block in model.moe_blocks():
        if not placement.owners[block.layer_idx]:
            raise ValueError(f"the expert placement has no owners for MoE layer {block.layer_idx}")
        block.run_experts = lambda h, ids, w, block=block: ep.run_experts(block, h, ids, w)
        block.resident_table = lambda: None
    stores = {id(b.store): b.store for b in model.moe_blocks() if b.store is not None}
    for store in stores.values():
        prefetcher = getattr(store, "prefetcher", None)
        if prefetcher is not None:
            hint = prefetcher.hint
            prefetcher.hint = lambda layer, ids, hint=hint: hint(layer, [e for e in ids if ep.owns(layer, int(e))])
    model.expert_parallel = ep
    return ep
