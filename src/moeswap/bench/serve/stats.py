"""The statistics of `bench serve`: percentiles and one load level's summary (throughputs, TTFT / TPOT /
ITL / E2E, the first errors) from the client's outcomes. Pure functions. Entry point: `summarize`.
"""

from __future__ import annotations

import math

from moeswap.bench.serve.client import Outcome

MAX_ERRORS = 5  # distinct error messages kept per target and load


def percentiles(xs: list[float], scale: float = 1e3) -> dict:
    """mean, p50, p90, p99 (linear interpolation between order statistics, as numpy's default), times
    `scale` (seconds -> ms); None (JSON null) for each when there are no values."""
    if not xs:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    s = sorted(xs)

    def q(p: float) -> float:
        k = (len(s) - 1) * p
        f = math.floor(k)
        c = min(f + 1, len(s) - 1)
        return (s[f] + (s[c] - s[f]) * (k - f)) * scale

    return {"mean": sum(s) / len(s) * scale, "p50": q(0.5), "p90": q(0.9), "p99": q(0.99)}


def summarize(outcomes: list[Outcome], duration_s: float) -> dict:
    done = [o for o in outcomes if o.ok]
    tokens = sum(o.output_tokens for o in done)
    errors: list[str] = []
    for o in outcomes:
        if not o.ok and o.error not in errors and len(errors) < MAX_ERRORS:
            errors.append(o.error)
    rate = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: None)
    return {"sent": len(outcomes), "completed": len(done), "failed": len(outcomes) - len(done),
            "duration_s": duration_s, "total_output_tokens": tokens,
            "total_prompt_tokens": sum(o.prompt_tokens or 0 for o in done),
            "request_throughput": rate(len(done)), "output_throughput": rate(tokens),
            "ttft_ms": percentiles([o.ttft_s for o in done]),
            "tpot_ms": percentiles([o.tpot_s for o in done if o.tpot_s is not None]),
            "itl_ms": percentiles([x for o in done for x in o.itl_s]),
            "e2e_ms": percentiles([o.e2e_s for o in done]),
            "first_errors": errors, "requests": [o.as_dict() for o in outcomes]}
