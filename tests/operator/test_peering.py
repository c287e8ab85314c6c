"""peering.py: kopf's rule on the peering object's status (pure), and Leadership reading it through the API."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import pytest
from fake_kube import FakeKube

from kvfleet_operator.config import OperatorConfig
from kvfleet_operator.kube import FIELD_MANAGER, ApiError
from kvfleet_operator.peering import CHECK_SECONDS, Leadership, ensure_peering_object, leads, new_identity

NOW = datetime(2026, 1, 1, tzinfo=UTC)
FRESH, STALE = "2025-12-31T23:59:30+00:00", "2025-12-31T23:58:00+00:00"  # 30 s and 120 s before NOW
ME = "me@host/1/abc"


def peer(priority: int, lastseen: str | None = FRESH, lifetime: int = 60) -> dict[str, Any]:
    return {"priority": priority, "lifetime": lifetime, **({"lastseen": lastseen} if lastseen else {})}


@pytest.mark.parametrize(("peers", "expected"), [
    ({}, True),  # alone (our own entry not written yet)
    ({ME: peer(5)}, True),  # only ourselves
    ({ME: peer(5), "other": peer(1)}, True),  # a live peer of a lower priority
    ({ME: peer(5), "other": peer(9)}, False),  # a higher one leads
    ({ME: peer(5), "other": peer(5)}, False),  # the same: kopf freezes both
    ({ME: peer(5), "other": peer(9, STALE)}, True),  # dead: seen 120 s ago with a lifetime of 60 s
    ({ME: peer(5), "other": peer(9, STALE, lifetime=3600)}, False),  # its lifetime is longer
    ({ME: peer(5), "other": peer(9, lastseen=None)}, False),  # no time: kopf counts it as seen now
    ({ME: peer(5), "other": peer(9, "yesterday")}, False),  # unreadable: assume someone is there
    ({ME: peer(5), "other": peer(9, "2025-12-31T23:59:30")}, False),  # no zone: UTC
    ({ME: peer(5), "other": None}, True),  # an entry being removed (kopf patches it to null)
])
def test_kopfs_rule(peers: dict[str, Any], expected: bool) -> None:
    assert leads(peers, ME, 5, NOW) is expected


def peering(status: dict[str, Any], name: str = "kvfleet") -> dict[str, Any]:
    return {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": name, "namespace": ""},
            "status": status}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_leadership_reads_the_named_peering_object_and_reuses_its_verdict_for_a_while() -> None:
    kube, clock = FakeKube(), Clock()
    kube.add(peering({ME: peer(0, "2999-01-01T00:00:00+00:00")}))
    kube.add(peering({"other": peer(100, "2999-01-01T00:00:00+00:00")}, name="someone-elses"))
    lead = Leadership(kube, OperatorConfig(peering="kvfleet"), ME, clock=clock)

    async def main() -> list[bool]:
        verdicts = [await lead.leading()]
        kube.objects["ClusterKopfPeering", "", "kvfleet"]["status"]["dev"] = peer(666, "2999-01-01T00:00:00+00:00")
        verdicts.append(await lead.leading())  # the cached verdict
        clock.now += CHECK_SECONDS
        verdicts.append(await lead.leading())
        return verdicts

    assert asyncio.run(main()) == [True, True, False]


@pytest.mark.parametrize("case", ["no peering object", "unreadable"])
def test_leadership_is_off_when_the_peering_object_cannot_be_read(case: str) -> None:
    kube = FakeKube()
    if case == "unreadable":
        kube.add(peering({}))
        kube.broken = ApiError(403, "Forbidden", "no")
    lead = Leadership(kube, OperatorConfig(peering="kvfleet"), ME)
    assert asyncio.run(lead.leading()) is False


def test_a_standalone_operator_always_leads_without_asking() -> None:
    kube = FakeKube()
    kube.broken = ApiError(500, "InternalError", "not asked")
    assert asyncio.run(Leadership(kube, OperatorConfig(), ME).leading()) is True


def test_identities_are_unique_per_process_start() -> None:
    assert new_identity() != new_identity() and new_identity().startswith("kvfleet-operator@")


def test_the_operator_creates_its_peering_object_and_retries_until_the_crd_serves_it() -> None:
    kube = FakeKube()
    kube.fail["ClusterKopfPeering"] = ApiError(404, "NotFound", "the server could not find the requested resource")

    async def scenario() -> None:
        task = asyncio.create_task(ensure_peering_object(kube, "kvfleet", pauses=(0.0,)))
        # Refused at least once: the CRD is not served yet.
        while kube.writes.count(("apply", "ClusterKopfPeering", None, FIELD_MANAGER)) < 2:
            await asyncio.sleep(0)
        del kube.fail["ClusterKopfPeering"]
        await asyncio.wait_for(task, 5)

    asyncio.run(scenario())
    body = kube.objects["ClusterKopfPeering", "", "kvfleet"]
    assert body["apiVersion"] == "kopf.dev/v1" and not body["status"]  # the name alone: kopf writes the status
