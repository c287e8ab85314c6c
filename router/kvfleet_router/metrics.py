"""The router's own Prometheus metrics: requests and routing decisions, held requests, retries, its added latency."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
HOLD_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class RouterMetrics:
    """One registry per router (tests run several in a process)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("kvfleet_router_requests", "Requests by model, replica and outcome.",
                                ["model", "replica", "outcome"], registry=r)
        self.decisions = Counter("kvfleet_router_routing_decisions", "Replica choices by reason.",
                                 ["model", "reason"], registry=r)
        self.held = Gauge("kvfleet_router_held_requests", "Requests held for a model with no ready replica.",
                          ["model"], registry=r)
        self.hold_time = Histogram("kvfleet_router_hold_seconds", "How long held requests waited.", ["model"],
                                   buckets=HOLD_BUCKETS, registry=r)
        self.retries = Counter("kvfleet_router_retries", "Requests sent again to another replica.", ["model"],
                               registry=r)
        self.upstream_errors = Counter("kvfleet_router_upstream_errors", "Failed or refused upstream attempts.",
                                       ["model", "kind"], registry=r)
        self.added_latency = Histogram("kvfleet_router_added_latency_seconds",
                                       "The router's own time: picking and connecting, then relaying the first "
                                       "byte (the replica's time excluded).", buckets=LATENCY_BUCKETS, registry=r)
