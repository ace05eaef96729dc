"""Serving under expert parallelism: rank 0's scheduler (owned by the server's engine thread) and one on every
other rank, stepped in lockstep through the rendezvous store: before each step rank 0 publishes the calls
that changed its scheduler, and the others apply them and step. Knows nothing of HTTP. Entry points:
`leader_scheduler(ep)` (a factory for server.app.build_app), `follow(model, ep)`, `stop_followers(ep)`.
"""

from __future__ import annotations

import logging
import os
import pickle
import secrets
import signal
from datetime import timedelta

import torch.distributed as dist

from moeswap.distributed.ep import ExpertParallel, PeerLost
from moeswap.engine.scheduler import Scheduler

log = logging.getLogger("moeswap.server")
KEEP = 1024  # commands kept in the store behind the newest (followers are at most a step or two behind)
POLL_S = 2.0  # a follower waiting for work checks that rank 0 is alive this often


class Channel:
    """Rank 0's command lists to the other ranks, numbered, through the rendezvous store."""

    def __init__(self, ep: ExpertParallel):
        self.ep = ep
        self.store = dist.distributed_c10d._get_default_store()
        self.n = 0

    def _key(self, n: int) -> str:
        return f"moeswap/ep/serve/{n}"

    def send(self, commands: list) -> None:
        self.store.set(self._key(self.n), pickle.dumps(commands))
        if self.n >= KEEP:
            self.store.delete_key(self._key(self.n - KEEP))
        self.n += 1

    def recv(self) -> list:
        """The next command list; waits as long as rank 0 is alive (a server may idle for hours)."""
        key = self._key(self.n)
        while True:
            try:
                self.store.wait([key], timedelta(seconds=POLL_S))
                break
            except Exception as err:  # a timeout (idle), or the store is gone with rank 0
                if self.ep.diagnose is None:
                    raise
                why = self._leader_alive()
                if why is not None:
                    self.ep.failed = PeerLost(f"rank {self.ep.rank}: waiting for rank 0's next step: {why}")
                    raise self.ep.failed from err
        self.n += 1
        return pickle.loads(self.store.get(key))

    def _leader_alive(self) -> str | None:
        """None while rank 0's heartbeat runs, else why not."""
        beat = self.ep.heartbeat
        try:
            before = beat.store.add(beat._key(0), 0)
        except Exception:
            return "rank 0 is gone (it hosted the rendezvous store, which no longer answers)"
        last = getattr(self, "_beat0", None)
        self._beat0 = before
        return "rank 0 has stopped" if last is not None and last == before else None


class LeaderScheduler(Scheduler):
    """Rank 0's Scheduler: every call that changes it is also sent to the other ranks before the next step.

    Replicated mode: every rank gets every call, so every rank runs the same forward passes and meets at the
    same expert exchanges. The Scheduler is deterministic given its calls (only its statistics read the
    clock); requests that sample get a seed from rank 0.
    """

    def __init__(self, model, config, channel: Channel):
        super().__init__(model, config)
        self.channel = channel
        self._pending: list = [("reset", config)]  # a fresh scheduler (start, or after a failed step)

    def submit(self, req):
        if req.seed is None and req.sampling.temperature > 0:
            req.seed = secrets.randbits(63)  # every rank's sampler must draw the same tokens
        rid = super().submit(req)  # a request it refuses is refused here only: the others never see it
        self._pending.append(("submit", req))
        return rid

    def abort(self, request_id) -> bool:
        done = super().abort(request_id)
        if done:
            self._pending.append(("abort", request_id))
        return done

    def step(self):
        self.channel.send(self._pending + [("step",)])
        self._pending = []
        try:
            return super().step()
        except PeerLost as err:
            # the job cannot serve without its peers: stop the server (uvicorn ends on SIGTERM) and say why
            log.error("moeswap: error: %s", err)
            self.channel.ep.failed = err
            os.kill(os.getpid(), signal.SIGTERM)
            raise


