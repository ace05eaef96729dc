"""Data-parallel attention with token dispatch (docs/distributed.md): each rank runs its own sequences, and
at each MoE layer sends its (token, expert) pairs' input rows to the experts' owners, which compute them
through their blocks' own executors and send the outputs back; the source sums its tokens' pairs as one
process does (`ep.combine_in_order`). Under autograd backward runs the same exchange the other way. Knows nothing of
launching (runtime.py). Entry point: `TokenDispatch` (`apply_expert_parallel(..., data_parallel=True)`).
Shapes: T tokens, I expert input width, K top-k, P pairs, E experts, S source ranks."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moeswap.distributed.ep import ExpertParallelExecutor, combine_in_order
from moeswap.experts.executors import ExpertExecutor
from moeswap.experts.pairs import combine_pairs, pairs_by_expert
from moeswap.ops.expert_mxfp4 import GEMM_MIN_TOKENS

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # activation dtypes, by header code
# what an exchange carries, the header's kind field: rows for the inference kernels; rows for the experts' torch
# path without autograd (expert LoRA at eval); the same with autograd (the owner keeps its graph for backward);
# backward: output gradients to the owners, input gradients back
FAST, TORCH, GRAD, BACKWARD = range(4)
# header fields before the per-expert counts: has tokens, layer, tokens, dtype code, kind, and (backward) the
# forward exchange whose graph it runs back through
HEAD = 6


@dataclass
class DispatchStats:
    """What the dispatch cost this rank, summed over exchanges (bytes: rows to or from other ranks only)."""

    exchanges: int = 0  # MoE layer steps this rank took part in, without tokens of its own too
    backward_exchanges: int = 0  # of those, backward ones (training)
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
        return {"mode": "data-parallel", "exchanges": self.exchanges, "backward_exchanges": self.backward_exchanges,
                "tokens_through_moe_layers": self.tokens,
                "tokens_all_ranks": self.tokens_all_ranks, "pairs_computed": self.pairs_computed,
                "split_computes": self.split_computes,
                "dispatch_bytes_sent": self.dispatch_bytes_sent,
                "dispatch_bytes_received": self.dispatch_bytes_received,
                "combine_bytes_sent": self.combine_bytes_sent, "combine_bytes_received": self.combine_bytes_received,
                "header_bytes_received": self.header_bytes_received,
                "dispatch_bytes_received_per_token_per_layer": per,
                "collective_s": round(self.collective_s, 6), "expert_s": round(self.expert_s, 6),
                "combine_s": round(self.combine_s, 6)}


@dataclass
class _Mine:
    """This rank's side of one exchange: its pairs (experts ascending, each its tokens in order) and the rows
    it sends for them, pair p's row being rows[token_of[p]] (forward: `rows` are the tokens' inputs) or
    rows[p] (backward: `rows` are the pairs' output gradients)."""

    layer: int
    T: int
    unique: list[int]
    counts: list[int]
    token_of: torch.Tensor
    rows: torch.Tensor | None
    by_token: bool
    ref: int = 0  # backward: the forward exchange whose graphs it runs back through


class TokenDispatch:
    """One rank's token dispatch for `model`'s MoE blocks under `ep` (an ExpertParallel).

    One exchange per MoE layer step (and under autograd one more per layer in backward), three collectives:
    an all_gather of every rank's pair count per expert (the header, which also says whether the rank has
    tokens, the layer, its token count, dtype and the exchange's kind), then two all_to_all_single with
    uneven splits (dispatch: rows to the owners; combine: their results back). Every forward pass visits
    the MoE layers in order and every backward pass in reverse, so the ranks with tokens meet at the same
    layer and kind (checked); a rank whose sequences or micro-batches are done calls `finish()` and answers
    the others with no tokens of its own until every rank has finished, so ranks may run different numbers
    of forward and backward passes."""

    def __init__(self, ep, model):
        self.ep = ep
        self.blocks = {b.layer_idx: b for b in model.moe_blocks()}  # their executors: ExpertParallelExecutor
        cfg = model.config
        self.E = cfg.moe.num_experts
        self.width = cfg.moe.latent_dim or cfg.hidden_size
        self.device = next(iter(self.blocks.values())).gate.weight.device
        self.stats = DispatchStats()
        self.forwards = 0  # forward exchanges so far: the same count on every rank, as all take part in each
        # forward exchange -> (layer, [(source rank, its rows as a leaf [n, I], their outputs [n, I])]): the
        # graphs of the rows this rank computed under autograd, kept until backward runs through them
        self._graphs: dict[int, tuple[int, list]] = {}

    def run_experts(self, executor: ExpertParallelExecutor, h_TI: torch.Tensor, ids_TK: torch.Tensor,
                    w_TK: torch.Tensor) -> torch.Tensor:
        """A block's routed experts with this rank's own tokens (ExpertParallelExecutor's work)."""
        if h_TI.dtype not in DTYPES:
            raise ValueError(f"data-parallel expert parallelism: unsupported activation dtype {h_TI.dtype}")
        if not executor.in_torch(h_TI, w_TK):
            return self._fast(executor.layer, h_TI, ids_TK, w_TK)
        executor.check_lora()
        unique, counts, token_of, weights = pairs_by_expert(ids_TK, w_TK)
        token_of = token_of.to(h_TI.device)
        y_PI = _Dispatched.apply(h_TI, self, executor.layer, unique, counts, token_of, torch.is_grad_enabled())
        # as the experts' torch path combines its pairs: the routing weights' gradient stays on this rank
        return combine_pairs(h_TI, y_PI, weights, token_of).to(h_TI.dtype)

    def finish(self) -> None:
        """After this rank's last forward (and backward) pass: takes part in the other ranks' exchanges
        (computing its experts for their tokens, and backward through them) until every rank has called
        finish. Every rank must call it."""
        while self._exchange(None, FAST) is not None:
            pass
        self._graphs.clear()  # forward exchanges that no backward came back through (a rank stopped by an error)

    def _fast(self, layer: int, h_TI, ids_TK, w_TK) -> torch.Tensor:
        """Inference: this rank's pairs on the owners' inference kernels, summed per token (ep.combine_in_order)."""
        T, K = ids_TK.shape
        unique, counts, token_of, weights = pairs_by_expert(ids_TK, w_TK)
        y_PI, _ = self._exchange(_Mine(layer, T, unique, counts, token_of, h_TI, True), FAST)
        t = time.perf_counter()
        out_TI = combine_in_order(y_PI, token_of.to(h_TI.device), weights.to(h_TI.device), T, K)
        self.stats.combine_s += time.perf_counter() - t
        return out_TI.to(h_TI.dtype)

    def _exchange(self, mine: _Mine | None, kind: int):
        """One exchange: (this rank's pairs' results [P, I] in pair order, the forward exchange's number)
        when it has pairs (`mine`), True when it had none and others had some, None when no rank had any
        (everyone has finished). A rank without pairs takes the kind, layer and dtype from the others."""
        ep, st, E = self.ep, self.stats, self.E
        t0 = time.perf_counter()
        header = torch.zeros(HEAD + E, dtype=torch.int64)
        if mine is not None:
            header[:HEAD] = torch.tensor([1, mine.layer, mine.T, DTYPES.index(mine.rows.dtype), kind, mine.ref])
            if mine.unique:
                header[HEAD + torch.tensor(mine.unique, dtype=torch.int64)] = torch.tensor(mine.counts,
                                                                                        dtype=torch.int64)
        table = self._gather(header, -1 if mine is None else mine.layer)  # [S, HEAD + E]
        active = table[:, 0] == 1
        if not bool(active.any()):
            return None
        L, dtype, kind, ref = self._agree(table, active, mine, kind)
        inner = self._inner(L)
        owners = ep.owners[L]
        counts_SE = table[:, HEAD:]
        send_SQ = torch.stack([counts_SE[:, owners == q].sum(1) for q in range(ep.world)], dim=1)  # [S, S]
        if mine is not None:
            expert_of = torch.tensor(mine.unique, dtype=torch.int64).repeat_interleave(
                torch.tensor(mine.counts, dtype=torch.int64))
            # by owner, stably: within an owner the pairs stay in expert order, as the owner expects them
            order = owners[expert_of].argsort(stable=True)
            index = mine.token_of[order.to(mine.token_of.device)] if mine.by_token else order
            x_send = mine.rows.index_select(0, index.to(mine.rows.device))
        else:
            x_send = torch.empty(0, self.width, dtype=dtype, device=self.device)
        send, recv = send_SQ[ep.rank].tolist(), send_SQ[:, ep.rank].tolist()
        t1 = time.perf_counter()
        x_recv = self._all_to_all(x_send, send, recv, L, "dispatch")
        t2 = time.perf_counter()
        # the received rows: source by source, this rank's experts ascending, each its count of rows
        owned = (owners == ep.rank).nonzero().squeeze(1)
        per_source_SO = counts_SE[:, owned]
        expert_recv = owned.repeat(ep.world).repeat_interleave(per_source_SO.flatten())
        forward = None
        if kind == BACKWARD:
            y_recv = self._backward(L, ref, x_recv, per_source_SO)
        else:
            self.forwards += 1
            forward = self.forwards
            if kind == FAST:
                y_recv = self._compute(inner, x_recv, expert_recv, per_source_SO)
            else:
                y_recv = self._compute_torch(inner, L, x_recv, expert_recv, per_source_SO, kind == GRAD, forward)
        t3 = time.perf_counter()
        y_back = self._all_to_all(y_recv, recv, send, L, "combine")
        t4 = time.perf_counter()
        st.exchanges += 1
        if kind == BACKWARD:
            st.backward_exchanges += 1
        else:
            st.tokens_all_ranks += int(table[:, 2].sum())
        st.pairs_computed += int(x_recv.shape[0])
        st.collective_s += (t2 - t1) + (t4 - t3)
        st.expert_s += t3 - t2
        st.combine_s += t1 - t0
        if mine is None:
            return True
        y_PI = torch.empty_like(y_back)
        y_PI[order.to(y_back.device)] = y_back
        if kind != BACKWARD:
            st.tokens += mine.T
        return y_PI, forward

    def _agree(self, table: torch.Tensor, active: torch.Tensor, mine: _Mine | None,
               kind: int) -> tuple[int, torch.dtype, int, int]:
        """The layer, dtype, kind and (backward) forward exchange of this exchange, which every rank with
        tokens must share."""
        fields = [sorted(set(table[active, i].tolist())) for i in (1, 3, 4, 5)]
        ours = None if mine is None else [mine.layer, None, kind, mine.ref]
        if any(len(f) != 1 for f in fields) or (ours is not None and any(
                o is not None and f[0] != o for f, o in zip(fields, ours, strict=True))):
            ranks = [r for r in range(self.ep.world) if bool(active[r])]
            raise RuntimeError(f"rank {self.ep.rank}: data-parallel ranks {ranks} reached different MoE layers "
                               f"{fields[0]}, activation dtypes, or forward and backward passes in one exchange "
                               f"(their passes went out of step)")
        L, code, kind, ref = (f[0] for f in fields)
        return L, DTYPES[code], kind, ref

    def _inner(self, layer: int) -> ExpertExecutor:
        """The block's own executor, which computes this rank's experts (inside its ExpertParallelExecutor)."""
        return self.blocks[layer].executor.inner

    def _compute(self, inner: ExpertExecutor, h_PI: torch.Tensor, expert_of: torch.Tensor,
                 per_source_SO: torch.Tensor):
        """Each received row's expert output, exactly as the source rank's single process computes it. The
        grouped kernel computes each row on its own, but the GEMM path (GEMM_MIN_TOKENS rows of an expert or
        more) gives bits that depend on its row count: then each source's rows run in a call of their own,
        the rows and counts that source's single process runs."""
        if h_PI.shape[0] == 0:
            return h_PI.new_zeros(0, h_PI.shape[-1])

        def run(h, e):
            # one row per pair, weight 1: the block's own executor returns each pair's output exactly (0 + 1*y),
            # on its inference kernels (received rows want no gradient); its resident table holds this rank's
            # experts only
            return inner(h, e[:, None].to(h.device), torch.ones(h.shape[0], 1, dtype=torch.float32, device=h.device))

        if int(per_source_SO.sum(0).max()) < GEMM_MIN_TOKENS:  # grouped kernel only: rows independent
            return run(h_PI, expert_of)
        self.stats.split_computes += 1
        parts, at = [], 0
        for n in per_source_SO.sum(1).tolist():  # an expert on the GEMM path: each source's rows alone
            if n:
                parts.append(run(h_PI[at : at + n], expert_of[at : at + n]))
            at += n
        return torch.cat(parts)

    def _compute_torch(self, inner: ExpertExecutor, layer: int, x_PI: torch.Tensor, expert_of: torch.Tensor, per_source_SO: torch.Tensor,
                       grad: bool, forward: int) -> torch.Tensor:
        """Each received row's expert output through the block's torch path (expert LoRA included), each
        source's rows in a call of their own: the rows and counts its single process runs, so the outputs
        are its bits. With `grad` the graph of each call is kept (under the exchange's number `forward`) for
        backward. It holds its tensors itself, outside any gradient checkpointing the source runs: a
        checkpoint would recompute them by re-running the source's layer, exchange included, on one rank
        alone, from within this rank's side of a backward exchange."""
        parts, graph, at = [], [], 0
        for s, n in enumerate(per_source_SO.sum(1).tolist()):
            if not n:
                continue
            with torch.enable_grad() if grad else torch.no_grad(), \
                    torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                x = x_PI[at : at + n].detach().requires_grad_(grad)
                ones = torch.ones(n, 1, dtype=torch.float32, device=x.device)
                # K=1, weight 1: each row is its pair's expert output exactly (0 + 1*y), as in ep._PairExchange
                # (the block's executor takes its torch path: an expert LoRA is attached, or x wants gradients)
                y = inner(x, expert_of[at : at + n][:, None].to(x.device), ones)
            parts.append(y.detach())
            if grad:
                graph.append((s, x, y))
            at += n
        if graph:
            self._graphs[forward] = (layer, graph)
        return torch.cat(parts) if parts else x_PI.new_zeros(0, x_PI.shape[-1])

    def _backward(self, layer: int, forward: int, g_PI: torch.Tensor, per_source_SO: torch.Tensor) -> torch.Tensor:
        """The input gradients of the rows forward exchange `forward` brought here, from their outputs'
        gradients `g_PI` (source by source): backward through the graphs kept for them, each source's in
        source order (expert-LoRA gradients accumulate on this rank as one process accumulates its
        micro-batches'). Graphs of later forward exchanges are dropped: gradient checkpointing's
        recomputations, which backward never comes through (it runs through the first pass's graph)."""
        kept_layer, graph = self._graphs.pop(forward, (layer, []))
        for later in [f for f in self._graphs if f > forward]:
            del self._graphs[later]
        kept = {s: (x, y) for s, x, y in graph}
        parts, at = [], 0
        for s, n in enumerate(per_source_SO.sum(1).tolist()):
            if not n:
                continue
            if kept_layer != layer or s not in kept or kept[s][0].shape[0] != n:
                raise RuntimeError(f"rank {self.ep.rank}: backward at MoE layer {layer} sent {n} rows from rank {s} "
                                   f"that forward exchange {forward} did not compute here")
            x, y = kept.pop(s)
            torch.autograd.backward(y, g_PI[at : at + n].to(y.dtype))
            parts.append(x.grad.to(g_PI.dtype))
            at += n
        return torch.cat(parts) if parts else g_PI.new_zeros(0, g_PI.shape[-1])

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

class _Dispatched(torch.autograd.Function):
    """h_TI -> this rank's pairs' expert outputs [P, I] in pair order, computed by the experts' owners (one
    exchange). Backward: the outputs' gradients to the owners, which send back their rows' input gradients
    (one exchange the other way); they are summed per token from zero in pair order, as index_select's
    backward (index_add_) sums them in one process."""

    @staticmethod
    def forward(ctx, h_TI, disp, layer, unique, counts, token_of, grad):
        mine = _Mine(layer, h_TI.shape[0], unique, counts, token_of, h_TI.detach(), True)
        y_PI, forward = disp._exchange(mine, GRAD if grad else TORCH)
        mine.rows = None  # backward sends gradients, not these
        ctx.disp, ctx.mine, ctx.forward, ctx.dtype = disp, mine, forward, h_TI.dtype
        return y_PI

    @staticmethod
    def backward(ctx, g_PI):
        m = ctx.mine
        back = _Mine(m.layer, m.T, m.unique, m.counts, m.token_of, g_PI.contiguous(), False, ref=ctx.forward)
        dx_PI, _ = ctx.disp._exchange(back, BACKWARD)
        dh_TI = dx_PI.new_zeros(m.T, dx_PI.shape[-1]).index_add_(0, m.token_of.to(dx_PI.device), dx_PI)
        return dh_TI.to(ctx.dtype), None, None, None, None, None, None
