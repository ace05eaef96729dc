"""Expert parallelism applied from outside the model: each MoE block's executor is wrapped
(ExpertParallelExecutor) so that the block computes only the routed experts its rank owns
(distributed/placement.py) and the ranks exchange the results; every rank ends the block with a single
process's output, bit for bit (`combine_in_order` sums in that process's order; under autograd `_PairExchange`).
Knows nothing of launching or rendezvous (distributed/runtime.py). Entry point: `apply_expert_parallel`.
Shapes: T tokens, I expert input width, P (token, expert) pairs, K top-k.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

from moeswap.distributed.placement import Placement
from moeswap.experts.executors import ExpertExecutor, NoStoreExecutor, ParameterExecutor, ServedLoRAExecutor
from moeswap.experts.pairs import combine_pairs, pairs_by_expert

if TYPE_CHECKING:
    from moeswap.distributed.dispatch import TokenDispatch


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

    def as_dict(self) -> dict:
        per_token = self.bytes_received / self.tokens if self.tokens else None
        return {"layer_steps": self.layer_steps, "tokens_through_moe_layers": self.tokens,
                "pairs_local": self.pairs_local, "bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                "bytes_received_per_token_per_layer": per_token, "collective_s": round(self.collective_s, 6),
                "expert_s": round(self.expert_s, 6), "combine_s": round(self.combine_s, 6)}


class ExpertParallel:
    """One rank's part of expert parallelism over `group` (None: the default group). Every rank runs the same
    tokens through the replicated parts (embeddings, attention, dense MLPs, shared experts, routers, latent
    projections), so routing is the same on every rank and each knows the others' shares without asking; a
    rank computes its (token, expert) pairs through the block's own executor and sends those outputs to every
    other rank (all_to_all_single with uneven splits: nothing to itself)."""

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
        # set by runtime.init_expert_parallel: () -> a sentence naming the lost rank(s), and the heartbeat
        self.diagnose: Callable[[], str] | None = None
        self.heartbeat = None
        self.channel = None  # serve: rank 0's commands to the others (lockstep.py)
        self.dispatch: TokenDispatch | None = None  # data-parallel attention: each rank's own tokens dispatched

    def owns(self, layer: int, expert: int) -> bool:
        return self.placement.owner(layer, expert) == self.rank

    def run_experts(self, executor: ExpertParallelExecutor, h_TI: torch.Tensor, ids_TK: torch.Tensor,
                    w_TK: torch.Tensor) -> torch.Tensor:
        """A block's routed experts with every rank on the same tokens: this rank's pairs through the block's
        own executor, the others' by the exchange."""
        inner, L = executor.inner, executor.layer
        if inner.in_torch(h_TI, w_TK):
            return self._run_experts_autograd(executor, h_TI, ids_TK, w_TK)
        T, I = h_TI.shape[0], h_TI.shape[-1]
        st = self.stats
        t0 = time.perf_counter()
        unique, counts, token_of, weights = pairs_by_expert(ids_TK, w_TK)
        expert_of, sel, n = self._split(L, unique, counts)  # routing bookkeeping on the CPU
        token_of = token_of.to(h_TI.device)
        mine = sel[self.rank]
        if n[self.rank]:
            # one row per pair, weight 1: the block's own executor returns each pair's expert output exactly
            # (0 + 1*y), computed by the same kernels on the same rows as in a single process (its resident
            # table holds only this rank's experts: the store loads no others)
            h_PI = h_TI.index_select(0, token_of[mine.to(h_TI.device)])
            ones = torch.ones(n[self.rank], 1, dtype=w_TK.dtype, device=w_TK.device)
            y_mine = inner(h_PI, expert_of[mine][:, None].to(ids_TK.device), ones)
        else:
            y_mine = h_TI.new_zeros(0, I)
        t1 = time.perf_counter()
        y_PI = self.exchange(L, y_mine, sel, n, token_of.numel())
        t2 = time.perf_counter()
        out_TI = combine_in_order(y_PI, token_of, weights.to(h_TI.device), T, ids_TK.shape[1])
        t3 = time.perf_counter()
        st.layer_steps += 1
        st.tokens += T
        st.pairs_local += n[self.rank]
        st.expert_s += t1 - t0
        st.collective_s += t2 - t1
        st.combine_s += t3 - t2
        return out_TI.to(h_TI.dtype)

    def _split(self, layer: int, ids: list[int], counts: list[int]):
        """(expert of each pair [P], each rank's pair indices in pair order, each rank's pair count)."""
        expert_of = torch.tensor(ids, dtype=torch.int64).repeat_interleave(torch.tensor(counts, dtype=torch.int64))
        owner_P = self.owners[layer][expert_of]
        sel = [(owner_P == q).nonzero().squeeze(1) for q in range(self.world)]
        return expert_of, sel, [int(x.numel()) for x in sel]

    def exchange(self, layer: int, mine_PI: torch.Tensor, sel: list[torch.Tensor], n: list[int],
                 P: int) -> torch.Tensor:
        """Every pair's rows [P, I] in pair order on every rank, from each owner's rows of its pairs
        (all_to_all_single: this rank's rows to every other rank, theirs back)."""
        I = mine_PI.shape[-1]
        all_PI = mine_PI.new_empty(P, I)
        all_PI[sel[self.rank].to(all_PI.device)] = mine_PI
        if self.world == 1:
            return all_PI
        others = [q for q in range(self.world) if q != self.rank]
        send = [0 if q == self.rank else n[self.rank] for q in range(self.world)]
        recv = [0 if q == self.rank else n[q] for q in range(self.world)]
        inp = torch.cat([mine_PI] * len(others)).contiguous()
        out = mine_PI.new_empty(sum(recv), I)
        self.entered += 1
        try:
            dist.all_to_all_single(out, inp, recv, send, group=self.group)
        except Exception as err:  # gloo/NCCL raise RuntimeError subclasses whose names vary by version
            raise self._lost(layer, err) from None
        at = 0
        for q in others:
            all_PI[sel[q].to(all_PI.device)] = out[at : at + n[q]]
            at += n[q]
        item = mine_PI.element_size()
        self.stats.bytes_sent += inp.numel() * item
        self.stats.bytes_received += out.numel() * item
        return all_PI

    def _run_experts_autograd(self, executor: ExpertParallelExecutor, h_TI: torch.Tensor, ids_TK: torch.Tensor,
                              w_TK: torch.Tensor):
        """The experts' torch path (executors.TorchExecutor) under expert parallelism, the same ops in the same
        order: each owner runs its pairs through the block's own executor as torch ops (autograd, expert LoRA),
        the outputs are exchanged, and every rank combines them as that path does. Backward (_PairExchange)
        sends each pair's input gradient from its owner to every rank, which sums them per token as
        index_select's backward does; expert-LoRA gradients land on the owner only (`reduce_expert_lora_grads`
        gathers them)."""
        executor.check_lora()
        unique, counts, token_of, weights = pairs_by_expert(ids_TK, w_TK)
        expert_of, sel, n = self._split(executor.layer, unique, counts)
        token_of = token_of.to(h_TI.device)
        y_PI = _PairExchange.apply(h_TI, self, executor, token_of, expert_of, sel, n, torch.is_grad_enabled())
        out_TI = combine_pairs(h_TI, y_PI, weights, token_of)  # as the torch path combines
        self.stats.layer_steps += 1
        self.stats.tokens += h_TI.shape[0]
        self.stats.pairs_local += n[self.rank]
        return out_TI.to(h_TI.dtype)

    def reduce_expert_lora_grads(self, model) -> None:
        """After backward: each routed expert's LoRA gradient is on its owner and zero elsewhere; summing
        over ranks (x + 0 = x, exact) gives every rank the single process's gradients, so that replicated
        optimizers step alike. An expert LoRA split by owner (lora_shards.py, what `train` does) holds its
        own experts' rows, whose gradients are whole already: skipped."""
        for block in model.moe_blocks():
            lora = block._modules.get("expert_lora")
            if lora is None or len(lora.experts) != lora.num_experts:  # split by owner (lora_shards.py): own rows
                continue
            for p in lora.parameters():
                if p.grad is not None:
                    try:
                        dist.all_reduce(p.grad, group=self.group)
                    except Exception as err:
                        raise self._lost(block.layer_idx, err) from None

    def _lost(self, layer: int, err: BaseException) -> PeerLost:
        who = self.diagnose() if self.diagnose is not None else "another rank died, hung or left"
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        self.failed = PeerLost(f"rank {self.rank}: the expert exchange of layer {layer} failed: {who} ({first})")
        return self.failed


