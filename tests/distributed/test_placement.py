"""Expert placement and the start-up agreement check, without processes: contiguous ranges, the balanced
placement's invariants on a skewed synthetic trace, a world size that does not divide the experts, and
check_same naming the ranks that differ and in what."""

from __future__ import annotations

import pytest

from moeswap.config import load_config
from moeswap.distributed.placement import balanced, contiguous
from moeswap.distributed.runtime import check_same


class Counts:
    """The one method of experts/trace.Trace that balanced() reads."""

    def __init__(self, rows):
        self.rows = rows

    def expert_counts(self):
        return self.rows


def test_contiguous_ranges_cover_every_moe_layer(tiny_k3_dir):
    cfg = load_config(tiny_k3_dir)
    p = contiguous(cfg, 4)
    moe = [i for i, row in enumerate(p.owners) if row]
    assert moe and len(moe) < cfg.num_layers  # K3's first layer is dense
    for i in moe:
        assert list(p.owners[i]) == [e // 4 for e in range(16)]
        assert p.owned(2, i) == [8, 9, 10, 11]


def test_balanced_spreads_hot_experts_with_equal_shares(tiny_k3_dir):
    cfg = load_config(tiny_k3_dir)
    use = [100, 90, 80, 70] + [1] * 12  # four hot experts that contiguous ranges would put on rank 0
    rows = [use if row else [] for row in contiguous(cfg, 2).owners]
    p = balanced(Counts(rows), cfg, 2)
    for row in p.owners:
        if not row:
            continue
        assert sorted(row) == [0] * 8 + [1] * 8
        assert [row[e] for e in range(4)] == [0, 1, 1, 0]  # 100 -> 0, 90 -> 1, 80 -> 1 (170 > 100), 70 -> 0
        load = [sum(u for e, u in enumerate(use) if row[e] == r) for r in (0, 1)]
        assert abs(load[0] - load[1]) <= max(use)
    assert contiguous(cfg, 2).owners[1][:4] == (0, 0, 0, 0)


def test_a_world_that_does_not_divide_the_experts_is_refused(tiny_k3_dir):
    with pytest.raises(ValueError, match="world size must divide the 16 routed experts"):
        contiguous(load_config(tiny_k3_dir), 3)


def test_check_same_names_each_differing_rank_and_field():
    a = {"moeswap version": "0.1.0", "config.json": "x", "checkpoint": "c", "placement": "p"}
    check_same([a, dict(a)], ["/m", "/m"])
    b = {**a, "config.json": "y"}
    c = {**a, "moeswap version": "0.2.0", "placement": "q"}
    with pytest.raises(ValueError) as err:
        check_same([a, b, dict(a), c], ["/m0", "/m1", "/m2", "/m3"])
    msg = str(err.value)
    assert "rank 1 (/m1) differs from rank 0 (/m0) in config.json" in msg
    assert "rank 3 (/m3) differs from rank 0 (/m0) in moeswap version, placement" in msg and "rank 2" not in msg
