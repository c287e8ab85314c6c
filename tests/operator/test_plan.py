"""plan.make_plan() and Plan, pure: a CR and its children as read → writes and deletes with ownership verdicts, the
errors they carry and the status to write. No client, not even an in-memory one."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from kvfleet_operator.config import OperatorConfig
from kvfleet_operator.plan import Children, ReconcileError, child_keys, make_plan

SPEC: dict[str, Any] = {"model": {"name": "m", "source": {"pvc": {"claimName": "c"}}}, "replicas": 2}
BUILTIN = {**SPEC, "autoscaling": {"mode": "builtin", "minReplicas": 2, "maxReplicas": 5,
                                   "targets": {"queueDepthPerReplica": 4}}}
LONG_ARGS = {**SPEC, "runtime": {"extraArgs": ["--x=" + "y" * 1000] * 5}}
NOW = "2026-01-01T00:00:00Z"
CFG = OperatorConfig(agent_image="agent:test")


def cr(spec: dict[str, Any] | None = None, status: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"apiVersion": "serving.kvfleet.dev/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": "m", "namespace": "ns", "uid": "u1", "generation": 4},
            "spec": spec or SPEC, "status": status or {}}


def child(kind: str, name: str = "m", owner_uid: str | None = "u1", owner_kind: str = "InferenceDeployment",
          uid: str = "c1", **fields: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "ns", "uid": uid}
    if owner_uid is not None:
        meta["ownerReferences"] = [{"apiVersion": "serving.kvfleet.dev/v1alpha1", "kind": owner_kind, "name": "m",
                                    "uid": owner_uid, "controller": True}]
    return {"kind": kind, "metadata": meta, **fields}


def read(**found: dict[str, Any]) -> Children:
    """What the read phase found: `found` by kind, every other child absent."""
    return {key: found.get(key[0]) for key in child_keys("m")}


def verdicts(plan: Any) -> list[tuple[str, str]]:
    return [(w.key[0], w.owner.verdict) for w in plan.writes]


def test_the_children_to_read_are_every_object_the_plan_may_touch() -> None:
    assert child_keys("m") == (("ConfigMap", "m-args"), ("Deployment", "m"), ("Service", "m"),
                               ("PodDisruptionBudget", "m"), ("NetworkPolicy", "m-agents"))


def test_a_new_object_writes_everything_and_deletes_nothing_of_ours() -> None:
    body = cr()
    before = copy.deepcopy(body)
    plan = make_plan(body, read(), CFG, None)
    assert body == before  # pure: the input is left as it was
    assert plan.invalid is None and (plan.namespace, plan.name, plan.desired, plan.builtin) == ("ns", "m", 2, False)
    assert verdicts(plan) == [("Deployment", "absent"), ("Service", "absent"), ("PodDisruptionBudget", "absent"),
                              ("NetworkPolicy", "absent")]
    assert all(w.refusal is None for w in plan.writes)
    assert plan.writes[0].manifest["spec"]["template"]["spec"]["containers"][0]["image"] == "agent:test"
    [gone] = plan.deletes  # the args ConfigMap, not needed: there is none, so it is not ours to delete
    assert (gone.kind, gone.name, gone.ours, gone.owner.verdict) == ("ConfigMap", "m-args", False, "absent")
    assert plan.deployment is None and not plan.clears_autoscaler_status


@pytest.mark.parametrize(("owner_uid", "owner_kind", "verdict", "reason", "permanent"), [
    (None, "", "foreign", "ResourceExists", True),
    ("x", "ReplicaSet", "foreign", "ResourceExists", True),
    ("old", "InferenceDeployment", "previous", "WaitingForGarbageCollection", False)])
def test_a_namesake_we_do_not_control_is_refused_with_its_reason(owner_uid: str | None, owner_kind: str,
                                                                 verdict: str, reason: str, permanent: bool) -> None:
    plan = make_plan(cr(), read(Service=child("Service", owner_uid=owner_uid, owner_kind=owner_kind)), CFG, None)
    assert verdicts(plan) == [("Deployment", "absent"), ("Service", verdict), ("PodDisruptionBudget", "absent"),
                              ("NetworkPolicy", "absent")]
    refusal = plan.writes[1].refusal
    assert isinstance(refusal, ReconcileError)
    assert (refusal.reason, refusal.permanent) == (reason, permanent) and "Service ns/m" in refusal.message


def test_our_live_deployment_is_reported_and_keeps_the_autoscalers_replicas() -> None:
    live = child("Deployment", spec={"replicas": 4}, status={"readyReplicas": 4})
    plan = make_plan(cr(BUILTIN), read(Deployment=live), CFG, None)
    assert plan.builtin and plan.desired == 4 and plan.deployment == live
    assert plan.writes[0].manifest["spec"]["replicas"] == 4 and plan.writes[0].owner.verdict == "ours"
    assert make_plan(cr(BUILTIN), read(Deployment=live), CFG, 5).desired == 5  # the autoscaler's decision
    assert make_plan(cr(BUILTIN), read(Deployment=child("Deployment", spec={"replicas": 9})), CFG, None).desired == 5
    # Someone else's Deployment of that name tells nothing about the replicas, nor is it reported.
    theirs = make_plan(cr(BUILTIN), read(Deployment=child("Deployment", owner_uid=None, spec={"replicas": 4})),
                       CFG, None)
    assert theirs.desired == 2 and theirs.deployment is None


def test_the_deployment_needs_the_args_config_map_applied_first() -> None:
    plan = make_plan(cr(LONG_ARGS), read(), CFG, None)
    assert [w.key for w in plan.writes] == [("ConfigMap", "m-args"), ("Deployment", "m"), ("Service", "m"),
                                            ("PodDisruptionBudget", "m"), ("NetworkPolicy", "m-agents")]
    assert plan.writes[1].needs == (("ConfigMap", "m-args"),) and plan.writes[2].needs == ()
    assert plan.deletes == ()


def test_only_our_config_map_is_deleted_and_only_that_very_object() -> None:
    ours = make_plan(cr(), read(ConfigMap=child("ConfigMap", "m-args", uid="cm-7")), CFG, None)
    assert [(d.kind, d.name, d.uid, d.ours) for d in ours.deletes] == [("ConfigMap", "m-args", "cm-7", True)]
    theirs = make_plan(cr(), read(ConfigMap=child("ConfigMap", "m-args", owner_uid=None)), CFG, None)
    assert [d.ours for d in theirs.deletes] == [False]


def test_the_network_policy_admits_the_configured_operator_namespace_and_goes_when_disabled() -> None:
    cfg = OperatorConfig(agent_image="agent:test", operator_namespace="ops")
    [policy] = [w.manifest for w in make_plan(cr(), read(), cfg, None).writes if w.key[0] == "NetworkPolicy"]
    operator_peer = policy["spec"]["ingress"][1]["from"][0]
    assert operator_peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "ops"}}
    off = {**SPEC, "networkPolicy": {"enabled": False}}
    ours = make_plan(cr(off), read(NetworkPolicy=child("NetworkPolicy", "m-agents", uid="np-3")), cfg, None)
    assert "NetworkPolicy" not in {w.key[0] for w in ours.writes}
    assert [(d.kind, d.name, d.uid, d.ours) for d in ours.deletes if d.kind == "NetworkPolicy"] == [
        ("NetworkPolicy", "m-agents", "np-3", True)]
    # A NetworkPolicy of that name someone else wrote is theirs: never deleted, never overwritten.
    theirs = make_plan(cr(off), read(NetworkPolicy=child("NetworkPolicy", "m-agents", owner_uid=None)), cfg, None)
    assert [d.ours for d in theirs.deletes if d.kind == "NetworkPolicy"] == [False]
    refused = make_plan(cr(), read(NetworkPolicy=child("NetworkPolicy", "m-agents", owner_uid=None)), cfg, None)
    assert [w.owner.verdict for w in refused.writes if w.key[0] == "NetworkPolicy"] == ["foreign"]


def test_the_status_follows_the_deployment_and_the_first_error() -> None:
    plan = make_plan(cr(), read(), CFG, None)
    ok = plan.status(deployment=None, errors=(), now=NOW)
    assert (ok["observedGeneration"], ok["desiredReplicas"], ok["selector"]) == (
        4, 2, "serving.kvfleet.dev/inference-deployment=m,app.kubernetes.io/managed-by=kvfleet-operator")
    errors = [ReconcileError("ResourceExists", "Service ns/m already exists", permanent=True),
              ReconcileError("ApplyFailed", "PodDisruptionBudget m: 422", permanent=True)]
    degraded = {c["type"]: c for c in plan.status(deployment=None, errors=errors, now=NOW)["conditions"]}["Degraded"]
    assert (degraded["status"], degraded["reason"], degraded["message"]) == (
        "True", "ResourceExists", "Service ns/m already exists")


def test_an_unchanged_status_is_not_written_again() -> None:
    first = make_plan(cr(), read(), CFG, None)
    status = first.status_to_write(deployment=None, errors=(), now=NOW)
    assert status is not None
    again = make_plan(cr(status=status), read(), CFG, None)
    assert again.status_to_write(deployment=None, errors=(), now="2026-01-02T00:00:00Z") is None
    assert again.status_to_write(deployment={"status": {"replicas": 1}}, errors=(), now=NOW) is not None


def test_an_invalid_spec_plans_only_its_status() -> None:
    current = {"replicas": 2, "readyReplicas": 2, "desiredReplicas": 2, "selector": "s", "conditions": []}
    plan = make_plan(cr({"model": {"name": "m", "source": {}}}, status=current), read(), CFG, None)
    assert plan.invalid is not None and plan.invalid.permanent and plan.invalid.reason == "InvalidSpec"
    assert "exactly one of pvc" in plan.invalid.message and plan.writes == () and plan.deletes == ()
    status = plan.status_to_write(deployment=None, errors=(), now=NOW)
    assert status is not None and {k: status[k] for k in ("replicas", "readyReplicas", "selector")} == {
        "replicas": 2, "readyReplicas": 2, "selector": "s"}  # an HPA reads these
    assert [(c["type"], c["reason"]) for c in status["conditions"]] == [("Degraded", "InvalidSpec")]
    assert not plan.clears_autoscaler_status


def test_only_the_spec_is_validated() -> None:
    plan = make_plan(cr(status={"someFieldOfANewerOperator": {"x": 1}}), read(), CFG, None)
    assert plan.invalid is None and plan.desired == 2


@pytest.mark.parametrize(("spec", "status", "clears"), [
    (SPEC, {"autoscaling": {"lastTtftP95Seconds": 0.2}}, True),
    (SPEC, {"conditions": [{"type": "ScalingActive", "status": "True"}]}, True),
    (SPEC, {"conditions": [{"type": "Ready", "status": "True"}]}, False),
    (BUILTIN, {"autoscaling": {"lastTtftP95Seconds": 0.2}}, False)])
def test_the_autoscalers_status_is_cleared_once_builtin_autoscaling_is_off(spec: dict[str, Any],
                                                                            status: dict[str, Any],
                                                                            clears: bool) -> None:
    assert make_plan(cr(spec, status), read(), CFG, None).clears_autoscaler_status is clears
