"""The protocol of a caller that loads experts by itself, a mixin of ExpertStore (on the store's lock, tiers
and books: experts/store.py): the native decode step (engine/native_step.py, experts/incall.py) asks `offer`
for the fast tier's free bytes and victims, evicts and reads within its own call, and books what it did with
`table_step` and `in_call_counts`, so that the tiers, mirror tables and books end as a fetch of that step
would leave them.
"""

from __future__ import annotations

from collections.abc import Sequence

from moeswap.experts.keys import Key


class InCallLoads:
    """ExpertStore's methods for a caller that evicts and loads by itself."""

    def offer(self, n: int) -> tuple[int, list[Key]]:
        """For a caller that evicts and loads by itself: the fast tier's free bytes (what no load has
        promised) and its policy's next n victims in order, hinted experts left out; nothing changes."""
        with self._lock:
            hinted = set().union(*(h[2] for h in self._hints.values())) if self._hints else ()
            free = self.fast.capacity - self.fast.used - self._reserved[0]
            return free, self.policies[0].coldest(n, hinted)

    def in_call_counts(self, read_s: float, predicted: int, actual: int, correct: int) -> None:
        """What a caller that loads by itself (`offer`, `table_step`) counted: seconds it spent reading, and its
        guesses of the next layer's experts (prefetch precision and recall, as the store scores its hints)."""
        with self._lock:
            self.stats.stall_s += read_s
            self.stats.load_s += read_s
            self.stats.disk_io.add_busy(read_s)
            p = self.stats.prefetch
            p.predicted, p.actual, p.correct = p.predicted + predicted, p.actual + actual, p.correct + correct

    def table_step(self, layer: int, expert_ids: Sequence[int] | None, loads: dict, evicted: Sequence[Key] = ()
                   ) -> None:
        """The books of a layer step that a caller ran from `layer`'s mirror table after loading what it lacked
        itself (`offer`): loads {expert: (victims evicted for it, in order; its weights; its mirror table row,
        as the caller wrote it; whether it was read ahead, before the step asked)}, weights None for one read for
        this step only (a fast tier of capacity 0). The same books as this step's fetch: hits, misses,
        evictions, the policy's, in the fetch's order (ascending ids); an expert read ahead is a prefetched
        expert: a hit if the step used it, else loaded and unused. expert_ids None: only store the loads (the
        caller stopped there and will fetch the step); `evicted`: victims it evicted for loads that failed."""
        ids = sorted(loads) if expert_ids is None else [int(e) for e in expert_ids]
        with self._lock:
            for victim in evicted:
                self.policies[0].discard(victim)
                self._evict(0, victim)
            if expert_ids is not None:
                self._begin_step(layer, ids, [Key(layer, e) for e in ids])
                self._pending = set()
                if self.hybrid is not None and loads:  # as its fetch counts a step it sends to the fast tier
                    self.stats.hybrid.fetch_steps += 1
            for e in ids:
                got = loads.get(e)
                if got is None:
                    self._hit(Key(layer, e))
                    continue
                ahead = self._stored(layer, e, *got)
                if expert_ids is None:  # (the step's fetch books it)
                    continue
                if ahead:
                    self._hit(Key(layer, e))  # (read ahead and used: a prefetch hit)
                else:
                    self.stats.fast.misses += 1
                    self.policies[0].record(Key(layer, e))
            for e in sorted(loads.keys() - set(ids)):  # read ahead and not used by the step
                self._stored(layer, e, *loads[e])

    def _stored(self, layer: int, e: int, victims: Sequence[Key], w, row, ahead: bool) -> bool:
        """Under the lock: the books of a caller's load of expert e (`table_step`): its victims evicted, it put in
        the fast tier and `layer`'s mirror (unless w is None: read for one step), the disk's counts; returns
        whether it was read ahead (a prefetch: counted loaded, and used where the step asked for it)."""
        key, policy = Key(layer, e), self.policies[0]
        for victim in victims:  # (the caller chose them among `offer`'s, in its order)
            policy.discard(victim)
            self._evict(0, victim, w)
        self.stats.disk_reads += 1
        self.stats.disk_bytes += self.source.stored_bytes(key)
        if w is None:  # read for this step only: the fast tier keeps nothing
            return False
        self.fast.put(key, w)
        policy.insert(key)
        for mirror in self._mirrors.get(layer, ()):
            mirror.loaded(e, w, row)
        self.stats.fast.bytes_in += self.fast.cost(key)
        if ahead:
            self.stats.prefetch.loaded += 1
            self._unused.add(key)  # (_hit counts it used)
        return ahead
