"""The reconcile against an in-memory API: what it applies, ownership, the one status write, kopf retry policy."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import kopf
import pytest
from fake_kube import FakeKube

from kvfleet_operator import handlers
from kvfleet_operator.builders import args_config_map_name
from kvfleet_operator.config import OperatorConfig
from kvfleet_operator.kube import AUTOSCALER_MANAGER, ApiError
from kvfleet_operator.reconcile import ReconcileError
from kvfleet_operator.status import InferenceDeploymentStatus

SPEC: dict[str, Any] = {"model": {"name": "m", "source": {"pvc": {"claimName": "c"}}}, "replicas": 2}


def cr(spec: dict[str, Any] | None = None, status: dict[str, Any] | None = None, uid: str = "u1") -> dict[str, Any]:
    return {"apiVersion": "serving.kvfleet.dev/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": "m", "namespace": "ns", "uid": uid, "generation": 4},
            "spec": spec or SPEC, "status": status or {}}


def memo(kube: FakeKube) -> kopf.Memo:
    return kopf.Memo(cfg=OperatorConfig(), kube=kube, locks={})


def with_cr(body: dict[str, Any] | None = None) -> FakeKube:
    kube = FakeKube()
    kube.add(body or cr())
    return kube


def reconcile(kube: FakeKube, replicas: int | None = None) -> int | None:
    return asyncio.run(handlers.reconcile_object("ns", "m", memo(kube), replicas=replicas))


def children(kube: FakeKube) -> list[str]:
    return sorted(k for k, _, _ in kube.objects if k != "InferenceDeployment")


def stored_status(kube: FakeKube) -> dict[str, Any]:
    return kube.objects["InferenceDeployment", "ns", "m"]["status"]


def conds(kube: FakeKube) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in stored_status(kube)["conditions"]}


def foreign(kind: str, name: str = "m", owner: dict[str, Any] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": {"team": "theirs"}}
    if owner is not None:
        meta["ownerReferences"] = [owner]
    return {"apiVersion": "v1", "kind": kind, "metadata": meta, "spec": {"theirs": True}}


def test_create_applies_everything_and_writes_status_once() -> None:
    kube = with_cr()
    assert reconcile(kube) == 2
    assert children(kube) == ["Deployment", "PodDisruptionBudget", "Service"]
    assert kube.objects["Deployment", "ns", "m"]["spec"]["replicas"] == 2
    assert kube.deleted == []  # no args ConfigMap of ours to clean up: nothing deleted
    [status] = kube.status_writes
    assert (status["observedGeneration"], status["desiredReplicas"]) == (4, 2)
    assert {c["type"] for c in status["conditions"]} == {"Ready", "Available", "Progressing", "Degraded"}
    InferenceDeploymentStatus.model_validate(stored_status(kube))


def test_unchanged_status_is_not_rewritten_and_other_conditions_survive() -> None:
    kube = with_cr(cr({**SPEC, "autoscaling": {"mode": "builtin", "minReplicas": 2, "maxReplicas": 2,
                                               "targets": {"queueDepthPerReplica": 4}}}))
    reconcile(kube)
    kube._apply_status(("InferenceDeployment", "ns", "m"), {"conditions": [
        {"type": "ScalingActive", "status": "True", "reason": "x", "message": "",
         "lastTransitionTime": "2026-01-01T00:00:00Z"}]}, AUTOSCALER_MANAGER)
    reconcile(kube)
    assert len(kube.status_writes) == 1  # the autoscaler's condition does not count as a difference
    kube.objects["Deployment", "ns", "m"]["status"] = {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2,
                                                       "observedGeneration": 1}
    reconcile(kube)
    assert len(kube.status_writes) == 2
    assert {t: s for t, (s, _) in conds(kube).items()} == {
        "ScalingActive": "True", "Ready": "True", "Available": "True", "Progressing": "False", "Degraded": "False"}


def test_builtin_mode_keeps_the_live_replicas() -> None:
    spec = {**SPEC, "replicas": 9, "autoscaling": {"mode": "builtin", "minReplicas": 1, "maxReplicas": 5,
                                                   "targets": {"queueDepthPerReplica": 4}}}
    kube = with_cr(cr(spec))
    assert reconcile(kube) == 1  # created at minReplicas
    assert asyncio.run(handlers.apply_desired("ns", "m", memo(kube), 4)) == 4  # the autoscaler's hook
    assert reconcile(kube) == 4  # a later reconcile keeps it
    assert kube.objects["Deployment", "ns", "m"]["spec"]["replicas"] == 4


def test_leaving_builtin_mode_removes_the_autoscalers_status() -> None:
    kube = with_cr()
    reconcile(kube)
    kube._apply_status(("InferenceDeployment", "ns", "m"), {"autoscaling": {"lastTtftP95Seconds": 0.2}, "conditions": [
        {"type": "ScalingActive", "status": "True", "reason": "x", "message": "",
         "lastTransitionTime": "2026-01-01T00:00:00Z"}]}, AUTOSCALER_MANAGER)
    reconcile(kube)
    assert "autoscaling" not in stored_status(kube) and "ScalingActive" not in conds(kube)
    assert set(conds(kube)) == {"Ready", "Available", "Progressing", "Degraded"}


def test_apply_failure_still_applies_the_rest_and_reports_degraded() -> None:
    kube = with_cr()
    kube.fail["Service"] = ApiError(422, "Invalid", "bad port")
    with pytest.raises(ReconcileError) as e:
        reconcile(kube)
    assert e.value.permanent and e.value.reason == "ApplyFailed"
    assert children(kube) == ["Deployment", "PodDisruptionBudget"]
    assert conds(kube)["Degraded"] == ("True", "ApplyFailed") and conds(kube)["Ready"] == ("False", "ApplyFailed")
    assert "bad port" in next(c for c in stored_status(kube)["conditions"] if c["type"] == "Degraded")["message"]


@pytest.mark.parametrize("kind", ["Service", "PodDisruptionBudget", "Deployment"])
@pytest.mark.parametrize("owner", [None, {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "m", "uid": "x",
                                          "controller": True},
                                   {"apiVersion": "serving.kvfleet.dev/v1alpha1", "kind": "InferenceDeployment",
                                    "name": "other", "uid": "u9", "controller": True}])
def test_an_object_we_do_not_control_is_never_taken_over(kind: str, owner: dict[str, Any] | None,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    kube = with_cr()
    theirs = kube.add(foreign(kind, owner=owner))
    with pytest.raises(ReconcileError) as e:
        reconcile(kube)
    assert e.value.permanent and e.value.reason == "ResourceExists"
    assert kube.objects[kind, "ns", "m"] == theirs  # untouched: before, force=true adopted it
    assert conds(kube)["Degraded"] == ("True", "ResourceExists")
    message = next(c for c in stored_status(kube)["conditions"] if c["type"] == "Degraded")["message"]
    assert f"{kind} ns/m already exists" in message and "Delete or rename" in message
    assert len(children(kube)) == 3  # the other two are still applied
    # The kopf handler makes it a permanent failure with a Warning event named after the reason.
    events: list[tuple[str, str, str]] = []
    monkeypatch.setattr(kopf, "event", lambda body, *, type, reason, message: events.append((type, reason, message)))
    with pytest.raises(kopf.PermanentError):
        asyncio.run(handlers.reconcile(body=cr(), name="m", namespace="ns", uid="u1", reason="create",
                                       memo=memo(kube)))
    assert events[0][:2] == ("Warning", "ResourceExists") and f"{kind} ns/m" in events[0][2]


def test_the_args_config_map_is_deleted_only_when_ours() -> None:
    kube = with_cr()
    theirs = kube.add(foreign("ConfigMap", args_config_map_name("m")))
    reconcile(kube)
    assert kube.objects["ConfigMap", "ns", "m-args"] == theirs and kube.deleted == []
    long_args = {**SPEC, "runtime": {"extraArgs": ["--x=" + "y" * 1000] * 5}}
    kube = with_cr(cr(long_args))
    reconcile(kube)
    assert "ConfigMap" in children(kube)
    kube.objects["InferenceDeployment", "ns", "m"]["spec"] = SPEC  # short again: our ConfigMap goes
    reconcile(kube)
    assert kube.deleted == [("ConfigMap", "m-args")]


def test_a_foreign_args_config_map_keeps_the_deployment_from_mounting_it() -> None:
    kube = with_cr(cr({**SPEC, "runtime": {"extraArgs": ["--x=" + "y" * 1000] * 5}}))
    kube.add(foreign("ConfigMap", args_config_map_name("m")))
    with pytest.raises(ReconcileError, match="ConfigMap ns/m-args already exists"):
        reconcile(kube)
    assert "Deployment" not in children(kube)


def test_a_recreated_object_waits_for_garbage_collection_of_its_namesakes() -> None:
    kube = with_cr(cr(uid="new"))
    old_owner = {"apiVersion": "serving.kvfleet.dev/v1alpha1", "kind": "InferenceDeployment", "name": "m",
                 "uid": "old", "controller": True}
    old = kube.add({**foreign("Deployment", owner=old_owner), "apiVersion": "apps/v1"})
    with pytest.raises(kopf.TemporaryError) as e:  # before: 422 from the apiserver → PermanentError, stuck
        asyncio.run(handlers.run_reconcile("ns", "m", memo(kube), "create", uid="new"))
    assert e.value.delay == 5.0 and "garbage collection" in str(e.value)
    assert kube.objects["Deployment", "ns", "m"] == old
    assert conds(kube)["Degraded"] == ("True", "WaitingForGarbageCollection")
    # Garbage collection removes it; its DELETED event names the old owner uid, yet the new CR is reconciled.
    del kube.objects["Deployment", "ns", "m"]
    asyncio.run(handlers.deployment_changed(body=old, type="DELETED", memo=memo(kube),
                                            logger=logging.getLogger("test")))
    dep = kube.objects["Deployment", "ns", "m"]
    assert dep["metadata"]["ownerReferences"][0]["uid"] == "new" and conds(kube)["Degraded"][0] == "False"


@pytest.mark.parametrize(("error", "expected"), [(ApiError(422, "Invalid", "x"), kopf.PermanentError),
                                                 (ApiError(400, "BadRequest", "x"), kopf.PermanentError),
                                                 (ApiError(403, "Forbidden", "x"), kopf.TemporaryError),
                                                 (ApiError(404, "NotFound", "x"), kopf.TemporaryError),
                                                 (ApiError(409, "Conflict", "x"), kopf.TemporaryError),
                                                 (ApiError(503, "ServiceUnavailable", "x"), kopf.TemporaryError)])
def test_api_errors_map_to_kopf_retry_policy(error: ApiError, expected: type[Exception]) -> None:
    kube = with_cr()
    kube.fail["Deployment"] = error
    with pytest.raises(expected):
        asyncio.run(handlers.run_reconcile("ns", "m", memo(kube), "update"))


@pytest.mark.parametrize("error", [aiohttp.ClientConnectionError("connection reset"), TimeoutError(),
                                   aiohttp.ServerDisconnectedError(), aiohttp.ClientPayloadError()])
def test_network_failures_are_retried_with_backoff(error: BaseException) -> None:
    kube = with_cr()
    kube.broken = error  # before: these escaped the handler as unknown errors
    with pytest.raises(kopf.TemporaryError) as e:
        asyncio.run(handlers.run_reconcile("ns", "m", memo(kube), "update", retry=3))
    assert e.value.delay == 40.0  # 5 s doubled per retry


def test_invalid_spec_is_permanent_and_changes_only_degraded() -> None:
    kube = with_cr()
    reconcile(kube)
    before = dict(stored_status(kube))
    kube.objects["InferenceDeployment", "ns", "m"]["spec"] = {"model": {"name": "m", "source": {}}}
    with pytest.raises(ReconcileError, match="exactly one of pvc") as e:
        reconcile(kube)
    assert e.value.permanent and e.value.reason == "InvalidSpec"
    after = stored_status(kube)
    assert {k: after[k] for k in ("replicas", "readyReplicas", "desiredReplicas", "selector")} == {
        k: before[k] for k in ("replicas", "readyReplicas", "desiredReplicas", "selector")}  # an HPA reads these
    assert conds(kube)["Degraded"] == ("True", "InvalidSpec")


def test_only_the_spec_is_validated() -> None:
    status = {"replicas": 2, "someFieldOfANewerOperator": {"x": 1}, "conditions": []}
    kube = with_cr(cr(status=status))
    assert reconcile(kube) == 2  # before: the status model's extra="forbid" refused the whole object


@pytest.mark.parametrize("case", ["gone", "being deleted", "replaced"])
def test_deleted_or_replaced_objects_are_left_to_garbage_collection(case: str) -> None:
    kube = FakeKube()
    if case != "gone":
        kube.add(cr())
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


@pytest.mark.parametrize("owner_uid", ["u1", "uid-of-a-deleted-namesake"])
def test_deployment_event_reconciles_the_current_object_of_that_name(owner_uid: str) -> None:
    kube = with_cr()
    asyncio.run(handlers.deployment_changed(body=_deployment_event(owner_uid), type="MODIFIED", memo=memo(kube),
                                            logger=logging.getLogger("test")))
    assert "Deployment" in children(kube) and len(kube.status_writes) == 1


@pytest.mark.parametrize("case", ["initial listing", "not ours", "owner gone"])
def test_deployment_event_leaves_other_objects_alone(case: str) -> None:
    kube = with_cr() if case != "owner gone" else FakeKube()
    body = _deployment_event()
    if case == "not ours":
        body["metadata"]["ownerReferences"][0]["kind"] = "Something"
    asyncio.run(handlers.deployment_changed(body=body, type=None if case == "initial listing" else "DELETED",
                                            memo=memo(kube), logger=logging.getLogger("test")))
    assert children(kube) == [] and not kube.status_writes
