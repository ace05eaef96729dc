"""Cache policies: which resident expert a tier gives up when it needs room. A policy hears of accesses
(`record`) and new residents (`insert`) and names a `victim` among the unpinned; it knows nothing of bytes,
tiers or threads (the store calls it under its lock). Entry point: `make_policy(name, ...)`; POLICIES is the
registry: one subclass and one entry there reach every flag's choices, benchmark and the store.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Container, Iterable, Mapping

from moeswap.experts.keys import Key


class _Ranked:
    """Resident keys with a priority; pop_min skips pinned keys and stale heap entries.

    Each policy is a priority: the lowest resident is evicted first. The heap is updated lazily, so every
    call is O(log n) even with 80k experts resident.
    """

    def __init__(self):
        self._heap: list[tuple] = []
        self._entry: dict[Key, tuple] = {}
        self._seq = itertools.count()  # ties: first inserted goes first, and keys are never compared

    def __contains__(self, key: object) -> bool:
        return key in self._entry

    def __len__(self) -> int:
        return len(self._entry)

    def set(self, key: Key, priority) -> None:
        entry = (priority, next(self._seq), key)
        self._entry[key] = entry
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 2 * len(self._entry) + 64:  # drop stale entries now and then
            self._heap = list(self._entry.values())
            heapq.heapify(self._heap)

    def pop_min(self, pinned: Container, aside: list | None = None) -> Key | None:
        """The lowest key not in `pinned`, removed. `aside`: leave the pinned entries skipped on the way
        out of the heap, in that list, for `put_back` (a run of pops with the same pins then skips each
        pinned entry once, not once per pop)."""
        skipped, found = [] if aside is None else aside, None
        while self._heap:
            entry = heapq.heappop(self._heap)
            key = entry[2]
            if self._entry.get(key) is not entry:
                continue  # superseded by a later set()
            if key in pinned:
                skipped.append(entry)
                continue
            del self._entry[key]
            found = key
            break
        if aside is None:
            self.put_back(skipped)
        return found

    def put_back(self, entries: list[tuple]) -> None:
        """Return entries pop_min left aside to the heap (those not superseded or removed meanwhile)."""
        for entry in entries:
            if self._entry.get(entry[2]) is entry:
                heapq.heappush(self._heap, entry)

    def lowest(self, n: int, pinned: Container) -> list[Key]:
        """The n lowest keys not in `pinned`, lowest first, left where they are (what n pop_min calls would
        return)."""
        seen: list[tuple] = []
        found: list[Key] = []
        while self._heap and len(found) < n:
            entry = heapq.heappop(self._heap)
            if self._entry.get(entry[2]) is not entry:
                continue  # superseded: gone for good
            seen.append(entry)
            if entry[2] not in pinned:
                found.append(entry[2])
        for entry in seen:
            heapq.heappush(self._heap, entry)
        return found

    def discard(self, key: Key) -> None:
        """`key` is no longer resident (its heap entry goes stale)."""
        self._entry.pop(key, None)


class CachePolicy:
    """Subclasses define `_count(key)` (update what they know on an access) and `_priority(key)`.

    A policy's `create` says what it needs from the run (`online` ones need nothing but the run itself).
    """

    name = "policy"
    online = True  # usable in a live run with nothing but the run itself (no profile, no future)

    def __init__(self):
        self._resident = _Ranked()
        self._clock = 0  # demand accesses seen

    @classmethod
    def create(cls, profile: Mapping[Key, int] | None, future: Iterable[Key] | None,
               half_life: float | None) -> CachePolicy:
        """An instance for a run: `profile` (expert -> uses in a routing trace), `future` (the run's own
        accesses) and `half_life` (a default memory sized to the tier) are offered; take what you need."""
        return cls()

    def record(self, key: Key) -> None:
        """A demand access to `key`, resident or being loaded."""
        self._clock += 1
        self._count(key)
        if key in self._resident:
            self._resident.set(key, self._priority(key))

    def insert(self, key: Key) -> None:
        """`key` became resident (after a demand miss, or by prefetch before any demand)."""
        self._resident.set(key, self._priority(key))

    def victim(self, pinned: Container = (), aside: list | None = None) -> Key | None:
        """Remove and return the resident to evict, never one in `pinned`; None if there is none.
        `aside` (a list): keep the pinned residents passed over out of the running until `put_back(aside)`,
        for several evictions in a row with the same pins (ExpertStore.start_background_many); the victims
        are the same as without it."""
        return self._resident.pop_min(pinned, aside)

    def put_back(self, aside: list) -> None:
        """Ends a run of `victim(pinned, aside)` calls."""
        self._resident.put_back(aside)
        aside.clear()

    def coldest(self, n: int, pinned: Container = ()) -> list[Key]:
        """The next n victims, in order, if nothing were accessed meanwhile; none is removed (the native decode
        step evicts from these itself and the store then `discard`s those it took)."""
        return self._resident.lowest(n, pinned)

    def discard(self, key: Key) -> None:
        """`key` left the tier without being chosen by `victim` here."""
        self._resident.discard(key)

    def _count(self, key: Key) -> None:
        raise NotImplementedError

    def _priority(self, key: Key):
        raise NotImplementedError


class LRU(CachePolicy):
    """Least recently used. An expert prefetched but not yet used counts as the oldest."""

    name = "lru"

    def __init__(self):
        super().__init__()
        self._last: dict[Key, int] = {}

    def _count(self, key):
        self._last[key] = self._clock

    def _priority(self, key):
        return self._last.get(key, 0)


class LFU(CachePolicy):
    """Least frequently used since the start of the run (ties: least recently used)."""

    name = "lfu"

    def __init__(self):
        super().__init__()
        self._uses: dict[Key, tuple[int, int]] = {}  # key -> (count, last access)

    def _count(self, key):
        self._uses[key] = (self._uses.get(key, (0, 0))[0] + 1, self._clock)

    def _priority(self, key):
        return self._uses.get(key, (0, 0))


class LFRU(CachePolicy):
    """Frequency with decay: each use adds 1 to a score that halves every `half_life` accesses; evict the
    lowest score. Frequent experts stay, but an expert the text stopped using ages out. The score is kept
    as log2(score) + t / half_life, which orders keys the same at every t, so nothing is rescored."""

    name = "lfru"

    def __init__(self, half_life: float = 4096):
        super().__init__()
        if not half_life > 0:
            raise ValueError(f"LFRU half_life must be > 0 accesses, got {half_life}")
        self.half_life = half_life
        self._level: dict[Key, float] = {}

    @classmethod
    def create(cls, profile, future, half_life):
        return cls() if half_life is None else cls(half_life)

    def _count(self, key):
        now, old = self._clock / self.half_life, self._level.get(key, -math.inf)
        hi, lo = max(now, old), min(now, old)
        self._level[key] = hi + math.log2(1.0 + 2.0 ** (lo - hi))  # log2(2^old + 2^now)

    def _priority(self, key):
        return self._level.get(key, -math.inf)


def lfru_half_life(slots: int) -> float:
    """LFRU's default memory, in accesses: a few turnovers of a fast tier holding `slots` experts."""
    return max(1024, 32 * slots)


