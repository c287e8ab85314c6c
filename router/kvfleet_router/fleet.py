"""The replicas behind each model: where they are, whether they are ready, their scraped gauges, our in-flight count."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvfleet_contract import metrics as contract
from kvfleet_router.picker import ReplicaLoad, Ring

log = logging.getLogger(__name__)
GAUGES = (contract.REQUESTS_WAITING, contract.REQUESTS_RUNNING, contract.KV_CACHE_USAGE)
# Scrapes in a row that may time out before a ready replica counts as unready (a Kubernetes readiness probe's default
# failureThreshold). A replica too busy to answer within the timeout is loaded, not gone: taking it out at once would
# pile its share onto the others exactly under load. A refused connection or a /ready that says no acts at once.
TIMEOUTS_BEFORE_UNREADY = 3


@dataclass
class Replica:
    """One agent endpoint of a model."""

    name: str
    url: str  # http://host:port, no trailing slash
    ready: bool = False
    in_flight: int = 0
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    scraped_at: float = 0.0  # monotonic seconds of the last good scrape
    timeouts: int = 0  # scrapes in a row that timed out
    finished_since_scrape: int = 0  # our requests that ended after the last scrape counted them

    def load(self) -> ReplicaLoad:
        """The picker's view of this replica now: the scraped queue less what we saw finish since (a scrape is up
        to one interval old, and counting requests that already left would steer traffic away for nothing)."""
        gone = float(self.finished_since_scrape)  # taken from the running first: requests finish from there
        running = max(0.0, self.running - gone)
        waiting = max(0.0, self.waiting - max(0.0, gone - self.running))
        return ReplicaLoad(self.name, self.in_flight, waiting, running, self.kv_usage)

    def finished(self) -> None:
        """One of our requests to this replica ended."""
        self.in_flight -= 1
        self.finished_since_scrape += 1


def parse_gauges(text: str) -> dict[str, float]:
    """The agent's queue and KV gauges from its exposition, summed over label sets (one agent, one model)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in GAUGES:
            out[family.name] = sum(s.value for s in family.samples)
    return out


class Fleet:
    """Models → replicas. Endpoints come from a discovery source (static flags, or the Kubernetes watch); the
    scrape loop keeps each replica's readiness and gauges current; `on_ready` hears when a model gains its first
    ready replica, `on_gone` when a model is no longer served."""

    def __init__(self, on_ready: Callable[[str], object] = lambda model: None,
                 on_gone: Callable[[str], object] = lambda model: None, synced: bool = True) -> None:
        self.models: dict[str, dict[str, Replica]] = {}
        # The InferenceDeployments (namespace, name) serving each model; none for static endpoints.
        self.deployments: dict[str, tuple[tuple[str, str], ...]] = {}
        self.rings: dict[str, Ring] = {}
        self.on_ready, self.on_gone = on_ready, on_gone
        self.synced = synced  # False until the discovery source has read everything once (the router's /ready)

    def set_endpoints(self, model: str, endpoints: Mapping[str, str], ready: bool = False,
                      deployments: Iterable[tuple[str, str]] = ()) -> None:
        """Replace a model's endpoints (name → URL), keeping the state of replicas that stay. New replicas start
        `ready` when the source vouches for them (Kubernetes' Ready condition), else unready until a scrape finds
        them ready. A model that gains its first ready replica releases the requests held for it."""
        had = bool(self.ready(model))
        old = self.models.get(model, {})
        self.models[model] = {name: old[name] if name in old and old[name].url == url else Replica(name, url, ready)
                              for name, url in endpoints.items()}
        self.deployments[model] = tuple(deployments)
        if not had and self.ready(model):
            self.on_ready(model)

    def remove(self, model: str) -> None:
        """Forget a model (no source serves it any more) and wake the requests held for it, to answer them."""
        if self.models.pop(model, None) is not None:
            self.deployments.pop(model, None)
            self.rings.pop(model, None)
            self.on_gone(model)

    def ready(self, model: str) -> list[Replica]:
        """The model's replicas that may take a request now."""
        return [r for r in self.models.get(model, {}).values() if r.ready]

    def ring(self, model: str) -> Ring:
        """The model's hash ring over its ready replicas (rebuilt only when that set changes)."""
        names = sorted(r.name for r in self.ready(model))
        ring = self.rings.get(model)
        if ring is None or ring.names != frozenset(names):
            ring = self.rings[model] = Ring(names)
        return ring

    def mark(self, model: str, replica: Replica, ready: bool) -> None:
        """Set a replica's readiness; a model's first ready replica releases the requests held for it."""
        if self.models.get(model, {}).get(replica.name) is not replica:
            replica.ready = ready  # it left the fleet while a scrape or a request was on it: nothing to release
            return
        had = bool(self.ready(model))
        replica.ready = ready
        if ready and not had:
            self.on_ready(model)

    async def scrape(self, session: aiohttp.ClientSession) -> None:
        """One round: every replica's /ready and /metrics, concurrently; a replica that fails either is unready (after
        TIMEOUTS_BEFORE_UNREADY rounds in a row where it only timed out)."""
        async def one(model: str, r: Replica) -> None:
            try:
                async with session.get(f"{r.url}/ready") as resp:
                    ok = resp.status == 200
                    await resp.read()
                if ok:
                    # Ours that finish while /metrics is on its way may still be in its gauges (the agent read them
                    # before they left), so they stay subtracted. Forgetting them counted them twice until the next
                    # scrape: the fleet's load summed high, and with it the picker's bound, ⌈(1 + ε) × total / n⌉.
                    # Where the gauges had already dropped one, this errs low, never below our own in-flight count,
                    # which is exact.
                    finished_before = r.finished_since_scrape
                    async with session.get(f"{r.url}/metrics") as resp:
                        gauges = parse_gauges(await resp.text())
                    r.waiting = gauges.get(contract.REQUESTS_WAITING, 0.0)
                    r.running = gauges.get(contract.REQUESTS_RUNNING, 0.0)
                    r.kv_usage = gauges.get(contract.KV_CACHE_USAGE, 0.0)
                    r.scraped_at = time.monotonic()
                    r.finished_since_scrape -= finished_before
                r.timeouts = 0
            except TimeoutError:  # before ClientError: aiohttp's read timeout is both
                r.timeouts += 1
                ok = r.ready and r.timeouts < TIMEOUTS_BEFORE_UNREADY  # its gauges stay as last read
                if r.ready and not ok:
                    log.warning("replica %s of %s did not answer %d scrapes in a row", r.name, model, r.timeouts)
            except (aiohttp.ClientError, ValueError) as e:
                if r.ready:
                    log.warning("replica %s of %s stopped answering: %s", r.name, model, e)
                ok = False
            self.mark(model, r, ok)

        await asyncio.gather(*(one(m, r) for m, reps in self.models.items() for r in list(reps.values())))

    async def scrape_forever(self, interval_s: float) -> None:
        """Scrape every interval_s until cancelled (sub-second: load moves faster than the autoscaler's window)."""
        timeout = aiohttp.ClientTimeout(total=max(interval_s, 0.5))
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                await self.scrape(session)
                await asyncio.sleep(interval_s)
