"""The commands' side of expert parallelism: the flags (`--ep-placement`, `--ep-timeout`), joining the
torchrun job when the process was started by one, and handing rank 0's inputs (token ids, stop ids, seed)
to the other ranks, which follow without a tokenizer or output of their own.

Entry points: `add_ep_flags(parser)`, `join_if_launched(model, args)`, `from_lead(ep, encode, seed)`, `lead(ep)`,
`data_parallel_map(ep, n, run)` (items split over the ranks, every result back on every rank).
"""

from __future__ import annotations

import secrets
import sys

DEFAULT_TIMEOUT_S = 120.0  # a collective that waits longer fails (a hung or lost peer)
# how ranks share the work (docs/distributed.md): each rank its own sequences or micro-batches, tokens
# dispatched to the experts' owners; or every rank the same tokens, expert outputs exchanged
EP_MODES = ("data-parallel", "replicated")


def add_ep_flags(parser, mode: str | None = None) -> None:
    """The expert-parallel flags; with `mode`, also --ep-mode with that default (serve)."""
    g = parser.add_argument_group("expert parallelism (under torchrun; docs/distributed.md)")
    if mode is not None:
        g.add_argument("--ep-mode", choices=EP_MODES, default=mode,
                       help="data-parallel: each request on one rank, its tokens dispatched to the experts' owners; "
                            f"replicated: every request on every rank (default {mode})")
    g.add_argument("--ep-placement", default=None, metavar="TRACE",
                   help="routing trace (moeswap trace) to place experts over ranks balanced by use "
                        "(default: contiguous ranges)")
    g.add_argument("--ep-timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                   help=f"a collective that waits longer fails, naming the lost rank (default {DEFAULT_TIMEOUT_S:g})")


def join_if_launched(model, args, data_parallel: bool = False):
    """The ExpertParallel of this rank when started by torchrun with WORLD_SIZE > 1, else None.
    data_parallel (or args.ep_mode data-parallel): each rank runs its own sequences, tokens dispatched to the
    experts' owners."""
    from moeswap.distributed.runtime import init_expert_parallel, launched
    from moeswap.options import LoadOptions

    if not launched():
        return None
    if args.ep_timeout <= 0:
        raise ValueError(f"--ep-timeout must be > 0 seconds, got {args.ep_timeout}")
    data_parallel = data_parallel or getattr(args, "ep_mode", None) == "data-parallel"
    return init_expert_parallel(model, args.model, LoadOptions.from_args(args), args.ep_placement, args.ep_timeout,
                                data_parallel)


def lead(ep) -> bool:
    """Whether this process owns the tokenizer and the output (single process, or rank 0)."""
    return ep is None or ep.rank == 0


def finish(ep) -> bool:
    """After a command's work: the process group shut down (under torchrun); whether this process reports."""
    if ep is None:
        return True
    from moeswap.distributed.runtime import shutdown

    shutdown(ep)
    return lead(ep)


def from_lead(ep, encode, seed: int | None):
    """(tokenizer or None, ids, stop ids, seed): `encode()` -> (tokenizer, ids, stop ids) runs on rank 0
    only (or in the single process), and the other ranks get its ids and stop ids, or the user error it
    raised, so that every rank fails alike instead of waiting for it. A missing seed becomes one rank 0
    draws, so that sampling draws the same tokens on every rank."""
    if ep is None:
        return (*encode(), seed)
    import torch.distributed as dist

    box: list = [None]
    tok = None
    if ep.rank == 0:
        try:
            tok, ids, stop = encode()
            box = [(ids, stop, secrets.randbits(63) if seed is None else seed, None)]
        except (ValueError, OSError) as err:
            box = [(None, None, None, err)]
    dist.broadcast_object_list(box, src=0, group=ep.group)
    ids, stop, seed, err = box[0]
    if err is not None:
        # every rank says it before any ends: torchrun stops the others as soon as one exits, which could
        # end a rank before its line was out (the CLI then does not print it again)
        print(f"moeswap: error: {err}", file=sys.stderr, flush=True)
        err.reported = True
        dist.barrier(group=ep.group)
        raise err
    return tok, ids, stop, seed


def bind_local_device(args) -> None:
    """Under torchrun with --device cuda (no index): each rank takes cuda:LOCAL_RANK, as NCCL needs one
    device per rank. Changes nothing otherwise."""
    import os

    from moeswap.distributed.runtime import launched

    if launched() and getattr(args, "device", "cpu") == "cuda":
        args.device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"


def data_parallel_map(ep, n: int, run) -> list:
    """[run(i) for i in range(n)], item i on rank i % world under data-parallel expert parallelism (every
    item here when `ep` is None); every rank gets the whole list, in item order. A rank whose items are done
    (or that has none) keeps answering the others' expert exchanges until all are (TokenDispatch.finish).
    A user error (ValueError, OSError) in one item stops that rank's items and is raised on every rank,
    after the others finish theirs."""
    if ep is None:
        return [run(i) for i in range(n)]
    import torch.distributed as dist

    mine: dict = {}
    err = None
    for i in range(ep.rank, n, ep.world):
        try:
            mine[i] = run(i)
        except (ValueError, OSError) as e:  # a forward that stopped part-way leaves the others in step:
            err = (i, e)  # they meet at the same layers, and this rank answers them with no tokens
            break
    ep.dispatch.finish()
    everyone: list = [None] * ep.world
    dist.all_gather_object(everyone, (mine, err), group=ep.group)
    errors = sorted((e for _, e in everyone if e is not None), key=lambda x: x[0])
    if errors:
        raise errors[0][1]
    merged = {i: r for m, _ in everyone for i, r in m.items()}
    return [merged[i] for i in range(n)]