class StaticHot(CachePolicy):
    """Keeps the experts a profile (a routing trace of similar prompts) used most: evicts the resident with
    the lowest profile count, least recently used first, so unprofiled experts pass through a few slots."""

    name = "static"
    online = False

    @classmethod
    def create(cls, profile, future, half_life):
        if not profile:
            raise ValueError("expert policy 'static' needs a profile: pass --expert-profile TRACE "
                             "(record one with `moeswap trace MODEL --prompts FILE -o TRACE`)")
        return cls(profile)

    def __init__(self, profile: Mapping[Key, int]):
        super().__init__()
        self._profile = {Key(*k): int(v) for k, v in profile.items()}
        self._last: dict[Key, int] = {}

    def _count(self, key):
        self._last[key] = self._clock

    def _priority(self, key):
        return (self._profile.get(key, 0), self._last.get(key, 0))


class Belady(CachePolicy):
    """The offline optimum (MIN): evict the expert whose next use is farthest away. It needs the run's
    whole future access sequence (a trace of the same run), so it only serves as a bound in benchmarks."""

    name = "belady"
    online = False

    @classmethod
    def create(cls, profile, future, half_life):
        if future is None:
            raise ValueError("expert policy 'belady' needs the run's future accesses (a trace of the same run); "
                             "it is meant for benchmarks")
        return cls(future)

    def __init__(self, future: Iterable[Key]):
        super().__init__()
        self._uses: dict[Key, deque[int]] = {}
        for t, key in enumerate(future, start=1):  # access t is the t-th record() call
            self._uses.setdefault(Key(*key), deque()).append(t)

    def _count(self, key):
        uses = self._uses.get(key)
        while uses and uses[0] <= self._clock:  # this access, and any the run skipped
            uses.popleft()

    def _priority(self, key):
        uses = self._uses.get(key)
        if uses:
            while uses and uses[0] <= self._clock:
                uses.popleft()
        return -uses[0] if uses else -math.inf


POLICIES: dict[str, type[CachePolicy]] = {p.name: p for p in (LRU, LFU, LFRU, StaticHot, Belady)}


def online_policies() -> tuple[str, ...]:
    """The registered policies a live run can use with nothing but itself."""
    return tuple(name for name, cls in POLICIES.items() if cls.online)


def make_policy(name: str, profile: Mapping[Key, int] | None = None, future: Iterable[Key] | None = None,
                half_life: float | None = None) -> CachePolicy:
    if name not in POLICIES:
        raise ValueError(f"expert policy {name!r}: expected one of {', '.join(POLICIES)}")
    return POLICIES[name].create(profile, future, half_life)
