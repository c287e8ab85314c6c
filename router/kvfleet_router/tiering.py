"""Complexity tiers at request time: a tiered model's request → its class (features, or a classifier model), the
tier serving that class now (its base tier, or higher while the quality monitor has it promoted), and the header
that says so."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvfleet_router.classifier import Classification, classify, features, label_request, parse_label
from kvfleet_router.metrics import TierMetrics
from kvfleet_router.promotion import Promotion
from kvfleet_router.tier_config import UNMATCHED, TieredModel

log = logging.getLogger(__name__)
TIER_HEADER = "x-kvfleet-tier"
# A completions call to a served model: its JSON answer, or None (not ready, refused, failed, timed out).
Fetch = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any] | None]]


@dataclass(frozen=True)
class Route:
    """Where one request of a tiered model goes, and why."""

    tiered: TieredModel
    cls: str
    base: int  # the class's own tier
    tier: int  # the tier serving it now (base, or above while promoted)
    reason: str
    source: str  # features, model, or model-failed (the features decided)
    verify: bool = False  # sampled by the quality monitor: the answer is kept to be replayed and scored

    @property
    def model(self) -> str:
        """The served model the request is sent to."""
        return self.tiered.tiers[self.tier].model

    def header(self) -> str:
        """The x-kvfleet-tier value: tier, class, promotion and the classifier's reason (ASCII: header-safe)."""
        promoted = f"; promoted-from={self.tiered.tiers[self.base].model}" if self.tier != self.base else ""
        text = f"tier={self.model}; class={self.cls}{promoted}; source={self.source}; reason={self.reason}"
        return text.encode("ascii", "backslashreplace").decode()[:1024]


class Tiers:
    """The tiered models of one router, with each (model, class)'s promotion state (per router pod: each pod
    verifies its own sample, and the operator reports every pod's view)."""

    def __init__(self, tiered: Mapping[str, TieredModel], metrics: TierMetrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.tiered, self.metrics, self.clock = dict(tiered), metrics, clock
        self.promotions: dict[tuple[str, str], Promotion] = {}
        for tm in self.tiered.values():
            for c in (*tm.classifier.classes, None):
                name, base = (c.name, c.tier) if c is not None else (UNMATCHED, tm.top)
                self.promotions[tm.name, name] = Promotion(base, tm.top, tm.quality, clock())
                metrics.promotion.labels(tm.name, name).set(0)  # every class has a series from the start

    def __contains__(self, model: object) -> bool:
        return model in self.tiered

    def promotion(self, model: str, cls: str) -> Promotion:
        """The promotion state of one class of a tiered model."""
        return self.promotions[model, cls]

    async def route(self, body: Mapping[str, Any], fetch: Fetch) -> Route:
        """Classify a request of a tiered model (body["model"] names one) and pick its tier."""
        tm = self.tiered[str(body["model"])]
        c = classify(features(body, tm.classifier.markers), tm.classifier, tm.top)
        source = "features"
        if tm.classifier.model is not None:
            label = await self._label(tm, body, fetch)
            if label is None:
                source = "model-failed"
            else:
                source = "model"
                base = next(k.tier for k in tm.classifier.classes if k.name == label)
                c = Classification(label, base, f"{tm.classifier.model} labelled it {label}")
        self.metrics.classified.labels(tm.name, source).inc()
        tier = self.promotions[tm.name, c.name].tier
        route = Route(tm, c.name, c.tier, tier, c.reason, source)
        self.metrics.requests.labels(tm.name, route.model, c.name).inc()
        self.metrics.cost.labels(tm.name, route.model).inc(tm.tiers[tier].cost)
        return route

    async def _label(self, tm: TieredModel, body: Mapping[str, Any], fetch: Fetch) -> str | None:
        """The classifier model's label, or None when it did not answer in time or answered something else."""
        assert tm.classifier.model is not None
        try:
            answer = await asyncio.wait_for(fetch(tm.classifier.model, label_request(body, tm.classifier)),
                                            tm.classifier.model_timeout_s)
        except TimeoutError:
            answer = None
        label = parse_label(answer, tm.classifier) if answer is not None else None
        if label is None:
            log.debug("classifier model %s gave no label for a %s request: the features decide",
                      tm.classifier.model, tm.name)
        return label
