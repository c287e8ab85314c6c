"""The reconcile against an in-memory API: what it applies, the one status write, errors → kopf retry policy."""

from __future__ import annotations

import asyncio
import copy
import logging
from typing import Any

import kopf
import pytest

from kvfleet_operator import handlers
from kvfleet_operator.config import OperatorConfig
from kvfleet_operator.kube import ApiError


class FakeKube:
    """Objects by (kind, namespace, name); apply merges like a create-or-replace; optional failures by kind."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.status_writes: list[dict[str, Any]] = []
        self.fail: dict[str, ApiError] = {}
        self.deleted: list[tuple[str, str]] = []

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        obj = self.objects.get((kind, namespace, name))
        return copy.deepcopy(obj) if obj else None

    async def apply(self, obj: dict[str, Any], *, subresource: str | None = None,
                    manager: str = "kvfleet-operator") -> dict[str, Any]:
        key = (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        if subresource == "status":
            self.status_writes.append(copy.deepcopy(obj["status"]))
            stored = self.objects[key]
            kept = [c for c in stored.get("status", {}).get("conditions", [])
                    if c["type"] not in {n["type"] for n in obj["status"]["conditions"]}]
            stored["status"] = {**stored.get("status", {}), **copy.deepcopy(obj["status"])}
            stored["status"]["conditions"] = kept + stored["status"]["conditions"]  # merged by type, as SSA does
            return copy.deepcopy(stored)
        if obj["kind"] in self.fail:
            raise self.fail[obj["kind"]]
        old = self.objects.get(key, {})
        generation = old.get("metadata", {}).get("generation", 1)
        self.objects[key] = {**copy.deepcopy(obj), "status": old.get("status", {}),
                             "metadata": {**obj["metadata"], "generation": generation}}
        return copy.deepcopy(self.objects[key])

    async def delete(self, kind: str, namespace: str, name: str) -> bool:
        self.deleted.append((kind, name))
        return self.objects.pop((kind, namespace, name), None) is not None


def cr(spec: dict[str, Any] | None = None, status: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"apiVersion": "serving.kvfleet.dev/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": "m", "namespace": "ns", "uid": "u1", "generation": 4},
            "spec": spec or {"model": {"name": "m", "source": {"pvc": {"claimName": "c"}}}, "replicas": 2},
            "status": status or {}}


def memo(kube: FakeKube) -> kopf.Memo:
    return kopf.Memo(cfg=OperatorConfig(), kube=kube, locks={})


def with_cr(body: dict[str, Any] | None = None) -> FakeKube:
    kube = FakeKube()
    kube.objects["InferenceDeployment", "ns", "m"] = body or cr()
    return kube


def reconcile(kube: FakeKube, replicas: int | None = None) -> int | None:
    return asyncio.run(handlers.reconcile_object("ns", "m", memo(kube), replicas=replicas))


def children(kube: FakeKube) -> list[str]:
    return sorted(k for k, _, _ in kube.objects if k != "InferenceDeployment")


def test_create_applies_everything_and_writes_status_once() -> None:
    kube = with_cr()
    assert reconcile(kube) == 2
    assert children(kube) == ["Deployment", "PodDisruptionBudget", "Service"]
    assert kube.objects["Deployment", "ns", "m"]["spec"]["replicas"] == 2
    assert kube.deleted == [("ConfigMap", "m-args")]
    [status] = kube.status_writes
    assert (status["observedGeneration"], status["desiredReplicas"]) == (4, 2)
    assert {c["type"] for c in status["conditions"]} == {"Ready", "Progressing", "Degraded"}


def test_unchanged_status_is_not_rewritten_and_other_conditions_survive() -> None:
    kube = with_cr()
    reconcile(kube)
    kube.objects["InferenceDeployment", "ns", "m"]["status"]["conditions"].append(
        {"type": "ScalingActive", "status": "True", "reason": "x", "message": "",
         "lastTransitionTime": "2026-01-01T00:00:00Z"})
    reconcile(kube)
    assert len(kube.status_writes) == 1  # the autoscaler's condition does not count as a difference
    kube.objects["Deployment", "ns", "m"]["status"] = {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2,
                                                       "observedGeneration": 1}
    reconcile(kube)
    assert len(kube.status_writes) == 2
    stored = {c["type"]: c["status"] for c in kube.objects["InferenceDeployment", "ns", "m"]["status"]["conditions"]}
    assert stored == {"ScalingActive": "True", "Ready": "True", "Progressing": "False", "Degraded": "False"}


def test_builtin_mode_keeps_the_live_replicas() -> None:
    spec = {"model": {"name": "m", "source": {"pvc": {"claimName": "c"}}}, "replicas": 9,
            "autoscaling": {"mode": "builtin", "minReplicas": 1, "maxReplicas": 5,
                            "targets": {"queueDepthPerReplica": 4}}}
    kube = with_cr(cr(spec))
    assert reconcile(kube) == 1  # created at minReplicas
    assert asyncio.run(handlers.apply_desired("ns", "m", memo(kube), 4)) == 4  # the autoscaler's hook
    assert reconcile(kube) == 4  # a later reconcile keeps it
    assert kube.objects["Deployment", "ns", "m"]["spec"]["replicas"] == 4


def test_apply_failure_still_applies_the_rest_and_reports_degraded() -> None:
    kube = with_cr()
    kube.fail["Service"] = ApiError(422, "Invalid", "bad port")
    with pytest.raises(ApiError):
        reconcile(kube)
    assert children(kube) == ["Deployment", "PodDisruptionBudget"]
    degraded = next(c for c in kube.status_writes[-1]["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "ApplyFailed" and "bad port" in degraded["message"]


@pytest.mark.parametrize(("error", "expected"), [(ApiError(422, "Invalid", "x"), kopf.PermanentError),
                                                 (ApiError(409, "Conflict", "x"), kopf.TemporaryError),
                                                 (ApiError(503, "ServiceUnavailable", "x"), kopf.TemporaryError)])
def test_api_errors_map_to_kopf_retry_policy(error: ApiError, expected: type[Exception]) -> None:
    kube = with_cr()
    kube.fail["Deployment"] = error
    with pytest.raises(expected):
        asyncio.run(handlers._reconcile_with_retry_policy("ns", "m", None, memo(kube), "update"))


def test_invalid_spec_is_permanent_and_reported() -> None:
    kube = with_cr(cr({"model": {"name": "m", "source": {}}}))
    with pytest.raises(kopf.PermanentError, match="exactly one of pvc"):
        reconcile(kube)
    assert children(kube) == []
    assert any(c["reason"] == "ApplyFailed" and "invalid spec" in c["message"]
               for c in kube.status_writes[0]["conditions"])


@pytest.mark.parametrize("case", ["gone", "being deleted", "replaced"])
def test_deleted_or_replaced_objects_are_left_to_garbage_collection(case: str) -> None:
    kube = FakeKube()
    if case != "gone":
        kube.objects["InferenceDeployment", "ns", "m"] = cr()
    if case == "being deleted":
        kube.objects["InferenceDeployment", "ns", "m"]["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    uid = "other-uid" if case == "replaced" else None
    assert asyncio.run(handlers.reconcile_object("ns", "m", memo(kube), uid=uid)) is None
    assert children(kube) == [] and not kube.status_writes


def test_reconcile_handler_posts_events(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[tuple[str, str]] = []
    monkeypatch.setattr(kopf, "event", lambda body, *, type, reason, message: events.append((type, reason)))
    kube = with_cr()
    kwargs: dict[str, Any] = {"body": cr(), "name": "m", "namespace": "ns", "uid": "u1", "memo": memo(kube)}
    asyncio.run(handlers.reconcile(reason="create", **kwargs))
    kube.fail["Deployment"] = ApiError(500, "InternalError", "x")
    with pytest.raises(kopf.TemporaryError):
        asyncio.run(handlers.reconcile(reason="update", **kwargs))
    assert events == [("Normal", "Applied"), ("Warning", "ReconcileRetrying")]


def _deployment_event(owner_uid: str = "u1") -> dict[str, Any]:
    return {"metadata": {"name": "m", "namespace": "ns", "ownerReferences": [
        {"apiVersion": "serving.kvfleet.dev/v1alpha1", "kind": "InferenceDeployment", "name": "m",
         "uid": owner_uid, "controller": True}]}}


def test_deployment_event_reconciles_its_owner() -> None:
    kube = with_cr()
    asyncio.run(handlers.deployment_changed(body=_deployment_event(), type="MODIFIED", memo=memo(kube),
                                            logger=logging.getLogger("test")))
    assert "Deployment" in children(kube) and len(kube.status_writes) == 1


@pytest.mark.parametrize("case", ["initial listing", "owner replaced", "not ours"])
def test_deployment_event_leaves_other_objects_alone(case: str) -> None:
    kube = with_cr()
    body = _deployment_event("other-uid" if case == "owner replaced" else "u1")
    if case == "not ours":
        body["metadata"]["ownerReferences"][0]["kind"] = "Something"
    asyncio.run(handlers.deployment_changed(body=body, type=None if case == "initial listing" else "DELETED",
                                            memo=memo(kube), logger=logging.getLogger("test")))
    assert children(kube) == [] and not kube.status_writes
