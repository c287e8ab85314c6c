"""scrape.py's request counter: kvfleet_requests_total parsed per pod, and the arrivals seen between scrapes."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from kvfleet_contract import metrics as contract
from kvfleet_operator.autoscaling.scrape import MetricsWindow, Snapshot, parse_exposition


def exposition(outcomes: dict[str, float], model: str = "m", counter: bool = True) -> str:
    """The agent's gauges and its requests-by-outcome counter, as server/metrics.py exports them."""
    reg = CollectorRegistry()
    Gauge(contract.REQUESTS_WAITING, "w", [contract.MODEL_LABEL], registry=reg).labels(model).set(0)
    Gauge(contract.REQUESTS_RUNNING, "r", [contract.MODEL_LABEL], registry=reg).labels(model).set(0)
    if counter:
        c = Counter(contract.REQUESTS, "by outcome", [contract.MODEL_LABEL, contract.OUTCOME_LABEL], registry=reg)
        for outcome, n in outcomes.items():
            c.labels(model, outcome).inc(n)
    return generate_latest(reg).decode()


def test_requests_are_summed_over_outcomes_without_the_created_samples() -> None:
    text = exposition({"stop": 4, "length": 1, "rejected_queue_full": 2})
    assert "kvfleet_requests_created" in text  # prometheus_client's creation time: not a count
    assert parse_exposition(text, "p", 1.0).requests == 7
    assert parse_exposition(exposition({}), "p", 1.0).requests == 0  # the family, no outcome yet
    assert parse_exposition(exposition({}, counter=False), "p", 1.0).requests is None  # an agent without it
    assert parse_exposition(text, "p", 1.0, model="m").requests == 7


def snap(pod: str, t: float, requests: float | None) -> Snapshot:
    return Snapshot(pod, t, 0.0, 0.0, {}, requests)


def test_arrivals_over_each_pods_last_interval_from_zero_after_a_restart() -> None:
    w = MetricsWindow(60.0)
    w.update([snap("a", 0, 10), snap("b", 0, 3)], now=0)
    assert w.arrivals() is None  # one sample each: nothing to compare yet
    w.update([snap("a", 5, 10), snap("b", 5, 3)], now=5)
    assert w.arrivals() == 0
    w.update([snap("a", 10, 12), snap("b", 10, 1)], now=10)  # b restarted: its 1 counts from 0
    assert w.arrivals() == 3
    w.update([snap("c", 15, 0)], live={"a", "b", "c"}, now=15)  # a new pod: unknown until its second scrape
    assert w.arrivals() is None
    w.update([snap("a", 20, 12), snap("b", 20, 1), snap("c", 20, None)], now=20)  # c lost the counter
    assert w.arrivals() is None


def test_arrivals_survive_rounds_longer_than_the_window() -> None:
    w = MetricsWindow(10.0)
    w.update([snap("a", 0, 5)], now=0)
    w.update([snap("a", 30, 5)], now=30)  # the first sample left the window; arrivals still compares them
    assert w.arrivals() == 0
    w.update([snap("a", 60, 6)], now=60)
    assert w.arrivals() == 1
    w.update([], live=set(), now=70)  # the pod is gone: nothing of it is kept
    w.update([snap("a", 80, 6)], now=80)
    assert w.arrivals() is None
