"""An InferenceRouter's reconcile, its handlers and the grant sweep against the in-memory API: what is applied, in
which namespace, what is deleted (only ours), and the one status write."""

from __future__ import annotations

import asyncio
import copy
import logging
from typing import Any

import kopf
import pytest
from cr_helpers import memo, state
from fake_kube import FakeKube
from router_stub import RouterStub, router_pod

from kvfleet_operator import handlers
from kvfleet_operator import router_builders as rb
from kvfleet_operator.kube import ApiError
from kvfleet_operator.plan import ReconcileError
from kvfleet_operator.router_models import InferenceRouterStatus
from kvfleet_operator.router_reconcile import reconcile_router, release, sweep
from kvfleet_operator.state import OperatorState, TrackedRouter

GRANT = "kvfleet-router:ns:r"


def router(spec: dict[str, Any] | None = None, name: str = "r", uid: str = "u1") -> dict[str, Any]:
    return {"apiVersion": "serving.kvfleet.dev/v1alpha1", "kind": "InferenceRouter",
            "metadata": {"name": name, "namespace": "ns", "uid": uid, "generation": 2}, "spec": spec or {}}


def with_router(spec: dict[str, Any] | None = None) -> FakeKube:
    kube = FakeKube()
    kube.add(router(spec))
    return kube


def reconcile(kube: FakeKube, name: str = "r") -> bool:
    return asyncio.run(reconcile_router("ns", name, state(kube)))


def where(kube: FakeKube, kind: str) -> list[str]:
    return sorted(ns for k, ns, _ in kube.objects if k == kind)


def status(kube: FakeKube, name: str = "r") -> dict[str, Any]:
    return kube.objects["InferenceRouter", "ns", name]["status"]


def ready(kube: FakeKube) -> tuple[str, str]:
    [c] = status(kube)["conditions"]
    return c["status"], c["reason"]


def agents(kube: FakeKube, namespace: str, idp: str, model: str, ready_pods: int) -> None:
    kube.add({"kind": "InferenceDeployment", "metadata": {"name": idp, "namespace": namespace},
              "spec": {"model": {"name": model, "source": {"pvc": {"claimName": "c"}}}}})
    for i in range(ready_pods):
        kube.add({"kind": "Pod", "metadata": {"name": f"{idp}-{i}", "namespace": namespace, "labels": {
            "app.kubernetes.io/managed-by": "kvfleet-operator", "serving.kvfleet.dev/inference-deployment": idp}},
            "status": {"podIP": f"10.0.0.{i + 1}", "conditions": [{"type": "Ready", "status": "True"}]}})


def test_create_applies_everything_and_a_second_reconcile_changes_nothing() -> None:
    kube = with_router({"watchNamespaces": ["ns", "team-a"]})
    agents(kube, "team-a", "tiny", "tiny", 2)
    assert reconcile(kube)
    assert where(kube, "ServiceAccount") == where(kube, "Deployment") == where(kube, "Service") == ["ns"]
    assert where(kube, "PodDisruptionBudget") == ["ns"]
    assert where(kube, "Role") == where(kube, "RoleBinding") == ["ns", "team-a"]
    [written] = kube.status_writes
    InferenceRouterStatus.model_validate(written)
    assert written["models"] == [{"model": "tiny", "namespace": "team-a", "inferenceDeployment": "tiny",
                                  "readyEndpoints": 2}] and written["modelCount"] == 1
    assert ready(kube) == ("False", "RollingOut")
    before = copy.deepcopy(kube.objects)
    assert reconcile(kube)
    assert kube.objects == before and len(kube.status_writes) == 1 and kube.deleted == []


def test_the_status_follows_the_router_deployment() -> None:
    kube = with_router()
    reconcile(kube)
    kube.objects["Deployment", "ns", "r"]["status"] = {"observedGeneration": 1, "replicas": 1, "readyReplicas": 1,
                                                       "updatedReplicas": 1}
    reconcile(kube)
    assert ready(kube) == ("True", "AllReplicasReady")
    assert (status(kube)["replicas"], status(kube)["readyReplicas"], status(kube)["observedGeneration"]) == (1, 1, 2)


def test_a_namespace_left_out_loses_its_grants_and_a_new_one_gets_them() -> None:
    kube = with_router({"watchNamespaces": ["ns", "team-a"]})
    reconcile(kube)
    kube.objects["InferenceRouter", "ns", "r"]["spec"] = {"watchNamespaces": ["team-b"]}
    reconcile(kube)
    assert where(kube, "Role") == where(kube, "RoleBinding") == ["team-b"]
    assert sorted(kube.deleted) == [("Role", GRANT)] * 2 + [("RoleBinding", GRANT)] * 2  # in ns and team-a


