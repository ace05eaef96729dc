"""Layout parsing, shape checks with reasons, AttnRes-aligned pipeline stages, enumeration."""

import pytest

from moeswap.planner.errors import PlanError
from moeswap.planner.layouts import Layout, check_layout, enumerate_layouts, parse_layout, stage_layers


@pytest.mark.parametrize("text,expect", [
    ("tp8", Layout(tp=8)),
    ("PP4×TP8", Layout(tp=8, pp=4)),
    ("tp16/ep16", Layout(tp=16, ep=16)),
    ("tep16", Layout(tp=16, ep=16)),
    ("r2,pp2,tp8,dcp", Layout(tp=8, pp=2, replicas=2, dcp=True)),
    ("dp4 tp2 ep8", Layout(tp=2, dp=4, ep=8)),
])
def test_parse(text, expect):
    assert parse_layout(text) == expect


@pytest.mark.parametrize("bad", ["fsdp8", "tp", "tp8 tp4", "tp0", "tp8 banana"])
def test_parse_errors(bad):
    with pytest.raises(PlanError):
        parse_layout(bad)


def test_stages_own_whole_attnres_blocks(k3):
    assert [len(s) for s in stage_layers(k3, 4)] == [24, 24, 24, 21]
    assert [len(s) for s in stage_layers(k3, 8)] == [12] * 7 + [9]
    for s in stage_layers(k3, 3):
        assert s.start % 12 == 0
    assert sum(len(s) for s in stage_layers(k3, 16, "layer")) == 93


@pytest.mark.parametrize("lay,devices,why", [
    (Layout(tp=64), 64, "TP 64 does not divide the 96 KDA heads"),
    (Layout(tp=8, dp=32, ep=256), 256, "EP 256 does not divide the 896 routed experts"),
    (Layout(pp=16), 16, "PP 16 exceeds the 8 12-layer AttnRes blocks"),
    (Layout(tp=8), 16, "uses 8 devices, not the 16"),
    (Layout(tp=1, dcp=True), 1, "needs TP > 1"),
])
def test_impossible_layouts_say_why(k3, lay, devices, why):
    assert why in check_layout(k3, lay, devices)


def test_layer_split_allows_finer_pipelines(k3):
    assert check_layout(k3, Layout(pp=16), 16, pp_split="layer") is None


def test_enumeration_uses_all_devices(k3):
    ok, rejected = enumerate_layouts(k3, 16, max_tp=8)
    assert ok and all(l.devices == 16 for l in ok)
    assert Layout(tp=8, pp=2) in ok
    assert any("scale-up domain" in why for _, why in rejected)
