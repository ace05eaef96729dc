"""The engine thread: the one owner of the Scheduler. It takes requests and aborts from the server's event
loop, steps the scheduler while anything waits or runs, and hands each step's tokens to the requests'
asyncio queues (one call into the event loop per step).

Tokenizer-free: the scheduler's Request in, its TokenEvents (with log-probabilities when asked) out. Admission
control lives here too: at most max_batch running plus max_queue waiting, beyond that `QueueFull`; and what
must not meet a forward (served adapters added or removed: server/runtime_lora.py) runs here between steps
(`call`), with the count of requests in flight per adapter slot to say when one is in use. Entry point:
`EngineLoop`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass

from moeswap.engine.scheduler import EngineConfig, Request, Scheduler, TokenEvent

log = logging.getLogger("moeswap.server")


class QueueFull(Exception):
    """Every slot runs and the queue is full: the client should come back later (HTTP 429)."""


@dataclass
class _Live:
    handle: Handle
    req: Request
    t_arrival: float
    t_first: float | None = None
    t_last: float | None = None
    tokens: int = 0


class Handle:
    """A submitted request as its HTTP handler sees it: an id and the batches of tokens the engine gives it."""

    def __init__(self, rid: int, loop: asyncio.AbstractEventLoop) -> None:
        self.id = rid
        self.loop = loop
        self.queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.done = False  # set on the event loop when the last token has been taken

    async def batches(self):
        """Lists of TokenEvent, each what arrived since the previous one; the last one ends with a finish reason."""
        while not self.done:
            batch = [await self.queue.get()]
            while not self.queue.empty():
                batch.append(self.queue.get_nowait())
            self.done = batch[-1].finish_reason is not None
            yield batch


class EngineLoop:
    def __init__(self, model, config: EngineConfig, max_queue: int, metrics=None, *, scheduler=Scheduler) -> None:
        self.model, self.config, self.max_queue, self.metrics = model, config, max_queue, metrics
        self._new_scheduler = scheduler  # (model, config) -> a Scheduler
        self.sched = scheduler(model, config)
        self._inbox: queue.Queue = queue.Queue()
        self._live: dict[int, _Live] = {}  # engine thread only
        self._lock = threading.Lock()
        self._in_flight = 0  # accepted and not yet ended (under _lock)
        self._by_adapter: dict[int, int] = {}  # the same per LoRA adapter slot (Request.adapter; 0 not counted)
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    # -- event-loop side --------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.config.max_batch + self.max_queue

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def running(self) -> int:
        return len(self.sched.live)

    @property
    def waiting(self) -> int:
        return max(0, self._in_flight - self.running)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def in_flight_with(self, adapter: int) -> int:
        """Requests accepted with LoRA adapter slot `adapter` and not yet ended."""
        with self._lock:
            return self._by_adapter.get(adapter, 0)

    async def call(self, fn):
        """From the event loop: fn() run on the engine thread between two steps, where no forward runs (what
        changes the model: served adapters added or removed); its result, or the exception it raised."""
        if not self.alive:
            raise RuntimeError("the engine thread is not running")
        future = asyncio.get_running_loop().create_future()
        self._inbox.put(("call", fn, future))
        return await future

    def submit(self, req: Request) -> Handle:
        """From the event loop: accept `req` (QueueFull when max_batch + max_queue requests are in flight); the
        engine runs it under the handle's id."""
        with self._lock:
            if self._in_flight >= self.capacity:
                raise QueueFull(f"{self._in_flight} requests are running or waiting (--max-batch "
                                f"{self.config.max_batch} + --max-queue {self.max_queue}); retry later")
            self._in_flight += 1
            if req.adapter:
                self._by_adapter[req.adapter] = self._by_adapter.get(req.adapter, 0) + 1
        handle = Handle(next(self._ids), asyncio.get_running_loop())
        self._inbox.put(("submit", handle, req, time.perf_counter()))
        return handle

    def abort(self, handle: Handle) -> None:
        """End a request whose client left or has what it wants (a stop string); its sequence is freed at the
        next step."""
        if not handle.done:
            self._inbox.put(("abort", handle.id))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="moeswap-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._inbox.put(("stop",))
            self._thread.join()
            self._thread = None

    # -- engine thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                cmd = self._inbox.get(block=not self.sched.busy)
            except queue.Empty:
                cmd = None
            while cmd is not None:
                if cmd[0] == "stop":
                    self._end_all("abort", None)
                    return
                self._command(cmd)
                try:
                    cmd = self._inbox.get_nowait()
                except queue.Empty:
                    cmd = None
            if self.sched.busy:
                self._step()

    def _command(self, cmd: tuple) -> None:
        if cmd[0] == "submit":
            _, handle, req, t_arrival = cmd
            req = dataclasses.replace(req, id=handle.id)
            try:
                self.sched.submit(req)
            except ValueError as e:  # the server checked what it could; the engine has the last word
                self._send([(handle, [TokenEvent(handle.id, None, "error", error=str(e))])])
                self._ended(req.adapter)
                return
            self._live[handle.id] = _Live(handle, req, t_arrival)
        elif cmd[0] == "abort" and cmd[1] in self._live:
            self.sched.abort(cmd[1])  # its last event comes with the next step
        elif cmd[0] == "call":
            _, fn, future = cmd
            try:
                result, error = fn(), None
            except Exception as e:  # noqa: BLE001 - the caller hears it; the engine goes on
                result, error = None, e
            try:
                future.get_loop().call_soon_threadsafe(_settle, future, result, error)
            except RuntimeError:  # that event loop has closed (shutdown): nobody is listening
                pass

    def _step(self) -> None:
        try:
            events = self.sched.step()
        except Exception as e:  # noqa: BLE001 - the server must outlive a failed step; every request hears why
            log.exception("engine step failed")
            self.sched = self._new_scheduler(self.model, self.config)  # the old one's state may be half-updated
            self._end_all("error", f"the engine failed: {type(e).__name__}: {e}")
            return
        now = time.perf_counter()
        out: dict[int, tuple[Handle, list[TokenEvent]]] = {}
        for ev in events:
            live = self._live.get(ev.id)
            if live is None:
                continue
            if ev.token is not None:
                if live.t_first is None:
                    live.t_first = now
                    if self.metrics:
                        self.metrics.prompt_tokens.inc(len(live.req.prompt))
                live.t_last, live.tokens = now, live.tokens + 1
                if self.metrics:
                    self.metrics.generation_tokens.inc()
            if ev.finish_reason is not None:
                self.sched.finished.pop(ev.id, None)  # the event says all the server needs
                self._finish(live, now)
            out.setdefault(ev.id, (live.handle, []))[1].append(ev)
        self._send(list(out.values()))

    def _finish(self, live: _Live, now: float) -> None:
        rid = live.handle.id
        self._live.pop(rid)
        self._ended(live.req.adapter)
        if self.metrics:
            self.metrics.latency(ttft=None if live.t_first is None else live.t_first - live.t_arrival,
                                  tpot=(live.t_last - live.t_first) / (live.tokens - 1) if live.tokens > 1 else None,
                                  e2e=now - live.t_arrival)

    def _end_all(self, reason: str, error: str | None) -> None:
        now = time.perf_counter()
        ended = list(self._live.values())
        for live in ended:
            self._finish(live, now)
        self._send([(live.handle, [TokenEvent(live.handle.id, None, reason, error=error)]) for live in ended])

    def _ended(self, adapter: int) -> None:
        with self._lock:
            self._in_flight -= 1
            if adapter:
                self._by_adapter[adapter] -= 1

    @staticmethod
    def _send(deliveries: list[tuple[Handle, list[TokenEvent]]]) -> None:
        """One wake-up of each event loop per step, however many requests it serves."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for handle, items in deliveries:
            by_loop.setdefault(handle.loop, []).append((handle.queue, items))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # that event loop has closed (shutdown): nobody is listening
                pass


def _settle(future: asyncio.Future, result, error: Exception | None) -> None:
    if not future.done():  # its awaiting handler may have been cancelled (the client left)
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)


def _put_all(batch: list[tuple[asyncio.Queue, list[TokenEvent]]]) -> None:
    for q, items in batch:
        for item in items:
            q.put_nowait(item)