def test_someone_elses_service_account_is_never_bound_nor_used() -> None:
    kube = with_router()
    kube.add({"kind": "ServiceAccount", "metadata": {"name": "r", "namespace": "ns"}})
    with pytest.raises(ReconcileError) as e:
        reconcile(kube)
    assert e.value.permanent and e.value.reason == "ResourceExists"
    assert where(kube, "RoleBinding") == where(kube, "Deployment") == [] and where(kube, "Role") == ["ns"]
    assert ready(kube) == ("False", "ResourceExists")


def test_a_refused_grant_keeps_its_binding_back_but_not_the_router() -> None:
    kube = with_router({"watchNamespaces": ["team-a"]})
    kube.fail["Role"] = ApiError(403, "Forbidden", "roles is forbidden in team-a")
    with pytest.raises(ReconcileError) as e:
        reconcile(kube)
    assert not e.value.permanent and "Role team-a/" + GRANT in e.value.message  # retried: RBAC may come
    assert where(kube, "RoleBinding") == [] and where(kube, "Deployment") == ["ns"]
    assert ready(kube) == ("False", "ApplyFailed")


def test_a_namespace_it_cannot_read_is_reported_and_retried() -> None:
    kube = with_router()
    kube.fail_list["Pod"] = ApiError(403, "Forbidden", "pods is forbidden")
    with pytest.raises(ReconcileError) as e:
        reconcile(kube)
    assert not e.value.permanent and e.value.reason == "ReadFailed"
    assert where(kube, "Deployment") == ["ns"] and ready(kube) == ("False", "ReadFailed")


def test_an_invalid_spec_writes_only_its_status() -> None:
    kube = with_router({"scrapeIntervalSeconds": 9})
    with pytest.raises(ReconcileError) as e:
        reconcile(kube)
    assert e.value.reason == "InvalidSpec" and [k for k, _, _ in kube.objects] == ["InferenceRouter"]
    assert ready(kube) == ("False", "InvalidSpec")


def test_a_gone_or_replaced_router_is_not_reconciled() -> None:
    assert not asyncio.run(reconcile_router("ns", "r", state(FakeKube())))
    assert not asyncio.run(reconcile_router("ns", "r", state(with_router()), uid="another"))


def test_release_and_sweep_delete_only_the_grants_of_routers_that_are_gone() -> None:
    kube = with_router({"watchNamespaces": ["ns", "team-a"]})
    kube.add(router({"watchNamespaces": ["team-a"]}, name="keep", uid="u2"))
    reconcile(kube)
    reconcile(kube, "keep")
    kube.add({"kind": "Role", "metadata": {"name": "kvfleet-router:ns:mine", "namespace": "team-a"}})  # a user's
    del kube.objects["InferenceRouter", "ns", "r"]
    asyncio.run(release(state(kube), "ns", "r"))
    assert ("Role", "team-a", GRANT) not in kube.objects and ("RoleBinding", "team-a", GRANT) not in kube.objects
    assert ("Role", "ns", GRANT) in kube.objects  # in its namespace: garbage collection's, with the owner
    assert ("Role", "team-a", "kvfleet-router:ns:keep") in kube.objects
    del kube.objects["InferenceRouter", "ns", "keep"]  # deleted while the operator was down
    asyncio.run(sweep(state(kube)))
    assert [name for k, ns, name in kube.objects if k in ("Role", "RoleBinding") and ns == "team-a"] == [
        "kvfleet-router:ns:mine"]


def test_the_router_handler_tracks_applies_and_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[tuple[str, str, str]] = []
    monkeypatch.setattr(kopf, "event", lambda body, *, type, reason, message: events.append((type, reason, message)))
    kube = with_router({"watchNamespaces": ["ns", "team-a"]})
    m = memo(kube)
    kwargs: dict[str, Any] = {"name": "r", "namespace": "ns", "uid": "u1", "memo": m}
    asyncio.run(handlers.reconcile_router(body=router({"watchNamespaces": ["ns", "team-a"]}), reason="create",
                                          **kwargs))
    assert OperatorState.of(m).routers == {("ns", "r"): TrackedRouter("u1", ("ns", "team-a"))}
    assert events == [("Normal", "Applied", "created: ServiceAccount, a Role and RoleBinding in ns, team-a, "
                                            "Deployment, Service, PodDisruptionBudget applied")]
    kube.fail["Service"] = ApiError(422, "Invalid", "bad")
    with pytest.raises(kopf.PermanentError):
        asyncio.run(handlers.reconcile_router(body=router(), reason="update", **kwargs))
    assert events[-1][:2] == ("Warning", "ReconcileFailed")


