"""Tests of the load generator's statistics: percentiles, distributions and goodput."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfleet_agent.bench.report import RequestRecord, Slo, count_good, distribution, percentile, summarize


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=-1e6, max_value=1e6, allow_nan=False), min_size=1, max_size=60),
       st.floats(min_value=0.0, max_value=100.0))
def test_percentile_equals_numpy(values: list[float], q: float) -> None:
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12, abs=1e-9)


def test_percentile_fixed_cases_and_distribution() -> None:
    xs = [15.0, 1.0, 7.0, 3.0]
    for q in (0, 25, 50, 90, 95, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    d = distribution(xs, scale=1e3)
    assert d["mean"] == pytest.approx(6.5e3)
    assert d["p50"] == pytest.approx(5e3)
    assert distribution([]) == {"mean": None, "p50": None, "p90": None, "p95": None, "p99": None}
    with pytest.raises(ValueError):
        percentile([], 50)


def _rec(i: int, status: str = "ok", ttft: float | None = 0.1, itl: list[float] | None = None,
         tokens: int = 4) -> RequestRecord:
    r = RequestRecord(i, 0.0, start=10.0, end=11.0, ttft_s=ttft, itl_s=itl if itl is not None else [0.02] * 3,
                      output_tokens=tokens, prompt_tokens=10)
    r.status = status  # type: ignore[assignment]
    return r


def test_goodput_counts_requests_within_every_given_slo() -> None:
    records = [
        _rec(0),  # good on both
        _rec(1, ttft=0.5),  # TTFT too slow
        _rec(2, itl=[0.01, 0.09]),  # mean ITL 50 ms: too slow
        _rec(3, itl=[0.001, 0.059]),  # mean ITL 30 ms: good, although one gap exceeds the SLO
        _rec(4, itl=[]),  # one chunk: no gap to miss the ITL SLO
        _rec(5, ttft=None, itl=[]),  # no text at all: misses a TTFT SLO
        _rec(6, status="failed"),
        _rec(7, status="rejected"),
    ]
    both = Slo(ttft_s=0.2, itl_s=0.04)
    assert count_good(records, both) == 3
    assert count_good(records, Slo(ttft_s=0.2)) == 4
    assert count_good(records, Slo(itl_s=0.04)) == 5
    s = summarize(records, duration_s=2.0, slo=both, stop_reason="num_requests")
    assert s["good_requests"] == 3 and s["goodput"] == pytest.approx(1.5)
    assert (s["completed"], s["failed"], s["rejected"], s["cancelled"]) == (6, 1, 1, 0)
    assert s["request_throughput"] == pytest.approx(3.0)
    assert s["total_output_tokens"] == 24 and s["output_token_throughput"] == pytest.approx(12.0)
    assert s["total_token_throughput"] == pytest.approx((24 + 60) / 2.0)
    assert summarize(records, 2.0, Slo(), "num_requests")["goodput"] is None
