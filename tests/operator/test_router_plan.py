"""router_plan, pure: an InferenceRouter and what was read → writes with ownership verdicts, deletes of grants it no
longer needs, the endpoints it reports and the one status write. No client, not even an in-memory one."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from kvfleet_operator.config import OperatorConfig
from kvfleet_operator.router_models import MAX_MODELS, InferenceRouter
from kvfleet_operator.router_plan import Fleet, RouterRead, child_keys, endpoints, make_plan, orphans

NOW = "2026-01-01T00:00:00Z"
CFG = OperatorConfig(router_image="router:test")
GRANT = "kvfleet-router:ns:r"
OURS = {"app.kubernetes.io/managed-by": "kvfleet-operator", "serving.kvfleet.dev/inference-router": "r",
        "serving.kvfleet.dev/inference-router-namespace": "ns"}


def body(spec: dict[str, Any] | None = None, status: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"apiVersion": "serving.kvfleet.dev/v1alpha1", "kind": "InferenceRouter",
            "metadata": {"name": "r", "namespace": "ns", "uid": "u1", "generation": 3},
            "spec": spec if spec is not None else {}, "status": status or {}}


def child(kind: str, namespace: str = "ns", name: str = "r", owner_uid: str | None = "u1", uid: str = "c1",
          labels: dict[str, str] | None = None, **fields: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "uid": uid, "labels": labels or {}}
    if owner_uid is not None:
        meta["ownerReferences"] = [{"apiVersion": "serving.kvfleet.dev/v1alpha1", "kind": "InferenceRouter",
                                    "name": "r", "uid": owner_uid, "controller": True}]
    return {"kind": kind, "metadata": meta, **fields}


def read(spec: dict[str, Any] | None = None, grants: tuple[dict[str, Any], ...] = (),
         fleets: dict[str, Fleet] | None = None, found: dict[tuple[str, str], dict[str, Any]] | None = None,
         ) -> RouterRead:
    """What the read phase found: `found` by (kind, namespace), every other child absent."""
    cr = InferenceRouter.model_validate(body(spec))
    children = {key: (found or {}).get(key[:2]) for key in child_keys(cr)}
    return RouterRead(children, grants, fleets if fleets is not None else {ns: Fleet() for ns in cr.watched})


def verdicts(plan: Any) -> list[tuple[str, str, str]]:
    return [(*w.key[:2], w.owner.verdict) for w in plan.writes]


def test_a_new_router_writes_everything_in_order_and_deletes_nothing() -> None:
    spec = {"watchNamespaces": ["ns", "team-a"]}
    b = body(spec)
    before = copy.deepcopy(b)
    plan = make_plan(b, read(spec), CFG)
    assert b == before  # pure: the input is left as it was
    assert plan.invalid is None and (plan.namespace, plan.name, plan.desired) == ("ns", "r", 1)
    assert verdicts(plan) == [("ServiceAccount", "ns", "absent"), ("Role", "ns", "absent"),
                              ("RoleBinding", "ns", "absent"), ("Role", "team-a", "absent"),
                              ("RoleBinding", "team-a", "absent"), ("Deployment", "ns", "absent"),
                              ("Service", "ns", "absent"), ("PodDisruptionBudget", "ns", "absent")]
    assert all(w.refusal is None for w in plan.writes) and plan.deletes == () and plan.deployment is None
    deployment = next(w.manifest for w in plan.writes if w.key[0] == "Deployment")
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "router:test"


def test_bindings_and_pods_wait_for_our_service_account_and_role() -> None:
    plan = make_plan(body(), read(), CFG)
    needs = {w.key: w.needs for w in plan.writes}
    sa = ("ServiceAccount", "ns", "r")
    assert needs["RoleBinding", "ns", GRANT] == (sa, ("Role", "ns", GRANT))
    assert needs["Deployment", "ns", "r"] == (sa,)
    assert needs["Role", "ns", GRANT] == needs["Service", "ns", "r"] == ()


@pytest.mark.parametrize(("owner_uid", "verdict", "reason", "permanent"), [
    (None, "foreign", "ResourceExists", True), ("old", "previous", "WaitingForGarbageCollection", False)])
def test_a_namesake_in_the_routers_namespace_is_refused_with_its_reason(owner_uid: str | None, verdict: str,
                                                                         reason: str, permanent: bool) -> None:
    plan = make_plan(body(), read(found={("ServiceAccount", "ns"): child("ServiceAccount", owner_uid=owner_uid)}), CFG)
    write = plan.writes[0]
    assert (write.key, write.owner.verdict) == (("ServiceAccount", "ns", "r"), verdict)
    assert write.refusal is not None and (write.refusal.reason, write.refusal.permanent) == (reason, permanent)
    assert "ServiceAccount ns/r" in write.refusal.message and "InferenceRouter" in write.refusal.message


@pytest.mark.parametrize(("labels", "owner_uid", "verdict"), [
    (OURS, None, "ours"),  # ours, written without an owner reference (none can cross namespaces)
    ({}, None, "foreign"),  # someone's Role of that name
    ({**OURS, "serving.kvfleet.dev/inference-router-namespace": "other"}, None, "foreign"),  # another router's
    (OURS, "someone", "foreign")])  # our labels, but another controller
def test_grants_in_other_namespaces_are_ours_by_their_labels(labels: dict[str, str], owner_uid: str | None,
                                                              verdict: str) -> None:
    spec = {"watchNamespaces": ["team-a"]}
    live = child("Role", "team-a", GRANT, owner_uid=owner_uid, labels=labels)
    plan = make_plan(body(spec), read(spec, found={("Role", "team-a"): live}), CFG)
    [role] = [w for w in plan.writes if w.key == ("Role", "team-a", GRANT)]
    assert role.owner.verdict == verdict
    if verdict == "foreign":
        assert role.refusal is not None and role.refusal.permanent and "Role team-a/" + GRANT in role.refusal.message


def test_our_live_deployment_is_reported_and_someone_elses_is_not() -> None:
    live = child("Deployment", spec={"replicas": 1}, status={"readyReplicas": 1})
    assert make_plan(body(), read(found={("Deployment", "ns"): live}), CFG).deployment == live
    theirs = child("Deployment", owner_uid=None)
    assert make_plan(body(), read(found={("Deployment", "ns"): theirs}), CFG).deployment is None


def test_grants_of_namespaces_no_longer_watched_are_deleted_when_ours() -> None:
    spec = {"watchNamespaces": ["team-a"]}
    grants = (child("Role", "team-b", GRANT, owner_uid=None, labels=OURS, uid="g1"),  # dropped namespace
              child("RoleBinding", "ns", GRANT, labels=OURS, uid="g2"),  # its own namespace, no longer watched
              child("Role", "ns", GRANT, owner_uid="old", labels=OURS, uid="g3"),  # a deleted namesake's: GC's
              child("Role", "team-c", GRANT, owner_uid=None, labels={}, uid="g4"),  # not ours
              child("Role", "team-a", GRANT, owner_uid=None, labels=OURS, uid="g5"))  # still watched
    plan = make_plan(body(spec), read(spec, grants), CFG)
    assert [(d.kind, d.namespace, d.name, d.uid) for d in plan.deletes] == [
        ("Role", "team-b", GRANT, "g1"), ("RoleBinding", "ns", GRANT, "g2")]


def _pod(idp: str, ready: bool = True, ip: str = "10.0.0.1", terminating: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": f"{idp}-pod", "labels": {"serving.kvfleet.dev/inference-deployment": idp}}
    if terminating:
        meta["deletionTimestamp"] = NOW
    return {"metadata": meta, "status": {"podIP": ip, "conditions": [{"type": "Ready",
                                                                       "status": "True" if ready else "False"}]}}


def _idp(name: str, model: str, deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if deleting:
        meta["deletionTimestamp"] = NOW
    return {"metadata": meta, "spec": {"model": {"name": model}}}


def test_endpoints_count_ready_agent_pods_per_inference_deployment() -> None:
    fleets = {"b": Fleet([_idp("llama", "llama-8b"), _idp("gone", "x", deleting=True)],
                         [_pod("llama"), _pod("llama"), _pod("llama", ready=False), _pod("llama", ip=""),
                          _pod("llama", terminating=True), _pod("gone")]),
              "a": Fleet([_idp("tiny", "tiny"), _idp("llama", "llama-8b")], [_pod("tiny")])}
    models, count = endpoints(fleets)
    assert models == [
        {"model": "llama-8b", "namespace": "a", "inferenceDeployment": "llama", "readyEndpoints": 0},
        {"model": "llama-8b", "namespace": "b", "inferenceDeployment": "llama", "readyEndpoints": 2},
        {"model": "tiny", "namespace": "a", "inferenceDeployment": "tiny", "readyEndpoints": 1}]
    assert count == 2  # distinct model names: what a client can ask for


def test_endpoints_are_listed_up_to_the_status_bound_and_counted_in_full() -> None:
    idps = [_idp(f"m{i:04d}", f"model-{i:04d}") for i in range(MAX_MODELS + 5)]
    models, count = endpoints({"a": Fleet(idps)})
    assert len(models) == MAX_MODELS and count == MAX_MODELS + 5


def test_the_status_reports_the_deployment_models_and_the_first_error() -> None:
    fleets = {"ns": Fleet([_idp("tiny", "tiny")], [_pod("tiny")])}
    plan = make_plan(body(), read(fleets=fleets), CFG)
    dep = {"metadata": {"generation": 1}, "status": {"observedGeneration": 1, "replicas": 1, "readyReplicas": 1,
                                                     "updatedReplicas": 1}}
    ok = plan.status(deployment=dep, errors=(), now=NOW)
    assert {k: ok[k] for k in ("observedGeneration", "replicas", "readyReplicas", "modelCount")} == {
        "observedGeneration": 3, "replicas": 1, "readyReplicas": 1, "modelCount": 1}
    assert ok["models"][0]["readyEndpoints"] == 1
    [ready] = ok["conditions"]
    assert (ready["type"], ready["status"], ready["reason"], ready["observedGeneration"]) == (
        "Ready", "True", "AllReplicasReady", 3)
    starting = plan.status(deployment=None, errors=(), now=NOW)["conditions"][0]
    assert (starting["status"], starting["reason"]) == ("False", "RollingOut")
    theirs = child("ServiceAccount", owner_uid=None)
    refused = make_plan(body(), read(found={("ServiceAccount", "ns"): theirs}), CFG)
    first = refused.writes[0].refusal
    assert first is not None
    failed = refused.status(deployment=dep, errors=[first], now=NOW)["conditions"][0]
    assert (failed["status"], failed["reason"]) == ("False", "ResourceExists") and "ServiceAccount ns/r" in \
        failed["message"]


def test_a_namespace_that_cannot_be_read_makes_the_router_not_ready() -> None:
    spec = {"watchNamespaces": ["ns", "locked"]}
    fleets = {"ns": Fleet([_idp("tiny", "tiny")], [_pod("tiny")]), "locked": Fleet(error="403 Forbidden: no")}
    plan = make_plan(body(spec), read(spec, fleets=fleets), CFG)
    [error] = plan.read_errors
    assert error.reason == "ReadFailed" and not error.permanent and "namespace locked: 403" in error.message
    assert plan.model_count == 1  # the readable namespace still counts
    ready = plan.status(deployment=None, errors=(), now=NOW)["conditions"][0]
    assert (ready["status"], ready["reason"]) == ("False", "ReadFailed")


def test_an_unchanged_status_is_not_written_again_and_keeps_its_transition_time() -> None:
    first = make_plan(body(), read(), CFG).status_to_write(deployment=None, errors=(), now=NOW)
    assert first is not None
    again = make_plan(body(status=first), read(), CFG)
    assert again.status_to_write(deployment=None, errors=(), now="2026-01-02T00:00:00Z") is None
    fleets = {"ns": Fleet([_idp("tiny", "tiny")], [_pod("tiny")])}
    moved = make_plan(body(status=first), read(fleets=fleets), CFG).status_to_write(
        deployment=None, errors=(), now="2026-01-02T00:00:00Z")
    assert moved is not None and moved["modelCount"] == 1
    assert moved["conditions"][0]["lastTransitionTime"] == NOW  # Ready did not flip


def test_an_invalid_spec_plans_only_its_status_and_keeps_the_counts() -> None:
    current = {"replicas": 2, "readyReplicas": 2, "modelCount": 1, "conditions": []}
    plan = make_plan(body({"epsilon": -1}, status=current), RouterRead({}), CFG)
    assert plan.invalid is not None and plan.invalid.permanent and plan.invalid.reason == "InvalidSpec"
    assert "spec.epsilon" in plan.invalid.message and plan.writes == () and plan.deletes == ()
    status = plan.status_to_write(deployment=None, errors=(), now=NOW)
    assert status is not None and (status["replicas"], status["readyReplicas"], status["modelCount"]) == (2, 2, 1)
    assert [(c["type"], c["reason"]) for c in status["conditions"]] == [("Ready", "InvalidSpec")]


def test_orphans_are_the_grants_of_routers_that_are_gone() -> None:
    gone = {**OURS, "serving.kvfleet.dev/inference-router": "gone"}
    grants = [child("Role", "team-a", "kvfleet-router:ns:gone", owner_uid=None, labels=gone, uid="o1"),
              child("RoleBinding", "team-a", "kvfleet-router:ns:gone", owner_uid=None, labels=gone, uid="o2"),
              child("Role", "ns", "kvfleet-router:ns:gone", owner_uid="old", labels=gone, uid="o3"),  # GC's
              child("Role", "team-a", GRANT, owner_uid=None, labels=OURS, uid="o4"),  # its router exists
              child("Role", "team-b", "kvfleet-router:ns:gone", owner_uid=None, labels={}, uid="o5")]  # not ours
    deletes = orphans(grants, {("ns", "gone"): False, ("ns", "r"): True})
    assert [(d.kind, d.namespace, d.uid) for d in deletes] == [("Role", "team-a", "o1"),
                                                               ("RoleBinding", "team-a", "o2")]
    assert orphans(grants, {}) == []  # a router nobody looked up is not taken for gone
