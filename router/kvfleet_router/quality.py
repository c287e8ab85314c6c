"""The quality monitor: a sampled share of each tiered model's answers from below the top tier is replayed on the
top tier out of band (after the user has the answer; bounded concurrency and a per-minute budget), scored by
agreement (agreement.py), and fed to the class's promotion state (promotion.py), which moves the class up a tier
while its quality stays below the threshold and back down once the tier below scores well again."""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

from kvfleet_router.agreement import agreement, answer_text
from kvfleet_router.metrics import TierMetrics
from kvfleet_router.promotion import Change
from kvfleet_router.tier_config import TieredModel
from kvfleet_router.tiering import Route, Tiers

log = logging.getLogger(__name__)
# A non-streaming call to a served model on the same route: (response body, content type), or None when no ready
# replica took it (then the sample is skipped: a replay never waits for a tier to scale up).
Replay = Callable[[str, str, dict[str, Any]], Awaitable[tuple[bytes, str] | None]]


def replay_body(body: dict[str, Any], model: str) -> dict[str, Any]:
    """The request as replayed on another tier: the same sampling settings (a seeded request stays comparable),
    one answer, not streamed."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "n", "best_of")}
    return {**out, "model": model}


class QualityMonitor:
    """Samples, replays and scores one router's tiered traffic; each verification is its own task, never awaited by
    the request it verifies."""

    def __init__(self, tiers: Tiers, replay: Replay, metrics: TierMetrics, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.tiers, self.replay, self.metrics, self.clock = tiers, replay, metrics, clock
        self.rng = rng or random.Random()
        self.in_flight: dict[str, int] = collections.Counter()
        self.started: dict[str, collections.deque[float]] = collections.defaultdict(collections.deque)
        self.tasks: set[asyncio.Task[None]] = set()

    def sample(self, route: Route) -> bool:
        """Whether to verify this request's answer: drawn before it is relayed, so that only a sampled answer is
        kept (a class with nothing to verify, served by the top tier unpromoted, is never sampled)."""
        promotion = self.tiers.promotion(route.tiered.name, route.cls)
        return bool(promotion.verify_tiers()) and self.rng.random() < route.tiered.quality.sample_rate

    def offer(self, route: Route, path: str, body: dict[str, Any], answer: bytes | None, content_type: str) -> None:
        """A sampled request was answered in full (`answer`: what the user got, None if it was not kept): start its
        verification, within bounds."""
        tm, promotion = route.tiered, self.tiers.promotion(route.tiered.name, route.cls)
        wanted = promotion.verify_tiers()
        if not wanted or route.tier != promotion.tier:  # the class moved while the request ran
            return
        text = answer_text(answer, content_type) if answer is not None else None
        if text is None:
            self.metrics.verifications.labels(tm.name, "failed").inc()
            return
        replays = [t for t in {*wanted, tm.top} if t != route.tier]  # the top's answer is the reference
        if self.in_flight[tm.name] + 1 > tm.quality.max_concurrent:
            self.metrics.verifications.labels(tm.name, "skipped_busy").inc()
            return
        now, started = self.clock(), self.started[tm.name]
        while started and started[0] <= now - 60.0:
            started.popleft()
        if len(started) + len(replays) > tm.quality.max_per_minute:
            self.metrics.verifications.labels(tm.name, "skipped_budget").inc()
            return
        started.extend([now] * len(replays))
        self.in_flight[tm.name] += 1
        task = asyncio.create_task(self._verify(route, path, body, text, sorted(replays)),
                                   name=f"verify {tm.name}/{route.cls}")
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _verify(self, route: Route, path: str, body: dict[str, Any], served: str, replays: list[int]) -> None:
        tm = route.tiered
        try:
            answers = {route.tier: served}
            for tier in replays:
                model = tm.tiers[tier].model
                got = await self.replay(model, path, replay_body(body, model))
                text = answer_text(*got) if got is not None else None
                self.metrics.replays.labels(tm.name, model).inc()
                self.metrics.replay_cost.labels(tm.name, model).inc(tm.tiers[tier].cost)
                if text is None:
                    outcome = "skipped_unavailable" if got is None else "failed"
                    self.metrics.verifications.labels(tm.name, outcome).inc()
                    return
                answers[tier] = text
            self._score(route, answers)
        except Exception:  # a verification is best effort: it must never take the router down
            log.exception("verifying a %s answer failed", tm.name)
            self.metrics.verifications.labels(tm.name, "failed").inc()
        finally:
            self.in_flight[tm.name] -= 1

    def _score(self, route: Route, answers: dict[int, str]) -> None:
        tm, now = route.tiered, self.clock()
        promotion = self.tiers.promotion(tm.name, route.cls)
        reference = answers[tm.top]
        for tier in promotion.verify_tiers():
            if tier in answers:
                score = agreement(answers[tier], reference)
                promotion.record(tier, score, now)
                self.metrics.quality.labels(tm.name, tm.tiers[tier].model, route.cls).observe(score)
        self.metrics.verifications.labels(tm.name, "scored").inc()
        for tier in range(len(tm.tiers)):
            if (mean := promotion.last_mean(tier)) is not None:
                self.metrics.window_quality.labels(tm.name, tm.tiers[tier].model, route.cls).set(mean)
        change = promotion.evaluate(now)
        if change is not None:
            self._changed(tm, route.cls, change, promotion.tier)

    def _changed(self, tm: TieredModel, cls: str, change: Change, tier: int) -> None:
        counter = self.metrics.promotions if change.kind == "promoted" else self.metrics.demotions
        counter.labels(tm.name, cls).inc()
        base = next((c.tier for c in tm.classifier.classes if c.name == cls), tm.top)
        self.metrics.promotion.labels(tm.name, cls).set(tier - base)
        if (mean := self.tiers.promotion(tm.name, cls).last_mean(change.from_tier)) is not None:
            self.metrics.window_quality.labels(tm.name, tm.tiers[change.from_tier].model, cls).set(mean)
        log.warning("%s class %s %s from %s to %s: mean agreement %.2f over %d sample(s) (threshold %.2f)", tm.name,
                    cls, change.kind, tm.tiers[change.from_tier].model, tm.tiers[change.to_tier].model, change.mean,
                    change.samples, tm.quality.threshold)

    async def close(self) -> None:
        """Cancel the verifications in flight (at shutdown: they are out of band, nobody waits for them)."""
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
