"""The operator-wide loop of state.py: a resync heals lost events, skips fresh objects, forgets gone ones, and does
nothing while another operator instance leads; the loops end with the operator."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fake_kube import FakeKube

from kvfleet_operator.config import OperatorConfig
from kvfleet_operator.state import OperatorState, Tracked


def cr(uid: str = "u1") -> dict[str, Any]:
    return {"apiVersion": "serving.kvfleet.dev/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": "m", "namespace": "ns", "uid": uid, "generation": 1},
            "spec": {"model": {"name": "m", "source": {"pvc": {"claimName": "c"}}}, "replicas": 1}}


def tracked(kube: FakeKube, cfg: OperatorConfig | None = None) -> OperatorState:
    """A state whose handlers have seen the InferenceDeployment ns/m (uid u1)."""
    state = OperatorState(cfg or OperatorConfig(), kube)
    state.objects["ns", "m"] = Tracked("u1", builtin=False)
    return state


def test_resync_reconciles_drift_nobody_reported() -> None:
    kube = FakeKube()
    kube.add(cr())
    state = tracked(kube)
    asyncio.run(state.resync())
    assert kube.objects["Deployment", "ns", "m"]["spec"]["replicas"] == 1
    kube.objects["Deployment", "ns", "m"]["spec"]["replicas"] = 7  # a hand edit whose event was lost
    state.reconciled["u1"] -= 3600  # long ago
    asyncio.run(state.resync())
    assert kube.objects["Deployment", "ns", "m"]["spec"]["replicas"] == 1


def test_resync_skips_recently_reconciled_objects_and_forgets_gone_ones() -> None:
    kube = FakeKube()
    kube.add(cr())
    state = tracked(kube)
    asyncio.run(state.resync())
    writes = len(kube.writes)
    asyncio.run(state.resync())  # reconciled a moment ago: nothing to do
    assert len(kube.writes) == writes
    kube.objects.clear()
    kube.add(cr(uid="u2"))  # deleted and recreated: the tracked object is the old one
    state.reconciled.clear()
    asyncio.run(state.resync())
    assert len(kube.writes) == writes and "u1" not in state.reconciled
    assert not state.objects  # the new object's own handlers track it


def test_nothing_is_resynced_or_scaled_while_another_instance_leads() -> None:
    kube = FakeKube()
    kube.add(cr())
    # The peering object names a live peer of a higher priority (as `kopf freeze` or a dev-mode operator would).
    kube.add({"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering",
              "metadata": {"name": "kvfleet", "namespace": ""},
              "status": {"someone-else": {"priority": 666, "lifetime": 3600, "lastseen": "2999-01-01T00:00:00+00:00"}}})
    state = tracked(kube, OperatorConfig(peering="kvfleet"))
    asyncio.run(state.resync())
    assert kube.writes == []


def test_run_resyncs_every_period_until_cancelled() -> None:
    async def main() -> None:
        kube = FakeKube()
        kube.add(cr())
        state = tracked(kube, OperatorConfig(resync_seconds=30))
        waits: list[float] = []
        rounds = asyncio.Event()

        async def sleep(seconds: float) -> None:
            waits.append(seconds)
            if len(waits) == 3:
                rounds.set()
                await asyncio.Event().wait()  # parked here until cancelled

        task = asyncio.create_task(state.run(sleep=sleep))
        await rounds.wait()
        task.cancel()
        await asyncio.wait([task])
        assert waits == [30, 30, 30] and "Deployment" in {k for k, _, _ in kube.objects}

    asyncio.run(main())


def test_a_failing_round_does_not_end_the_loop() -> None:
    async def main() -> None:
        kube = FakeKube()
        kube.add(cr())
        kube.broken = RuntimeError("a bug")  # not an API error: the round fails unexpectedly
        state = tracked(kube)
        calls = 0

        async def sleep(seconds: float) -> None:
            nonlocal calls
            calls += 1
            if calls == 2:
                kube.broken = None
            if calls == 3:
                raise asyncio.CancelledError

        with pytest.raises(asyncio.CancelledError):  # the only way it ends
            await state.run(sleep=sleep)
        assert "Deployment" in {k for k, _, _ in kube.objects}  # the second round worked

    asyncio.run(main())
