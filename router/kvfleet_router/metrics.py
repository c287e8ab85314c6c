"""The router's own Prometheus metrics: requests and routing decisions, held requests, retries, its added latency,
and the complexity tiers (traffic by tier and class, verified quality, promotions, cost units)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from kvfleet_contract import metrics as contract
from kvfleet_contract.exposition import ExpositionRegistry

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
QUALITY_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)  # agreement in [0, 1]
HOLD_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
HELD_LABELS = (contract.MODEL_LABEL, contract.NAMESPACE_LABEL, contract.DEPLOYMENT_LABEL)
# (model, namespace, InferenceDeployment, requests held): "" and "" for a model served by static endpoints.
HeldSample = tuple[str, str, str, float]
TIER_LABELS = (contract.TIERED_MODEL_LABEL, contract.TIER_LABEL, contract.CLASS_LABEL)


class HeldRequests:
    """The held-requests gauge of the contract, read at scrape time from the hold queue and the fleet (a count
    kept by inc/dec could not follow a model whose InferenceDeployments change while requests wait)."""

    def __init__(self, samples: Callable[[], Iterable[HeldSample]]) -> None:
        self.samples = samples

    def _family(self) -> GaugeMetricFamily:
        return GaugeMetricFamily(contract.ROUTER_HELD_REQUESTS, "Requests held for a model with no ready replica, "
                                 "under each InferenceDeployment serving it (the demand to scale up from zero).",
                                 labels=HELD_LABELS)

    def describe(self) -> Iterator[Metric]:
        """The family without samples (registering must not read the queue)."""
        yield self._family()

    def collect(self) -> Iterator[Metric]:
        """One sample per served (model, InferenceDeployment), held count included when 0."""
        family = self._family()
        for model, namespace, deployment, value in self.samples():
            family.add_metric([model, namespace, deployment], value)
        yield family


class RouterMetrics:
    """One registry per router (tests run several in a process)."""

    def __init__(self, held: Callable[[], Iterable[HeldSample]] = lambda: ()) -> None:
        r = self.registry = ExpositionRegistry(auto_describe=True)
        self.requests = Counter("kvfleet_router_requests", "Requests by model, replica and outcome.",
                                ["model", "replica", "outcome"], registry=r)
        self.decisions = Counter("kvfleet_router_routing_decisions", "Replica choices by reason.",
                                 ["model", "reason"], registry=r)
        r.register(HeldRequests(held))
        self.hold_time = Histogram("kvfleet_router_hold_seconds", "How long held requests waited.", ["model"],
                                   buckets=HOLD_BUCKETS, registry=r)
        self.retries = Counter("kvfleet_router_retries", "Requests sent again to another replica.", ["model"],
                               registry=r)
        self.upstream_errors = Counter("kvfleet_router_upstream_errors", "Failed or refused upstream attempts.",
                                       ["model", "kind"], registry=r)
        self.added_latency = Histogram("kvfleet_router_added_latency_seconds",
                                       "The router's own time: picking and connecting, then relaying the first "
                                       "byte (the replica's time excluded).", buckets=LATENCY_BUCKETS, registry=r)
        self.tiers = TierMetrics(r)


class TierMetrics:
    """The complexity tiers' families (see kvfleet_contract.metrics for the three the operator reads)."""

    def __init__(self, r: ExpositionRegistry) -> None:
        self.requests = Counter(contract.ROUTER_TIER_REQUESTS, "Requests of tiered models by the tier that served "
                                "them and their class.", TIER_LABELS, registry=r)
        self.classified = Counter("kvfleet_router_tier_classifications", "Classifications by source: features, "
                                  "model, or features after the classifier model failed.", ["model", "source"],
                                  registry=r)
        self.cost = Counter("kvfleet_router_tier_cost_units", "Cost units of served requests (each tier's cost per "
                            "request): the cost proxy.", ["model", "tier"], registry=r)
        self.quality = Histogram("kvfleet_router_tier_quality", "Agreement of a tier's answers with the top tier's "
                                 "on replayed requests (ROUGE-L F1, 1 = the same words in the same order).",
                                 TIER_LABELS, buckets=QUALITY_BUCKETS, registry=r)
        self.window_quality = Gauge(contract.ROUTER_TIER_WINDOW_QUALITY, "Mean agreement in a tier's last closed "
                                    "quality window for a class.", TIER_LABELS, registry=r)
        self.verifications = Counter("kvfleet_router_tier_verifications", "Sampled answers by outcome: scored, "
                                     "skipped_budget, skipped_busy, skipped_unavailable, failed.",
                                     ["model", "outcome"], registry=r)
        self.replays = Counter("kvfleet_router_tier_replays", "Requests replayed out of band for verification.",
                               ["model", "tier"], registry=r)
        self.replay_cost = Counter("kvfleet_router_tier_replay_cost_units", "Cost units spent on verification "
                                   "replays.", ["model", "tier"], registry=r)
        self.promotion = Gauge(contract.ROUTER_TIER_PROMOTION, "Tiers above its base tier a class is served from "
                               "now (0: not promoted).", ["model", "class"], registry=r)
        self.promotions = Counter("kvfleet_router_tier_promotions", "Classes moved up a tier.", ["model", "class"],
                                  registry=r)
        self.demotions = Counter("kvfleet_router_tier_demotions", "Classes moved back down a tier.",
                                 ["model", "class"], registry=r)