class _PairExchange(torch.autograd.Function):
    """h_TI -> every pair's expert output [P, I], with this rank computing its own pairs (through the block's
    torch path, in a graph of its own) and the others' arriving by the exchange. Backward: this rank's
    pairs' input gradients from that graph, exchanged, then summed per token from zero in pair order
    (what `h_TI.index_select(0, token_of)`'s backward, index_add_, does in a single process)."""

    @staticmethod
    def forward(ctx, h_TI, ep, executor, token_of, expert_of, sel, n, grad):
        mine = sel[ep.rank]
        with torch.enable_grad() if grad else torch.no_grad():
            x_PI = h_TI.detach().index_select(0, token_of[mine.to(h_TI.device)])
            if grad:
                x_PI.requires_grad_()
            ones = torch.ones(n[ep.rank], 1, dtype=torch.float32, device=h_TI.device)
            # K=1, weight 1: each row is its pair's expert output exactly (0 + 1*y), computed per expert on
            # the same rows as in one process; LoRA and autograd as there (the block's executor takes its torch
            # path: an expert LoRA is attached, or these rows want gradients)
            y_PI = executor.inner(x_PI, expert_of[mine][:, None].to(h_TI.device), ones)
        ctx.ep, ctx.layer, ctx.sel, ctx.n, ctx.T = ep, executor.layer, sel, n, h_TI.shape[0]
        ctx.x_PI, ctx.y_PI, ctx.token_of = x_PI, y_PI, token_of
        return ep.exchange(executor.layer, y_PI.detach(), sel, n, token_of.numel())

    @staticmethod
    def backward(ctx, grad_PI):
        ep, mine = ctx.ep, ctx.sel[ctx.ep.rank]
        dx_mine = torch.zeros_like(ctx.x_PI)
        if ctx.x_PI.numel():
            # the owner's part of the graph: its experts (LoRA gradients accumulate here) back to its rows
            torch.autograd.backward(ctx.y_PI, grad_PI[mine.to(grad_PI.device)].to(ctx.y_PI.dtype), inputs=None)
            dx_mine = ctx.x_PI.grad
        dx_all = ep.exchange(ctx.layer, dx_mine.contiguous(), ctx.sel, ctx.n, ctx.token_of.numel())
        dh_TI = dx_all.new_zeros(ctx.T, dx_all.shape[-1]).index_add_(0, ctx.token_of, dx_all)
        ctx.x_PI = ctx.y_PI = None
        return dh_TI, None, None, None, None, None, None, None