class DataParallelLeader(Scheduler):
    """Rank 0's Scheduler in data-parallel mode: its own share of the requests, and the other ranks' through
    the channel; `step` returns every rank's tokens and puts their results in `finished`.

    Data-parallel mode (`ep.dispatch`, token dispatch): rank 0 gives each request to one rank (the one with
    the fewest unfinished requests, rank 0 itself included), and only that rank's scheduler gets it. Every
    step, each rank steps its own scheduler (possibly with nothing to run), then serves the others' expert
    exchanges until every rank's step is done (`TokenDispatch.finish`), and rank 0 gathers every rank's tokens
    and finished results, which it hands to the server as its own.
    """

    def __init__(self, model, config, channel: Channel):
        super().__init__(model, config)
        self.channel = channel
        self._pending: list = [("reset", config)]  # a fresh scheduler on every rank (start, or a failed step)
        self._where: dict = {}  # request id -> the other rank running it, until it finishes there
        self._load = [0] * channel.ep.world  # unfinished requests on each other rank

    def submit(self, req):
        rid = super().submit(req)  # checked here (the server hears a refusal at once), and queued here
        loads = [len(self.waiting) + len(self.live) - 1] + self._load[1:]
        rank = loads.index(min(loads))
        if rank != 0:
            self.waiting.pop()  # that rank runs it: queued there instead
            self._pending.append(("submit", rank, req))
            self._where[rid] = rank
            self._load[rank] += 1
        return rid

    def abort(self, request_id) -> bool:
        rank = self._where.get(request_id)
        if rank is None:
            return super().abort(request_id)
        self._pending.append(("abort", rank, request_id))  # its "abort" event comes with a later step
        return True

    @property
    def busy(self) -> bool:
        return super().busy or bool(self._where)

    def step(self):
        ep = self.channel.ep
        self.channel.send(self._pending + [("step",)])
        self._pending = []
        try:
            everyone, failed = data_parallel_step(ep, super().step, {})
        except PeerLost as err:  # as LeaderScheduler: the job cannot serve without its peers
            log.error("moeswap: error: %s", err)
            ep.failed = err
            os.kill(os.getpid(), signal.SIGTERM)
            raise
        if failed is not None:
            raise failed
        events = list(everyone[0][0])
        for rank, (theirs, finished, error) in enumerate(everyone[1:], start=1):
            if error is not None:  # its scheduler may be half-updated: the server starts afresh on every rank
                raise RuntimeError(f"rank {rank}'s engine step failed: {error}")
            events += theirs
            self.finished.update(finished)
            for rid in finished:
                if self._where.pop(rid, None) is not None:
                    self._load[rank] -= 1
        return events


def data_parallel_step(ep: ExpertParallel, step, finished: dict):
    """One data-parallel engine step on this rank: `step()` (its own scheduler's), then the others' expert
    exchanges served until every rank's step is done, then every rank's (tokens, finished results taken
    out of `finished`, error text or None) gathered on every rank. Returns (that list, the exception
    `step` raised or None); PeerLost is raised at once."""
    failed = None
    try:
        events = step()
    except PeerLost:
        raise
    except Exception as err:  # noqa: BLE001 - the step's error goes to rank 0, which fails the step everywhere
        failed, events = err, []
    ep.dispatch.finish()
    mine = (events, dict(finished), None if failed is None else f"{type(failed).__name__}: {failed}")
    finished.clear()
    everyone: list = [None] * ep.world
    try:
        dist.all_gather_object(everyone, mine, group=ep.group)
    except Exception as err:  # gloo/NCCL raise RuntimeError subclasses whose names vary by version
        raise ep._lost(-1, err) from None
    return everyone, failed


def leader_scheduler(ep: ExpertParallel):
    """The `scheduler(model, config)` factory for rank 0's server."""
    channel = Channel(ep)
    ep.channel = channel
    kind = LeaderScheduler if ep.dispatch is None else DataParallelLeader
    return lambda model, config: kind(model, config, channel)


def stop_followers(ep: ExpertParallel) -> None:
    """Rank 0 at shutdown: the other ranks leave their loop."""
    if ep.channel is not None and ep.failed is None:
        ep.channel.send([("stop",)])


def follow(model, ep: ExpertParallel) -> None:
    """A rank other than 0: apply rank 0's commands and step, until it stops (or is lost: PeerLost)."""
    channel = Channel(ep)
    sched = None
    dp = ep.dispatch is not None
    while True:
        for cmd in channel.recv():
            kind = cmd[0]
            if kind == "reset":
                sched = Scheduler(model, cmd[1])
            elif kind in ("submit", "abort") and dp:  # (kind, rank, request or id): that rank's only
                if cmd[1] == ep.rank:
                    sched.submit(cmd[2]) if kind == "submit" else sched.abort(cmd[2])
            elif kind == "submit":
                sched.submit(cmd[1])
            elif kind == "abort":
                sched.abort(cmd[1])
            elif kind == "step" and dp:
                _, failed = data_parallel_step(ep, sched.step, sched.finished)
                if failed is not None:
                    log.error("engine step failed (rank 0 fails the step everywhere): %s", failed)
            elif kind == "step":
                try:
                    sched.step()
                except PeerLost:
                    raise
                except Exception:  # noqa: BLE001 - rank 0's step failed alike; it resets, and so do we
                    log.exception("engine step failed (rank 0 fails the same step)")
                sched.finished.clear()  # rank 0 hands results to clients; nothing waits for them here
            elif kind == "stop":
                return
