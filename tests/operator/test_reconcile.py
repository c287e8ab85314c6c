"""The reconcile against an in-memory API: what it reads and applies, ownership, the one status write."""

from __future__ import annotations

import asyncio
from typing import Any

import kopf
import pytest
from cr_helpers import SPEC, children, conds, cr, foreign, memo, state, stored_status, with_cr
from fake_kube import FakeKube

from kvfleet_operator import handlers, metrics
from kvfleet_operator.builders import args_config_map_name
from kvfleet_operator.kube import AUTOSCALER_MANAGER, ApiError
from kvfleet_operator.plan import ReconcileError
from kvfleet_operator.reconcile import apply_desired, reconcile_object
from kvfleet_operator.status import InferenceDeploymentStatus


def reconcile(kube: FakeKube, replicas: int | None = None) -> int | None:
    return asyncio.run(reconcile_object("ns", "m", state(kube), replicas=replicas))


def test_create_applies_everything_and_writes_status_once() -> None:
    kube = with_cr()
    assert reconcile(kube) == 2
    assert children(kube) == ["Deployment", "NetworkPolicy", "PodDisruptionBudget", "Service"]
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
    assert asyncio.run(apply_desired("ns", "m", state(kube), 4)) == 4  # the autoscaler's hook
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
    assert children(kube) == ["Deployment", "NetworkPolicy", "PodDisruptionBudget"]
    assert conds(kube)["Degraded"] == ("True", "ApplyFailed") and conds(kube)["Ready"] == ("False", "ApplyFailed")
    assert "bad port" in next(c for c in stored_status(kube)["conditions"] if c["type"] == "Degraded")["message"]


@pytest.mark.parametrize(("kind", "name"), [("Service", "m"), ("PodDisruptionBudget", "m"), ("Deployment", "m"),
                                          ("NetworkPolicy", "m-agents")])
@pytest.mark.parametrize("owner", [None, {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "m", "uid": "x",
                                          "controller": True},
                                   {"apiVersion": "serving.kvfleet.dev/v1alpha1", "kind": "InferenceDeployment",
                                    "name": "other", "uid": "u9", "controller": True}])
def test_an_object_we_do_not_control_is_never_taken_over(kind: str, name: str, owner: dict[str, Any] | None,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    kube = with_cr()
    theirs = kube.add(foreign(kind, name, owner=owner))
    with pytest.raises(ReconcileError) as e:
        reconcile(kube)
    assert e.value.permanent and e.value.reason == "ResourceExists"
    assert kube.objects[kind, "ns", name] == theirs  # untouched: before, force=true adopted it
    assert conds(kube)["Degraded"] == ("True", "ResourceExists")
    message = next(c for c in stored_status(kube)["conditions"] if c["type"] == "Degraded")["message"]
    assert f"{kind} ns/{name} already exists" in message and "Delete or rename" in message
    assert len(children(kube)) == 4  # the other three are still applied
    # The kopf handler makes it a permanent failure with a Warning event named after the reason.
    events: list[tuple[str, str, str]] = []
    monkeypatch.setattr(kopf, "event", lambda body, *, type, reason, message: events.append((type, reason, message)))
    with pytest.raises(kopf.PermanentError):
        asyncio.run(handlers.reconcile(body=cr(), name="m", namespace="ns", uid="u1", reason="create",
                                       memo=memo(kube)))
    assert events[0][:2] == ("Warning", "ResourceExists") and f"{kind} ns/{name}" in events[0][2]


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


def test_the_network_policy_is_removed_when_disabled_and_only_when_ours() -> None:
    kube = with_cr()
    reconcile(kube)
    assert ("NetworkPolicy", "ns", "m-agents") in kube.objects
    kube.objects["InferenceDeployment", "ns", "m"]["spec"] = {**SPEC, "networkPolicy": {"enabled": False}}
    reconcile(kube)
    assert kube.deleted == [("NetworkPolicy", "m-agents")] and "NetworkPolicy" not in children(kube)
    kube = with_cr(cr({**SPEC, "networkPolicy": {"enabled": False}}))
    theirs = kube.add(foreign("NetworkPolicy", "m-agents"))
    reconcile(kube)
    assert kube.objects["NetworkPolicy", "ns", "m-agents"] == theirs and kube.deleted == []


def test_a_foreign_args_config_map_keeps_the_deployment_from_mounting_it() -> None:
    kube = with_cr(cr({**SPEC, "runtime": {"extraArgs": ["--x=" + "y" * 1000] * 5}}))
    kube.add(foreign("ConfigMap", args_config_map_name("m")))
    with pytest.raises(ReconcileError, match="ConfigMap ns/m-args already exists"):
        reconcile(kube)
    assert "Deployment" not in children(kube)


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
    assert asyncio.run(reconcile_object("ns", "m", state(kube), uid=uid)) is None
    assert children(kube) == [] and not kube.status_writes




def test_reads_the_cr_then_each_child_once_and_records_the_reconcile() -> None:
    kube = with_cr()
    s = state(kube)
    assert asyncio.run(reconcile_object("ns", "m", s)) == 2
    assert kube.reads == [("InferenceDeployment", "m"), ("ConfigMap", "m-args"), ("Deployment", "m"),
                          ("Service", "m"), ("PodDisruptionBudget", "m"), ("NetworkPolicy", "m-agents")]
    assert set(s.reconciled) == {"u1"}
    kube.fail["Service"] = ApiError(500, "InternalError", "x")
    s.reconciled.clear()
    with pytest.raises(ReconcileError):
        asyncio.run(reconcile_object("ns", "m", s))
    assert not s.reconciled  # only a reconcile that reached the desired state counts for the resync's skip


def test_metrics_count_refused_writes_and_report_the_desired_replicas() -> None:
    def applied_errors(kind: str) -> float:
        return metrics.REGISTRY.get_sample_value("kvfleet_operator_apply_errors_total", {"kind": kind}) or 0.0

    kube = with_cr()
    kube.add(foreign("Service"))
    before = applied_errors("Service")
    with pytest.raises(ReconcileError):
        reconcile(kube)
    assert applied_errors("Service") == before + 1
    assert metrics.REGISTRY.get_sample_value("kvfleet_operator_desired_replicas",
                                             {"namespace": "ns", "name": "m", "reason": "spec"}) == 2
