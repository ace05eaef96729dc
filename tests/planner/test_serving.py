"""Serving schedule arithmetic with hand-made step times."""

import pytest

from moeswap.planner.serving import pipeline_time, serve_point
from moeswap.planner.workload import Serve


def test_burst_wave():
    serve = Serve(isl=1000, osl=11, concurrency=(2,))
    pt = serve_point(serve, 2, 1, 4, decode_step=lambda c: 0.01 * c,
                     prefill_chunk=lambda t, r, n: (0.5, 0.5), chunk=1000)
    # request 1 first token at 0.5 s, request 2 at 1.0 s; decode starts at 1.0 s for 10 steps of 0.02 s
    assert pt.ttft == pytest.approx(0.75)
    e2e = 1.0 + 10 * 0.02
    assert pt.tpot == pytest.approx(((e2e - 0.5) + (e2e - 1.0)) / 2 / 10)
    assert pt.tok_s_device == pytest.approx(2 * 1011 / e2e / 4)
    assert pt.out_tok_s == pytest.approx(2 * 11 / e2e)


def test_dp_ranks_prefill_in_parallel():
    serve = Serve(isl=1000, osl=11, concurrency=(4,))
    seen = []

    def prefill(tokens, requests, lanes):
        seen.append((tokens, lanes))
        return 0.5, 0.5

    pt = serve_point(serve, 4, 1, 4, lambda c: 0.01, prefill, chunk=1000, lanes=2)
    assert seen == [(1000, 2)]
    assert pt.ttft == pytest.approx((0.5 + 0.5 + 1.0 + 1.0) / 4)  # two lanes, two requests each


def test_short_prompts_share_a_chunk():
    serve = Serve(isl=32, osl=2, concurrency=(8,))
    pt = serve_point(serve, 8, 1, 1, decode_step=lambda c: 0.1, prefill_chunk=lambda t, r, n: (t / 1000, t / 1000),
                     chunk=8192)
    assert pt.ttft == pytest.approx(0.256)  # one chunk of 256 tokens


def test_steady_arrivals_saturate():
    serve = Serve(isl=1000, osl=10, concurrency=(100,), arrival="steady")
    pt = serve_point(serve, 100, 1, 1, decode_step=lambda c: 0.01, prefill_chunk=lambda t, r, n: (1.0, 1.0), chunk=1000)
    assert pt.saturated
    light = serve_point(Serve(1000, 100, (1,), arrival="steady"), 1, 1, 1, lambda c: 0.01,
                        lambda t, r, n: (0.1, 0.1), 1000)
    assert not light.saturated and light.tpot > 0.01 and light.ttft >= 0.1


def test_pipeline_time():
    assert pipeline_time([1, 1, 1, 1], 1) == 4  # one micro-batch crosses every stage
    assert pipeline_time([1, 1, 1, 1], 8) == 8  # full pipeline: bound by the slowest stage
