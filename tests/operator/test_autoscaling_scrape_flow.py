"""scrape.py for the capacity model: the token counters, KV usage and queue-time histogram an agent exports, and
MetricsWindow.flow(): requests and tokens per second through the pods, arrivals as completions plus the rise of
what the pods hold."""

from __future__ import annotations

from typing import Any, cast

import pytest

from kvfleet_contract import metrics as contract
from kvfleet_operator.autoscaling.decision import Flow
from kvfleet_operator.autoscaling.scrape import MetricsWindow, Snapshot, parse_exposition

# A hand-written agent exposition, as agent/kvfleet_agent/server/metrics.py serves it (families abridged to those
# the operator reads, plus neighbours it must leave alone: vLLM's compat view of the same counters, a _created).
EXPOSITION = """\
# HELP kvfleet_requests_waiting Requests accepted and not yet running (the queue).
# TYPE kvfleet_requests_waiting gauge
kvfleet_requests_waiting{model="m"} 3.0
# HELP kvfleet_requests_running Requests holding KV blocks and generating.
# TYPE kvfleet_requests_running gauge
kvfleet_requests_running{model="m"} 5.0
# HELP kvfleet_kv_cache_usage_ratio Fraction of KV blocks held by requests.
# TYPE kvfleet_kv_cache_usage_ratio gauge
kvfleet_kv_cache_usage_ratio{model="m"} 0.625
# HELP kvfleet_prompt_tokens_total Prompt tokens accepted.
# TYPE kvfleet_prompt_tokens_total counter
kvfleet_prompt_tokens_total{model="m"} 123456.0
# HELP kvfleet_generation_tokens_total Tokens generated.
# TYPE kvfleet_generation_tokens_total counter
kvfleet_generation_tokens_total{model="m"} 65432.0
# HELP kvfleet_preemptions_total Requests preempted for lack of KV blocks.
# TYPE kvfleet_preemptions_total counter
kvfleet_preemptions_total{model="m"} 7.0
# HELP kvfleet_requests_total Requests by outcome.
# TYPE kvfleet_requests_total counter
kvfleet_requests_total{model="m",outcome="stop"} 400.0
kvfleet_requests_total{model="m",outcome="length"} 20.0
kvfleet_requests_total{model="m",outcome="rejected_queue_full"} 3.0
# HELP kvfleet_request_queue_time_seconds Arrival to first scheduled.
# TYPE kvfleet_request_queue_time_seconds histogram
kvfleet_request_queue_time_seconds_bucket{le="0.01",model="m"} 300.0
kvfleet_request_queue_time_seconds_bucket{le="0.1",model="m"} 380.0
kvfleet_request_queue_time_seconds_bucket{le="1.0",model="m"} 415.0
kvfleet_request_queue_time_seconds_bucket{le="+Inf",model="m"} 420.0
kvfleet_request_queue_time_seconds_count{model="m"} 420.0
kvfleet_request_queue_time_seconds_sum{model="m"} 21.5
# HELP kvfleet_request_queue_time_seconds_created Arrival to first scheduled.
# TYPE kvfleet_request_queue_time_seconds_created gauge
kvfleet_request_queue_time_seconds_created{model="m"} 1.7672256e+09
# HELP vllm:prompt_tokens_total Prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 123456.0
# HELP vllm:kv_cache_usage_perc KV-cache usage; 1 means 100 percent.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.625
"""


def test_parse_reads_the_token_counters_kv_usage_and_the_queue_time_histogram() -> None:
    snap = parse_exposition(EXPOSITION, "pod-a", 100.0)
    assert (snap.waiting, snap.running, snap.requests) == (3, 5, 423)  # every outcome, refusals included
    assert (snap.prompt_tokens, snap.generation_tokens, snap.kv_usage) == (123456, 65432, 0.625)
    queue = snap.histograms["queue"]
    assert queue.bounds == (0.01, 0.1, 1.0, float("inf"))
    assert queue.buckets == (300, 380, 415, 420) and (queue.count, queue.sum) == (420, 21.5)
    # The model filter applies to them as to the gauges.
    assert parse_exposition(EXPOSITION, "pod-a", 100.0, model="m").prompt_tokens == 123456
    other = EXPOSITION.replace('model="m"', 'model="n"').replace('model="n",outcome', 'model="m",outcome')
    picked = parse_exposition(other + 'kvfleet_requests_waiting{model="m"} 0\nkvfleet_requests_running{model="m"} 0\n',
                              "pod-a", 100.0, model="m")
    assert picked.prompt_tokens == 0 and picked.kv_usage is None and "queue" not in picked.histograms


