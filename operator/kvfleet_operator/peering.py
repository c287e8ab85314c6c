"""Whether this operator instance leads: kopf's peering object, read through the API and judged by kopf's rule."""

# kopf pauses its handlers while another operator instance leads, but it tells nothing of that to code that
# runs beside them (its pause flag is internal; startup and index handlers do not see it, and an index simply
# stops updating). The operator-wide loops (state.py) write too, so they ask this module before every round.
# It applies the rule kopf documents (docs/peering.rst: an instance freezes while a live peer has a higher
# priority, and every instance freezes while two share the same one) to the peering object's status, which
# kopf keeps as {identity: {priority, lifetime, lastseen}} and which `kopf freeze` writes to as well. Knowing
# our own identity, which kopf.operator() takes as an argument, tells our entry from the others.

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import aiohttp

from kvfleet_operator.config import OperatorConfig
from kvfleet_operator.kube import PEERING_KIND, ApiError, KubeClient

PEERING_API_VERSION = "kopf.dev/v1"

log = logging.getLogger(__name__)
ENSURE_RETRY_SECONDS = (1.0, 2.0, 5.0)  # then every 5 s: the CRD may still be on its way to Established
DEFAULT_LIFETIME = 60  # kopf's default when a peer's entry names none
CHECK_SECONDS = 5.0  # a verdict is reused this long: one read of the peering object serves every loop's round


def new_identity() -> str:
    """A peer identity unique to this process (the hostname is the pod's name in a cluster)."""
    return f"kvfleet-operator@{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(3)}"


def _alive(entry: Mapping[str, Any], now: datetime) -> bool:
    seen_at = entry.get("lastseen")
    if seen_at is None:
        return True  # kopf counts an entry without a time as seen just now
    try:
        seen = datetime.fromisoformat(str(seen_at))
        lifetime = timedelta(seconds=int(entry.get("lifetime", DEFAULT_LIFETIME)))
    except (TypeError, ValueError):
        return True  # unreadable: assume someone is there (the safe side is not to act)
    seen = seen if seen.tzinfo is not None else seen.replace(tzinfo=UTC)
    return seen + lifetime > now


def leads(peers: Mapping[str, Any], identity: str, priority: int, now: datetime) -> bool:
    """Pure: whether the instance `identity` of `priority` leads, given the peering object's status."""
    for peer, entry in peers.items():
        if peer == identity or not isinstance(entry, Mapping) or not _alive(entry, now):
            continue
        try:
            theirs = int(entry.get("priority", 0))
        except (TypeError, ValueError):
            return False
        if theirs >= priority:
            return False
    return True


class Leadership:
    """Whether the operator-wide loops may act now; always true for a standalone operator."""

    def __init__(self, kube: KubeClient, cfg: OperatorConfig, identity: str, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.identity = identity
        self._kube, self._name, self._priority = kube, cfg.peering, cfg.peering_priority
        self._clock = clock
        self._lock = asyncio.Lock()
        self._checked: float | None = None
        self._verdict = False

    async def leading(self) -> bool:
        """The verdict, read again at most every CHECK_SECONDS; False when the peering object cannot be read
        (kopf keeps its handlers paused then as well)."""
        if not self._name:
            return True
        async with self._lock:  # concurrent loops share one read
            if self._checked is not None and self._clock() - self._checked < CHECK_SECONDS:
                return self._verdict
            verdict = await self._read()
            if verdict != self._verdict or self._checked is None:
                log.info(f"peering {self._name}: {'leading' if verdict else 'paused'} (identity {self.identity})")
            self._checked, self._verdict = self._clock(), verdict
            return verdict

    async def _read(self) -> bool:
        try:
            # A list, not a get: the operator's RBAC on peering objects is kopf's (list, watch, patch).
            found = await self._kube.list(PEERING_KIND, "", "")
        except (ApiError, aiohttp.ClientError, TimeoutError) as e:
            log.warning(f"peering {self._name}: cannot read it, acting as paused: {e}")
            return False
        body = next((o for o in found if (o.get("metadata") or {}).get("name") == self._name), None)
        if body is None:
            return False  # kopf waits for a mandatory peering object that does not exist
        return leads(body.get("status") or {}, self.identity, self._priority, datetime.now(UTC))


async def ensure_peering_object(kube: KubeClient, name: str, *,
                                pauses: tuple[float, ...] = ENSURE_RETRY_SECONDS) -> None:
    """Create the ClusterKopfPeering `name` if it is missing, retrying until the API accepts it.

    The operator makes its own peering object instead of shipping it in manifests/base: a custom resource next to
    its CRD fails the first `kubectl apply` (no REST mapping until the CRD is Established) and needs sync waves in
    Argo CD. Its content is kopf's runtime state (status only), so nothing is lost by not declaring it. kopf keeps
    every handler paused until the object exists, then notices it through its watch."""
    body = {"apiVersion": PEERING_API_VERSION, "kind": PEERING_KIND, "metadata": {"name": name, "namespace": ""}}
    attempt = 0
    while True:
        try:
            # Server-side apply of the name alone claims no field: kopf's status writes are never contested.
            await kube.apply(body)
            log.info(f"peering {name}: the ClusterKopfPeering exists")
            return
        except (ApiError, aiohttp.ClientError, TimeoutError) as e:
            pause = pauses[min(attempt, len(pauses) - 1)]
            log.warning(f"peering {name}: cannot create the ClusterKopfPeering yet ({e}); again in {pause:g} s")
            attempt += 1
            await asyncio.sleep(pause)
