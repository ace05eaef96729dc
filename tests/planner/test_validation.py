"""The documented validation: predictions vs published figures (acceptance: decode within 30 %)."""

import math

import pytest

from moeswap.planner import validation


@pytest.fixture(scope="module")
def rows():
    return validation.run()


def test_every_published_figure_is_predicted(rows):
    assert len(rows) == 18
    assert all(math.isfinite(r.predicted) and r.predicted > 0 for r in rows)


def test_sglang_decode_figures_within_30_percent(rows):
    decode = [r for r in rows if r.kind == "decode" and r.case.startswith("SGLang")]
    assert len(decode) == 3
    assert all(abs(r.error) <= 0.30 for r in decode), [(r.metric, round(r.error, 3)) for r in decode]


def test_gb200_prefill_layout_order(rows):
    gb = {r.case.rsplit(", ", 1)[1]: r.predicted for r in rows if "GB200" in r.case}
    # published order: PP16 > PP8xTP2 > TEP16 > TP16; the planner must at least put TP16 last of the PP ones
    assert min(gb["PP16×TP1"], gb["PP8×TP2"]) > max(gb["TP16×EP16"], gb["TP16"])


def test_published_deployments_fit():
    for d in validation.deployments():
        assert d["max_concurrency"] >= 1 and d["gb_per_device"] <= d["capacity_gb"], d["deployment"]
