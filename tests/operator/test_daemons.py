"""The resync and autoscale daemons: registered without a finalizer; resync heals lost events, exits when gone."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf
from fake_kube import FakeKube

from kvfleet_operator import handlers
from kvfleet_operator.config import OperatorConfig


class Stopped:
    """kopf's DaemonStopped as the daemons use it: falsy until stopped; wait() returns at once here."""

    def __init__(self, rounds: int) -> None:
        self.rounds = rounds

    def __bool__(self) -> bool:
        return self.rounds <= 0

    async def wait(self, timeout: float | None = None) -> Stopped:
        self.rounds -= 1
        await asyncio.sleep(0)
        return self


def cr(uid: str = "u1") -> dict[str, Any]:
    return {"apiVersion": "serving.kvfleet.dev/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": "m", "namespace": "ns", "uid": uid, "generation": 1},
            "spec": {"model": {"name": "m", "source": {"pvc": {"claimName": "c"}}}, "replicas": 1}}


def resync(kube: FakeKube, memo: kopf.Memo, rounds: int) -> None:
    asyncio.run(handlers.resync(name="m", namespace="ns", uid="u1", memo=memo, stopped=Stopped(rounds),
                                logger=logging.getLogger("test")))


def test_no_handler_of_ours_puts_a_finalizer_on_inference_deployments() -> None:
    spawning = kopf.get_default_registry()._spawning._handlers
    ours = [h for h in spawning if h.fn in (handlers.resync, handlers.autoscale)]
    assert len(ours) == 2 and not any(h.requires_finalizer for h in ours)
    changing = kopf.get_default_registry()._changing._handlers
    assert not any(h.requires_finalizer for h in changing)


def test_resync_reconciles_drift_nobody_reported() -> None:
    kube = FakeKube()
    kube.add(cr())
    memo = kopf.Memo(cfg=OperatorConfig(), kube=kube, locks={})
    resync(kube, memo, rounds=2)
    assert kube.objects["Deployment", "ns", "m"]["spec"]["replicas"] == 1
    kube.objects["Deployment", "ns", "m"]["spec"]["replicas"] = 7  # a hand edit whose event was lost
    memo["reconciled"]["u1"] -= 3600  # long ago
    resync(kube, memo, rounds=2)
    assert kube.objects["Deployment", "ns", "m"]["spec"]["replicas"] == 1


def test_resync_skips_recently_reconciled_objects_and_ends_when_the_object_is_gone() -> None:
    kube = FakeKube()
    kube.add(cr())
    memo = kopf.Memo(cfg=OperatorConfig(), kube=kube, locks={})
    resync(kube, memo, rounds=2)
    writes = len(kube.writes)
    resync(kube, memo, rounds=3)  # reconciled a moment ago: nothing to do
    assert len(kube.writes) == writes
    kube.objects.clear()
    kube.add(cr(uid="u2"))  # deleted and recreated: this daemon belongs to the old one
    memo["reconciled"].clear()
    resync(kube, memo, rounds=100)  # returns by itself on the first round
    assert len(kube.writes) == writes and "u1" not in memo["reconciled"]