class ExpertParallelExecutor(ExpertExecutor):
    """A MoE block's executor under expert parallelism: the block's own choice (`inner`) computes this rank's
    pairs, and the exchange brings the others' (ExpertParallel.run_experts: every rank on the same tokens;
    with data-parallel attention TokenDispatch.run_experts, distributed/dispatch.py). The native decode step
    and K3's fused latent call would run every expert from the resident table: this executor offers neither.
    Set by apply_expert_parallel through MoE.wrap_executor, so a later choice (LoRA attached) is wrapped too."""

    def __init__(self, block, inner: ExpertExecutor, ep: ExpertParallel):
        self.inner, self.ep, self.layer = inner, ep, block.layer_idx
        self.lora = block._modules.get("expert_lora")
        dispatch = ep.dispatch
        self.run = ep.run_experts if dispatch is None else dispatch.run_experts
        self.name = f"{'expert-parallel' if dispatch is None else 'token-dispatch'}({inner.name})"
        self.refusal: tuple[type[Exception], str] | None = None
        if isinstance(inner, NoStoreExecutor):
            self.refusal = RuntimeError, f"layer {self.layer}: MoE block has no expert store attached"
        elif isinstance(inner, ServedLoRAExecutor):
            self.refusal = NotImplementedError, (f"layer {self.layer}: served expert LoRA (serve --lora) is not "
                                                 f"supported under expert parallelism yet")
        elif isinstance(inner, ParameterExecutor):
            self.refusal = NotImplementedError, (f"layer {self.layer}: routed experts trained as parameters are "
                                                 f"not split by expert parallelism yet")

    def __call__(self, h_TI: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
        if self.refusal is not None:
            raise self.refusal[0](self.refusal[1])
        return self.run(self, h_TI, ids_TK, w_TK)

    def in_torch(self, h_TI, w_TK) -> bool:
        return self.inner.in_torch(h_TI, w_TK)

    def check_lora(self) -> None:
        """Refuses an expert LoRA whose gradients expert parallelism cannot split."""
        if self.lora is not None and self.lora.shared_a:
            raise NotImplementedError(f"layer {self.layer}: expert LoRA with a shared A sums every expert's "
                                      f"gradient into one tensor; not supported under expert parallelism")


def combine_in_order(y_PI: torch.Tensor, token_of: torch.Tensor, weights: torch.Tensor, T: int, K: int) -> torch.Tensor:
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


def apply_expert_parallel(model, group=None, placement: Placement | None = None,
                          data_parallel: bool = False) -> ExpertParallel:
    """Makes every MoE block of `model` compute only its rank's routed experts and exchange the rest over
    `group` (None: the default process group). The model's files and classes are untouched: each block's
    executor is wrapped (ExpertParallelExecutor, which offers no resident table: its C paths would compute
    every expert locally; the rank's own compute still uses it), and a next-layer prefetcher is limited to the
    rank's experts, so its store only ever loads experts this rank owns. data_parallel: every rank runs its
    own sequences or micro-batches and dispatches its tokens to the experts' owners (distributed/dispatch.py;
    backward too), instead of every rank running the same tokens. Returns the ExpertParallel (its `stats`)."""
    from moeswap.distributed.placement import contiguous

    if placement is None:
        placement = contiguous(model.config, dist.get_world_size(group))
    ep = ExpertParallel(group, placement)
    if data_parallel:
        from moeswap.distributed.dispatch import TokenDispatch

        ep.dispatch = TokenDispatch(ep, model)
    for block in model.moe_blocks():
        if not placement.owners[block.layer_idx]:
            raise ValueError(f"the expert placement has no owners for MoE layer {block.layer_idx}")
        block.wrap_executor(functools.partial(ExpertParallelExecutor, block, ep=ep))
    stores = {id(b.store): b.store for b in model.moe_blocks() if b.store is not None}
    for store in stores.values():
        prefetcher = getattr(store, "prefetcher", None)
        if prefetcher is not None:
            hint = prefetcher.hint
            prefetcher.hint = lambda layer, ids, hint=hint: hint(layer, [e for e in ids if ep.owns(layer, int(e))])
    model.expert_parallel = ep
    return ep