def test_an_agent_without_the_new_families_reads_as_unknown() -> None:
    new = ("kvfleet_prompt", "kvfleet_generation", "kvfleet_kv_cache", "kvfleet_request_queue", "vllm:")
    old = "\n".join(line for line in EXPOSITION.splitlines() if not any(name in line for name in new))
    snap = parse_exposition(old + "\n", "pod-a", 100.0)
    assert (snap.prompt_tokens, snap.generation_tokens, snap.kv_usage) == (None, None, None)
    assert "queue" not in snap.histograms and snap.requests == 423


class _Engine:
    """What AgentMetrics reads of an engine: its stats and the observer hook (no model, no GPU)."""

    max_model_len = 2048

    def __init__(self, stats: Any) -> None:
        self._stats = stats

    def add_observer(self, observer: object) -> None:
        pass

    def stats(self) -> Any:
        return self._stats


@pytest.mark.parametrize("compat", ["kvfleet", "vllm"])
def test_parse_reads_the_agents_own_exporter(compat: str) -> None:
    # The real exporter, on an engine stub: its family names are the contract the parser must follow.
    from kvfleet_agent.engine.async_llm import AsyncLLM
    from kvfleet_agent.engine.stats import EngineStats
    from kvfleet_agent.server.admission import Admission
    from kvfleet_agent.server.metrics import AgentMetrics

    stats = EngineStats(num_waiting=2, num_running=6, has_unfinished=True, kv_cache_usage=0.75, prompt_tokens=9000,
                        generation_tokens=4000, finished={"stop": 40, "length": 2}, num_preemptions=1,
                        prefix_cache_queries=0, prefix_cache_hits=0, last_step_time=1.0)
    engine = cast(AsyncLLM, _Engine(stats))
    admission = Admission(engine, max_queue_length=64)
    admission.rejected["queue_full"] = 3
    exporter = AgentMetrics(engine, admission, "m", compat=compat)
    for wait in (0.002, 0.02, 0.2, 2.0):
        exporter.queue.labels("m").observe(wait)
    snap = parse_exposition(exporter.exposition().decode(), "pod-a", 5.0, model="m")
    assert (snap.waiting, snap.running, snap.kv_usage) == (2, 6, 0.75)
    assert (snap.prompt_tokens, snap.generation_tokens, snap.requests) == (9000, 4000, 45)
    assert snap.histograms["queue"].count == 4
    assert snap.histograms["queue"].bounds == (*contract.QUEUE_BUCKETS, float("inf"))


def snap(pod: str, t: float, requests: float | None, held: float = 0.0, prompt: float | None = None,
         output: float | None = None) -> Snapshot:
    """`held` requests waiting + running (split 1:1 here: only the sum matters)."""
    return Snapshot(pod, t, held / 2, held / 2, {}, requests, prompt, output)


def test_flow_is_arrivals_and_tokens_per_second_over_the_window() -> None:
    w = MetricsWindow(60.0)
    w.update([snap("a", 0, 100, held=4, prompt=1000, output=500)], now=0)
    assert w.flow() is None and w.flow(last=True) is None  # one sample: nothing to compare yet
    w.update([snap("a", 15, 115, held=4, prompt=2500, output=1250)], now=15)
    w.update([snap("a", 30, 130, held=7, prompt=4000, output=2000),
              snap("b", 30, 900, held=2, prompt=70_000, output=9000)], live={"a", "b"}, now=30)
    # a over 30 s: 30 finished (1/s); it holds 3 more than at the start, so 33 arrived (1.1/s); prompt
    # 3000 / 30 = 100 tokens/s, output 1500 / 30 = 50. b has one sample (it just became ready): left out.
    assert w.flow() == Flow(1.0, 1.1, 100.0, 50.0, 1)
    # Over a's last interval only (15 s): 15 finished (1/s), 3 more held: 18 arrived (1.2/s).
    assert w.flow(last=True) == Flow(1.0, 1.2, 100.0, 50.0, 1)
    # b's second scrape covers it: 15 s, 30 finished (2/s), holding 2 fewer: 28 arrived; 750 + 300 tokens/s.
    w.update([snap("a", 45, 145, held=7, prompt=5500, output=2750),
              snap("b", 45, 930, held=0, prompt=81_250, output=13_500)], now=45)
    # Fleet totals over the longest span (a's 45 s): b had no traffic before it became ready.
    f = w.flow()
    assert f is not None and f.pods == pytest.approx((45 + 15) / 45)  # b covers a third of the span
    assert f.completed == pytest.approx((45 + 30) / 45)
    assert f.arrived == pytest.approx((45 + 3 + 28) / 45)
    assert (f.prompt_tokens, f.output_tokens) == pytest.approx(((4500 + 11_250) / 45, (2250 + 4500) / 45))
    assert f.tokens_per_request == pytest.approx((4500 + 11_250 + 2250 + 4500) / 75)
    # Tokens per replica: what the pods served over the pod-seconds they were there (a 100 + 50, b 750 + 300 a s).
    assert (f.prompt_tokens + f.output_tokens) / f.pods == pytest.approx((45 * 150 + 15 * 1050) / 60)


