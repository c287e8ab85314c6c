"""A tiered InferenceRouter's reconcile against the in-memory API and a stand-in router pod: status.tieredModels from
the pod's tier metrics, and TierPromoted / TierDemoted events after the status write, from a handler or the
resync (which has no kopf event queue of its own)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf
import pytest
from cr_helpers import state
from fake_kube import FakeKube
from kopf._core.engines import posting  # kopf's event queue, as its handlers see it
from prometheus_client import Counter, Gauge
from router_stub import RouterStub, router_pod

from kvfleet_contract import metrics as contract
from kvfleet_operator import router_builders as rb
from kvfleet_operator import router_reconcile
from kvfleet_operator.router_models import InferenceRouterStatus
from kvfleet_operator.router_reconcile import reconcile_router, reconcile_router_counted

TIERED = {"tieredModels": [{"name": "chat", "tiers": [{"model": "chat-small"}, {"model": "chat-large"}]}]}
PROMOTED = ("TierPromoted", "chat: class simple now served by chat-large instead of chat-small (quality below the "
                            "threshold 0.5 in 1 of 1 router pod(s))")
DEMOTED = ("TierDemoted", "chat: class simple back on chat-small (quality recovered)")


class TierRouter(RouterStub):
    """A router pod serving the held gauge and the contract's three tier families."""

    def __init__(self) -> None:
        super().__init__()
        labels = [contract.TIERED_MODEL_LABEL, contract.TIER_LABEL, contract.CLASS_LABEL]
        self.requests = Counter(contract.ROUTER_TIER_REQUESTS, "Requests.", labels, registry=self.registry)
        self.promotion = Gauge(contract.ROUTER_TIER_PROMOTION, "Promotion.",
                               [contract.TIERED_MODEL_LABEL, contract.CLASS_LABEL], registry=self.registry)
        self.quality = Gauge(contract.ROUTER_TIER_WINDOW_QUALITY, "Quality.", labels, registry=self.registry)


def tiered_router(stub: RouterStub) -> FakeKube:
    kube = FakeKube()
    kube.add({"apiVersion": "serving.kvfleet.dev/v1alpha1", "kind": "InferenceRouter",
              "metadata": {"name": "r", "namespace": "ns", "uid": "u1", "generation": 1}, "spec": TIERED})
    pod = router_pod("r-0", stub.port)
    pod["metadata"]["labels"] = rb.selector_labels("r")
    kube.add(pod)
    return kube


def tiers(kube: FakeKube) -> Any:
    return kube.objects["InferenceRouter", "ns", "r"]["status"].get("tieredModels")


def test_the_status_follows_the_pods_and_promotions_are_events_once() -> None:
    posted: list[tuple[str, str, str]] = []

    def post(body: kopf.Body, *, type: str, reason: str, message: str) -> None:  # kopf.event's signature
        assert body["metadata"]["uid"] == "u1"
        posted.append((type, reason, message))

    async def main() -> None:
        stub = TierRouter()
        await stub.start()
        try:
            kube = tiered_router(stub)
            ctx = state(kube)
            stub.requests.labels("chat", "chat-small", "simple").inc(3)
            stub.requests.labels("chat", "chat-large", "unmatched").inc(1)
            await reconcile_router("ns", "r", ctx, post_event=post)
            InferenceRouterStatus.model_validate(kube.objects["InferenceRouter", "ns", "r"]["status"])
            assert tiers(kube) == [{"name": "chat", "routerPods": 1, "promotions": [],
                                    "tiers": [{"model": "chat-small", "requests": 3, "share": 0.75},
                                              {"model": "chat-large", "requests": 1, "share": 0.25}]}]
            assert posted == []
            stub.promotion.labels("chat", "simple").set(1)
            stub.quality.labels("chat", "chat-small", "simple").set(0.3)
            await reconcile_router("ns", "r", ctx, post_event=post)
            assert tiers(kube)[0]["promotions"] == [{"class": "simple", "from": "chat-small", "to": "chat-large",
                                                     "routerPods": 1}]
            assert tiers(kube)[0]["tiers"][0]["quality"] == 0.3
            await reconcile_router("ns", "r", ctx, post_event=post)  # nothing new: no second event
            assert posted == [("Normal", *PROMOTED)]
            stub.status = 503  # no router pod answers: the status stays, and no event says otherwise
            await reconcile_router("ns", "r", ctx, post_event=post)
            assert tiers(kube)[0]["promotions"] and len(posted) == 1
            stub.status = 200
            stub.promotion.labels("chat", "simple").set(0)
            await reconcile_router("ns", "r", ctx, post_event=post)
            assert tiers(kube)[0]["promotions"] == [] and posted[1:] == [("Normal", *DEMOTED)]
        finally:
            await stub.stop()

    asyncio.run(main())


def test_the_resync_posts_through_the_event_queue_a_handler_ran_with(monkeypatch: pytest.MonkeyPatch,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(router_reconcile, "_HANDLER_CONTEXT", None)

    async def main() -> None:
        stub = TierRouter()
        await stub.start()
        try:
            kube = tiered_router(stub)
            ctx = state(kube)
            posting.settings_var.set(kopf.OperatorSettings())  # kopf sets it for the whole operator
            stub.promotion.labels("chat", "simple").set(1)
            # Before any handler ran, the resync has no event queue to post to: a warning, not a failed reconcile.
            with caplog.at_level(logging.WARNING, logger="kvfleet_operator.router_reconcile"):
                assert await reconcile_router_counted("ns", "r", ctx, "resync")
            assert "TierPromoted not posted" in caplog.text
            stub.promotion.labels("chat", "simple").set(0)
            queue: asyncio.Queue[posting.K8sEvent] = asyncio.Queue()

            async def handler() -> None:  # kopf's processing sets the queue in each handler's context
                posting.event_queue_loop_var.set(asyncio.get_running_loop())
                posting.event_queue_var.set(queue)
                assert await reconcile_router_counted("ns", "r", ctx, "update")

            await asyncio.create_task(handler())
            [demoted] = [queue.get_nowait() for _ in range(queue.qsize())]
            assert (demoted.reason, demoted.message) == DEMOTED and demoted.ref["uid"] == "u1"
            stub.promotion.labels("chat", "simple").set(1)
            assert await reconcile_router_counted("ns", "r", ctx, "resync")  # this context has no queue
            promoted = queue.get_nowait()
            assert (promoted.type, promoted.reason, promoted.message) == ("Normal", *PROMOTED)
        finally:
            await stub.stop()

    asyncio.run(main())