def _deployment_event(owner_kind: str, name: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "ownerReferences": [
        {"apiVersion": "serving.kvfleet.dev/v1alpha1", "kind": owner_kind, "name": name, "uid": "x",
         "controller": True}]}}


def test_deployment_events_reconcile_the_router_and_the_routers_serving_a_fleet() -> None:
    kube = with_router()
    m = memo(kube)
    log = logging.getLogger("test")
    asyncio.run(handlers.router_deployment_changed(body=_deployment_event("InferenceRouter", "r"), type="MODIFIED",
                                                   memo=m, logger=log))
    assert len(kube.status_writes) == 1
    agents(kube, "ns", "tiny", "tiny", 1)  # an agent became ready; its Deployment's event follows
    OperatorState.of(m).track_router("ns", "r", "u1", ("ns",))
    asyncio.run(handlers.deployment_changed(body=_deployment_event("InferenceDeployment", "tiny"), type="MODIFIED",
                                            memo=m, logger=log))
    assert status(kube)["models"][0]["readyEndpoints"] == 1
    OperatorState.of(m).track_router("ns", "r", "u1", ("elsewhere",))
    kube.objects["Pod", "ns", "tiny-0"]["status"]["conditions"][0]["status"] = "False"
    asyncio.run(handlers.deployment_changed(body=_deployment_event("InferenceDeployment", "tiny"), type="MODIFIED",
                                            memo=m, logger=log))
    assert status(kube)["models"][0]["readyEndpoints"] == 1  # a router not serving that namespace is left alone


def test_the_router_deletion_handler_forgets_and_releases() -> None:
    kube = with_router({"watchNamespaces": ["team-a"]})
    m = memo(kube)
    reconcile(kube)
    OperatorState.of(m).track_router("ns", "r", "u1", ("team-a",))
    del kube.objects["InferenceRouter", "ns", "r"]
    log = logging.getLogger("t")
    asyncio.run(handlers.router_deleted(type="MODIFIED", namespace="ns", name="r", uid="u1", memo=m, logger=log))
    assert OperatorState.of(m).routers  # any other event leaves it alone
    asyncio.run(handlers.router_deleted(type="DELETED", namespace="ns", name="r", uid="u1", memo=m, logger=log))
    assert not OperatorState.of(m).routers and where(kube, "Role") == where(kube, "RoleBinding") == []


def test_the_resync_reconciles_routers_and_sweeps() -> None:
    async def main() -> None:
        kube = with_router({"watchNamespaces": ["team-a"]})
        s = state(kube)
        s.track_router("ns", "r", "u1", ("team-a",))
        await s.resync()
        assert where(kube, "Role") == ["team-a"] and len(kube.status_writes) == 1
        del kube.objects["InferenceRouter", "ns", "r"]
        s.reconciled.clear()
        await s.resync()  # the router is gone: forgotten, and its grants swept
        assert not s.routers and where(kube, "Role") == []

    asyncio.run(main())


def test_the_requests_the_router_pods_hold_are_reported_per_inference_deployment() -> None:
    async def main() -> None:
        stub = RouterStub()  # the held-requests gauge as a router pod serves it
        await stub.start()
        try:
            kube = with_router()
            agents(kube, "ns", "cold", "llama", 0)
            agents(kube, "ns", "warm", "tiny", 1)
            pod = router_pod("r-0", stub.port)
            pod["metadata"]["labels"] = rb.selector_labels("r")
            kube.add(pod)
            kube.add({**router_pod("other-router", stub.port), "metadata": {"name": "x", "namespace": "ns"}})
            stub.hold(3, namespace="ns", name="cold", model="llama")
            await reconcile_router("ns", "r", state(kube))
            assert [(m["inferenceDeployment"], m.get("heldRequests")) for m in status(kube)["models"]] == [
                ("cold", 3), ("warm", 0)]
            assert stub.scrapes == 1  # this router's pods only
            stub.status = 503  # no router pod answers: nothing is claimed
            await reconcile_router("ns", "r", state(kube))
            assert all("heldRequests" not in m for m in status(kube)["models"])
        finally:
            await stub.stop()

    asyncio.run(main())
