"""Data-parallel attention with token dispatch (docs/distributed.md): each rank runs its own sequences, and
at each MoE layer sends its (token, expert) pairs' input rows to the experts' owners, which compute them
and send the outputs back; the source sums its tokens' pairs as one process does (`ep._combine`), so each
sequence gets one process's bits. Inference only; knows nothing of launching (runtime.py) or the commands.
Entry point: `TokenDispatch` (`apply_expert_parallel(..., data_parallel=True)` makes it as `ep.dispatch`).
Shapes: T tokens, I expert input width, K top-k, P pairs, E experts, S source ranks."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moeswap.distributed.ep import _combine
from moeswap.models.layers.moe import MoE, pairs_by_expert
from moeswap.ops.expert_mxfp4 import GEMM_MIN_TOKENS

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # activation dtypes, by header code
HEAD = 4  # header fields before the per-expert counts: has tokens, layer, tokens, dtype code


@dataclass
class DispatchStats:
    """What the dispatch cost this rank, summed over exchanges (bytes: rows to or from other ranks only)."""

    exchanges: int = 0  # MoE layer steps this rank took part in, without tokens of its own too
    tokens: int = 0  # this rank's tokens through MoE layer steps (a token counts once per layer)
    tokens_all_ranks: int = 0  # every rank's tokens through the same layer steps
    pairs_computed: int = 0  # (token, expert) pairs this rank's experts computed, any rank's tokens
    split_computes: int = 0  # exchanges whose received pairs ran source by source (an expert on the GEMM path)
    dispatch_bytes_sent: int = 0
    dispatch_bytes_received: int = 0  # other ranks' input rows for this rank's experts
    combine_bytes_sent: int = 0
    combine_bytes_received: int = 0  # this rank's pairs' outputs from their owners
    header_bytes_received: int = 0  # the routing counts (the all_gather)
    collective_s: float = 0.0
    expert_s: float = 0.0
    combine_s: float = 0.0

    def as_dict(self) -> dict:
        # per token of the whole batch (every rank's tokens), as the planner's expert_exchange_bytes counts
        per = self.dispatch_bytes_received / self.tokens_all_ranks if self.tokens_all_ranks else None
        return {"mode": "data-parallel", "exchanges": self.exchanges, "tokens_through_moe_layers": self.tokens,
                "tokens_all_ranks": self.tokens_all_ranks, "pairs_computed": self.pairs_computed,
                "split_computes": self.split_computes,
                "dispatch_bytes_sent": self.dispatch_bytes_sent,
                "dispatch_bytes_received": self.dispatch_bytes_received,
                "combine_bytes_sent": self.combine_bytes_sent, "combine_bytes_received": self.combine_bytes_received,
                "header_bytes_received": self.header_bytes_received,
                "dispatch_bytes_received_per_token_per_layer": per,
                "collective_s": round(self.collective_s, 6), "expert_s": round(self.expert_s, 6),
                "combine_s": round(self.combine_s, 6)}


class TokenDispatch:
    """One rank's token dispatch for `model`'s MoE blocks under `ep` (an ExpertParallel).

    One exchange per MoE layer step, three collectives: an all_gather of every rank's pair count per expert
    (the header, which also says whether the rank has tokens, the layer, its token count and dtype), then
    two all_to_all_single with uneven splits (dispatch: input rows to the owners; combine: outputs back).
    Every forward pass visits the MoE layers in order, so the ranks with tokens meet at the same layer
    (checked); a rank whose sequences are done calls `finish()` and answers the others with no tokens of
    its own until every rank has finished, so ranks may run different numbers of forward passes."""

    def __init__(self, ep, model):
        self.ep = ep
        self.blocks = {b.layer_idx: b for b in model.moe_blocks()}
        cfg = model.config
        self.E = cfg.moe.num_experts
        self.width = cfg.moe.latent_dim or cfg.hidden_size
        self.device = next(iter(self.blocks.values())).gate.weight.device
        self.stats = DispatchStats()

    def run_experts(self, block: MoE, h_TI: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
        """MoE.run_experts with this rank's own tokens (installed on each block by apply_expert_parallel)."""
        if block.store is None:
            raise RuntimeError(f"layer {block.layer_idx}: MoE block has no expert store attached")
        if "served_lora" in block._modules or block._experts_in_torch(h_TI, w_TK):
            raise NotImplementedError(f"layer {block.layer_idx}: data-parallel expert parallelism runs inference "
                                      f"only (no autograd, no expert LoRA): use the replicated mode")
        if h_TI.dtype not in DTYPES:
            raise ValueError(f"data-parallel expert parallelism: unsupported activation dtype {h_TI.dtype}")
        return self._step(block.layer_idx, h_TI, ids_TK, w_TK)

    def finish(self) -> None:
        """After this rank's last forward pass: takes part in the other ranks' exchanges (computing its
        experts for their tokens) until every rank has called finish. Every rank must call it."""
        while self._step(None, None, None, None) is not None:
            pass

    def _step(self, layer: int | None, h_TI, ids_TK, w_TK) -> torch.Tensor | bool | None:
        """One exchange: this rank's output rows [T, I] (layer given), True (no tokens of its own, others
        had some), None (no rank had tokens: everyone has finished)."""
        ep, st, E = self.ep, self.stats, self.E
        t0 = time.perf_counter()
        header = torch.zeros(HEAD + E, dtype=torch.int64)
        if layer is not None:
            T, K = ids_TK.shape
            unique, counts, token_of, weights = pairs_by_expert(ids_TK, w_TK)
            header[:HEAD] = torch.tensor([1, layer, T, DTYPES.index(h_TI.dtype)])
            if unique:
                header[HEAD + torch.tensor(unique, dtype=torch.int64)] = torch.tensor(counts, dtype=torch.int64)
        table = self._gather(header, -1 if layer is None else layer)  # [S, HEAD + E]
        active = table[:, 0] == 1
        if not bool(active.any()):
            return None
        L, dtype = self._agree(table, active, layer)
        block = self.blocks[L]
        owners = ep.owners[L]
        counts_SE = table[:, HEAD:]
        send_SQ = torch.stack([counts_SE[:, owners == q].sum(1) for q in range(ep.world)], dim=1)  # [S, S]
        if layer is not None:
            expert_of = torch.tensor(unique, dtype=torch.int64).repeat_interleave(
                torch.tensor(counts, dtype=torch.int64))
            # by owner, stably: within an owner the pairs stay in expert order, as the owner expects them
            order = owners[expert_of].argsort(stable=True)
            h_send = h_TI.index_select(0, token_of[order].to(h_TI.device))
        else:
            h_send = torch.empty(0, self.width, dtype=dtype, device=self.device)
        send, recv = send_SQ[ep.rank].tolist(), send_SQ[:, ep.rank].tolist()
        t1 = time.perf_counter()
        h_recv = self._all_to_all(h_send, send, recv, L, "dispatch")
        t2 = time.perf_counter()
        # the received rows: source by source, this rank's experts ascending, each its count of rows
        owned = (owners == ep.rank).nonzero().squeeze(1)
        per_source_SO = counts_SE[:, owned]
        expert_recv = owned.repeat(ep.world).repeat_interleave(per_source_SO.flatten())
        y_recv = self._compute(block, h_recv, expert_recv, per_source_SO)
        t3 = time.perf_counter()
        y_back = self._all_to_all(y_recv, recv, send, L, "combine")
        t4 = time.perf_counter()
        st.exchanges += 1
        st.tokens_all_ranks += int(table[:, 2].sum())
        st.pairs_computed += int(h_recv.shape[0])
        st.collective_s += (t2 - t1) + (t4 - t3)
        st.expert_s += t3 - t2
        if layer is None:
            st.combine_s += t1 - t0
            return True
        y_PI = torch.empty_like(y_back)
        y_PI[order.to(y_back.device)] = y_back
        out_TI = _combine(y_PI, token_of.to(h_TI.device), weights.to(h_TI.device), T, K)
        st.tokens += T
        st.combine_s += (t1 - t0) + (time.perf_counter() - t4)
        return out_TI.to(h_TI.dtype)

    def _agree(self, table: torch.Tensor, active: torch.Tensor, layer: int | None) -> tuple[int, torch.dtype]:
        """The layer and dtype of this exchange, which every rank with tokens must share."""
        layers = sorted(set(table[active, 1].tolist()))
        codes = set(table[active, 3].tolist())
        if len(layers) != 1 or (layer is not None and layers[0] != layer) or len(codes) != 1:
            ranks = [r for r in range(self.ep.world) if bool(active[r])]
            raise RuntimeError(f"rank {self.ep.rank}: data-parallel ranks {ranks} reached different MoE layers "
                               f"{layers} or activation dtypes in one exchange (their forward passes went out of step)")
        return layers[0], DTYPES[codes.pop()]

    def _compute(self, block: MoE, h_PI: torch.Tensor, expert_of: torch.Tensor, per_source_SO: torch.Tensor):
        """Each received row's expert output, exactly as the source rank's single process computes it. The
        grouped kernel computes each row on its own, but the GEMM path (GEMM_MIN_TOKENS rows of an expert or
        more) gives bits that depend on its row count: then each source's rows run in a call of their own,
        the rows and counts that source's single process runs."""
        if h_PI.shape[0] == 0:
            return h_PI.new_zeros(0, h_PI.shape[-1])
        ep = self.ep
        # one row per pair, weight 1: the block's fast path returns each pair's output exactly (0 + 1*y)
        run = lambda h, e: MoE._run_experts_fast(  # noqa: E731
            block, h, e[:, None].to(h.device), torch.ones(h.shape[0], 1, dtype=torch.float32, device=h.device))
        ep._local = True  # the block's resident table (this rank's experts only) may serve these calls
        try:
            if int(per_source_SO.sum(0).max()) < GEMM_MIN_TOKENS:  # grouped kernel only: rows independent
                return run(h_PI, expert_of)
            self.stats.split_computes += 1
            parts, at = [], 0
            for n in per_source_SO.sum(1).tolist():  # an expert on the GEMM path: each source's rows alone
                if n:
                    parts.append(run(h_PI[at : at + n], expert_of[at : at + n]))
                at += n
            return torch.cat(parts)
        finally:
            ep._local = False

    def _gather(self, header: torch.Tensor, layer: int) -> torch.Tensor:
        """Every rank's header [S, HEAD + E], on the CPU (sent from the model's device: NCCL takes only
        CUDA tensors)."""
        ep = self.ep
        header = header.to(self.device)
        rows = [torch.empty_like(header) for _ in range(ep.world)]
        ep.entered += 1
        try:
            dist.all_gather(rows, header, group=ep.group)
        except Exception as err:  # gloo/NCCL raise RuntimeError subclasses whose names vary by version
            raise ep._lost(layer, err) from None
        self.stats.header_bytes_received += (ep.world - 1) * header.numel() * header.element_size()
        return torch.stack(rows).cpu()

    def _all_to_all(self, x: torch.Tensor, send: list[int], recv: list[int], layer: int, what: str) -> torch.Tensor:
        ep = self.ep
        out = x.new_empty(sum(recv), self.width)
        ep.entered += 1
        try:
            dist.all_to_all_single(out, x.contiguous(), recv, send, group=ep.group)
        except Exception as err:
            raise ep._lost(layer, err) from None
        row = self.width * x.element_size()
        sent = (sum(send) - send[ep.rank]) * row
        got = (sum(recv) - recv[ep.rank]) * row
        if what == "dispatch":
            self.stats.dispatch_bytes_sent += sent
            self.stats.dispatch_bytes_received += got
        else:
            self.stats.combine_bytes_sent += sent
            self.stats.combine_bytes_received += got
        return out