def test_a_new_replica_taking_the_arrivals_is_not_read_as_more_demand() -> None:
    """A steady 2 requests/s: on a alone until b becomes ready at 30 s, then on b alone (the router sends a new
    replica the arrivals). The fleet's demand stays 2/s; each pod's own rate summed read 60/45 + 30/15 = 3.3/s."""
    w = MetricsWindow(60.0)
    for t in (0, 15, 30):
        w.update([snap("a", t, 2 * t)] + ([snap("b", t, 0)] if t == 30 else []), live={"a", "b"}, now=t)
    w.update([snap("a", 45, 60), snap("b", 45, 30)], now=45)
    f = w.flow()
    assert f is not None and f.arrived == pytest.approx(2.0) and f.completed == pytest.approx(2.0)


def test_flow_restarts_counters_from_zero_and_never_reads_negative_arrivals() -> None:
    w = MetricsWindow(60.0)
    w.update([snap("a", 0, 500, held=10, prompt=50_000, output=20_000)], now=0)
    # The pod restarted: every counter from 0 (PromQL's increase() rule), so 12 finished, 1200 and 600 tokens.
    w.update([snap("a", 20, 12, held=0, prompt=1200, output=600)], now=20)
    f = w.flow()
    # It held 10 and now holds none: 12 + 0 - 10 = 2 arrived over the 20 s.
    assert f == Flow(12 / 20, 2 / 20, 60.0, 30.0, 1)
    # A backlog draining faster than anything finishes (it held 30, holds 0, 5 finished): 0 arrived, not -25.
    w2 = MetricsWindow(60.0)
    w2.update([snap("a", 0, 0, held=30, prompt=0, output=0)], now=0)
    w2.update([snap("a", 10, 5, held=0, prompt=100, output=50)], now=10)
    f2 = w2.flow()
    assert f2 is not None and (f2.completed, f2.arrived) == (0.5, 0.0)


def test_flow_needs_the_request_counter_and_tolerates_missing_token_counters() -> None:
    w = MetricsWindow(60.0)
    w.update([snap("a", 0, 10, prompt=100, output=50), snap("b", 0, None)], now=0)
    w.update([snap("a", 10, 20, prompt=200, output=100), snap("b", 10, None)], now=10)
    assert w.flow() is None  # b's arrivals are unknown: the fleet's are too
    w3 = MetricsWindow(60.0)
    w3.update([snap("a", 0, 10)], now=0)
    w3.update([snap("a", 10, 20)], now=10)
    assert w3.flow() == Flow(1.0, 1.0, 0.0, 0.0, 1)  # an agent without token counters: no tokens
    assert Flow(1.0, 1.0, 0.0, 0.0, 1).tokens_per_request == 0.0
    assert Flow(0.0, 1.0, 0.0, 0.0, 1).tokens_per_request is None


def test_flow_over_the_last_interval_reaches_past_the_window() -> None:
    w = MetricsWindow(10.0)
    w.update([snap("a", 0, 10, held=2, prompt=0, output=0)], now=0)
    w.update([snap("a", 30, 40, held=2, prompt=3000, output=1500)], now=30)  # the first left the window
    assert w.flow() is None  # one sample in the window
    assert w.flow(last=True) == Flow(1.0, 1.0, 100.0, 50.0, 1)  # the one before is kept for the last interval
