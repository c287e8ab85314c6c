"""Pure: which replica serves a request, by prefix affinity under bounded load, else by least load, with a reason.

Prefix affinity is consistent hashing with bounded loads (Mirrokni et al., as KubeAI's PrefixHash and
Vimeo's proxies do it): the prompt's prefix key hashes to a point on a ring of virtual nodes, and the
request goes to the first replica clockwise whose load stays within (1 + ε) × the mean. Requests that
share a prefix land on the replica that already holds its KV blocks, and no hot prefix can push one
replica past the bound: it spills to the next replica on the ring, which then becomes warm too.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

VIRTUAL_NODES = 64  # ring points per replica: enough that a replica's share of the ring is even to a few %


@dataclass(frozen=True)
class ReplicaLoad:
    """What the router knows of one ready replica at picking time."""

    name: str
    in_flight: int  # requests the router sent and has not seen finish
    waiting: float = 0.0  # the agent's own gauges at the last scrape (every client's requests, not just ours)
    running: float = 0.0
    kv_usage: float = 0.0  # fraction of KV blocks held

    @property
    def load(self) -> float:
        """Requests the replica holds. The scrape counts other clients too but lags; our in-flight count is
        current but only ours: the larger of the two, never their sum (ours are inside the scraped count)."""
        return max(float(self.in_flight), self.waiting + self.running)


@dataclass(frozen=True)
class Choice:
    """The replica picked and why: prefix (its affinity owner), prefix-spill (the owner was over the bound),
    least-load (no prefix to follow)."""

    replica: str
    reason: str


def _point(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class Ring:
    """The hash ring of a set of replicas; rebuilt when the set changes (cheap: 64 points a replica)."""

    def __init__(self, names: Sequence[str]) -> None:
        points = sorted((_point(f"{name}#{i}"), name) for name in names for i in range(VIRTUAL_NODES))
        self.keys = [p for p, _ in points]
        self.owners = [n for _, n in points]
        self.names = frozenset(names)

    def walk(self, key: str) -> list[str]:
        """Every replica once, in ring order from the key's point."""
        start = bisect.bisect(self.keys, _point(key))
        seen: list[str] = []
        for i in range(len(self.owners)):
            owner = self.owners[(start + i) % len(self.owners)]
            if owner not in seen:
                seen.append(owner)
                if len(seen) == len(self.names):
                    break
        return seen


def bound(loads: Sequence[ReplicaLoad], epsilon: float) -> float:
    """The most load a replica may hold after taking one more request: ⌈(1 + ε) × (total + 1) / n⌉."""
    total = sum(r.load for r in loads) + 1
    return math.ceil((1 + epsilon) * total / len(loads))


def least_loaded(loads: Sequence[ReplicaLoad]) -> ReplicaLoad:
    """The tie-break, in order: lowest load, then emptiest KV cache, then fewest of our in-flight, then name."""
    return min(loads, key=lambda r: (r.load, r.kv_usage, r.in_flight, r.name))


def pick(loads: Sequence[ReplicaLoad], prefix_key: str | None, epsilon: float, ring: Ring | None = None) -> Choice:
    """Choose a replica for one request (loads must be non-empty: the caller holds requests when none is ready)."""
    if not loads:
        raise ValueError("pick() needs at least one ready replica")
    if prefix_key is None:
        return Choice(least_loaded(loads).name, "least-load")
    by_name = {r.name: r for r in loads}
    if ring is None or ring.names != frozenset(by_name):
        ring = Ring(sorted(by_name))
    limit = bound(loads, epsilon)
    order = ring.walk(prefix_key)
    for i, name in enumerate(order):
        if by_name[name].load + 1 <= limit:
            return Choice(name, "prefix" if i == 0 else "prefix-spill")
    return Choice(least_loaded(loads).name, "least-load")  # unreachable: the least loaded is always within
