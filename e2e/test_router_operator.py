"""InferenceRouters on the real control plane: the CRD's rules, the objects the operator applies for one (and only
those, idempotently), the router pod run by the process kubelet under its ServiceAccount's bound token until it is
Ready, least-privilege RBAC seen through `kubectl auth can-i`, grants in other namespaces, and garbage collection."""

from __future__ import annotations

import json
import re
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster import LocalCluster
from gpu_nodes import GPU_TOLERATION
from kube_util import is_running_ready, pods, wait_for
from operator_proc import READY_S, Operator, apply_cr, condition, inference_deployment, wait_ready
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

# e2e/ is type-checked on its own (`cd e2e && mypy --strict *.py`), without the project's mypy_path.
from kvfleet_operator.router_models import InferenceRouter  # type: ignore[import-not-found]

API = "/apis/serving.kvfleet.dev/v1alpha1"
CRD = "inferencerouters.serving.kvfleet.dev"
ROUTER_PODS = "app.kubernetes.io/name=kvfleet-router"
OWNED = ("serviceaccount", "role", "rolebinding", "deployment", "service", "poddisruptionbudget")


def router(name: str, namespace: str, **spec: Any) -> dict[str, Any]:
    """An InferenceRouter whose pods tolerate the fake GPU nodes' taint (the only nodes here)."""
    return {"apiVersion": "serving.kvfleet.dev/v1alpha1", "kind": "InferenceRouter",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"pod": {"tolerations": [GPU_TOLERATION]}, **spec}}


def get_router(cluster: LocalCluster, namespace: str, name: str) -> dict[str, Any]:
    result: dict[str, Any] = cluster.api("GET", f"{API}/namespaces/{namespace}/inferencerouters/{name}")
    return result


def children(cluster: LocalCluster, namespace: str, name: str) -> dict[str, dict[str, Any]]:
    """The router's objects in its namespace that exist, by kind (its grant is named kvfleet-router:NS:NAME)."""
    grant = f"kvfleet-router:{namespace}:{name}"
    found = {}
    for kind in OWNED:
        proc = cluster.kubectl("get", kind, grant if kind.startswith("role") else name, "-n", namespace, "-o",
                               "json", "--show-managed-fields", check=False)
        if proc.returncode == 0:
            found[kind] = json.loads(proc.stdout)
    return found


def versions(objs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What a write of ours would change: the resourceVersion (the generation of a Deployment or PDB, whose
    controllers write their status) and the operator's managed-fields entry (its time moves with each change)."""
    def ours(obj: dict[str, Any]) -> list[dict[str, Any]]:
        return [m for m in obj["metadata"]["managedFields"] if m["manager"] == "kvfleet-operator"]

    status_written = ("deployment", "poddisruptionbudget")
    return {kind: (obj["metadata"]["generation" if kind in status_written else "resourceVersion"], ours(obj))
            for kind, obj in objs.items()}


def can(cluster: LocalCluster, account: str, *args: str) -> bool:
    return cluster.kubectl("auth", "can-i", *args, f"--as={account}", check=False).stdout.strip() == "yes"


def reconciles(cluster: LocalCluster, operator: Operator, trigger: str) -> float:
    """The operator's count of successful router reconciles by `trigger`, from its /metrics in the pod network."""
    assert operator.proc is not None
    port = re.findall(r"health and metrics on port (\d+)", operator.proc.log.read_text(errors="replace"))[-1]
    code = f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{port}/metrics').read().decode())"
    text = cluster.exec_in_pod_network(sys.executable, "-c", code).stdout
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "kvfleet_operator_reconciles_total" and s.labels == {"trigger": f"router-{trigger}",
                                                                                  "result": "ok"})


@pytest.fixture
def routers(cluster: LocalCluster, operator: Operator, namespace: str) -> Iterator[list[str]]:
    """The router CRD established; afterwards the routers of the namespace and of the namespaces the test added
    are deleted first (else the operator would bring back what the namespace teardown deletes)."""
    wait_for(f"{CRD} established", lambda: any(
        c["type"] == "Established" and c["status"] == "True"
        for c in cluster.kubectl_json("get", "crd", CRD).get("status", {}).get("conditions", [])), timeout=30)
    extra: list[str] = []
    yield extra
    for ns in (namespace, *extra):
        cluster.kubectl("delete", "inferencerouters", "--all", "-n", ns, "--wait=true", check=False)
    for ns in extra:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


INVALID: list[tuple[str, dict[str, Any], str]] = [
    ("negative epsilon", {"epsilon": -0.5}, "spec.epsilon is the bounded-load slack"),
    ("scrape interval above 5 s", {"scrapeIntervalSeconds": 10}, "spec.scrapeIntervalSeconds must be > 0 and <= 5"),
    ("zero scrape interval", {"scrapeIntervalSeconds": 0}, "spec.scrapeIntervalSeconds must be > 0 and <= 5"),
    ("hold queue too large", {"holdQueue": {"size": 200000}}, "spec.holdQueue.size must be between 0 and 100000"),
    ("hold timeout zero", {"holdQueue": {"timeoutSeconds": 0}}, "spec.holdQueue.timeoutSeconds must be > 0"),
    ("a namespace twice", {"watchNamespaces": ["a", "b", "a"]}, "spec.watchNamespaces lists a namespace twice"),
    ("not a namespace name", {"watchNamespaces": ["Team_A"]}, "spec.watchNamespaces items must be namespace names"),
    ("reserved pod label", {"pod": {"labels": {"app.kubernetes.io/instance": "x"}}}, "spec.pod.labels must not set"),
    ("negative replicas", {"replicas": -1}, "spec.replicas"),
    ("bad quantity", {"resources": {"requests": {"cpu": "lots"}}}, "must be Kubernetes quantities"),
]
AGREE: list[dict[str, Any]] = [
    {}, {"epsilon": 0}, {"epsilon": 100}, {"epsilon": 100.5}, {"scrapeIntervalSeconds": 5},
    {"scrapeIntervalSeconds": 0.001}, {"holdQueue": {"size": 0, "timeoutSeconds": 3600}},
    {"holdQueue": {"size": 100001}}, {"holdQueue": {"timeoutSeconds": 3600.5}}, {"watchNamespaces": ["a-1", "1"]},
    {"watchNamespaces": ["a-"]}, {"watchNamespaces": ["x" * 63]}, {"pod": {"labels": {"team": "a"}}},
    {"pod": {"labels": {"serving.kvfleet.dev/client": "true"}}}, {"replicas": 100}, {"replicas": 101},
]


@pytest.mark.parametrize(("case", "spec", "expected"), INVALID, ids=[c[0] for c in INVALID])
def test_apiserver_refuses_invalid_routers(cluster: LocalCluster, namespace: str, routers: list[str], case: str,
                                           spec: dict[str, Any], expected: str) -> None:
    proc = apply_cr(cluster, router("bad", namespace, **spec), check=False)
    assert proc.returncode != 0, f"{case}: accepted"
    assert expected in proc.stderr, f"{case}: {proc.stderr}"


def test_the_apiserver_and_the_models_agree_and_the_crd_prints(cluster: LocalCluster, namespace: str,
                                                                routers: list[str]) -> None:
    disagree = []
    bodies = [router("agree", namespace, **spec) for spec in AGREE] + [router("front.v2", namespace)]
    for body in bodies:
        server = cluster.kubectl("apply", "--server-side", "--dry-run=server", "--field-manager=e2e-user", "-f", "-",
                                 stdin=json.dumps(body), check=False)
        try:
            InferenceRouter.model_validate(body)
            models = True
        except ValidationError:
            models = False
        if (server.returncode == 0) != models:
            disagree.append(f"{body['metadata']['name']} {body['spec']}: apiserver "
                            f"{'accepts' if server.returncode == 0 else 'refuses'} ({server.stderr.strip()[-300:]})")
    assert not disagree, "\n".join(disagree)
    version = cluster.kubectl_json("get", "crd", CRD)["spec"]["versions"][0]
    assert [c["name"] for c in version["additionalPrinterColumns"]] == ["Ready", "Replicas", "Models", "Age"]
    # `spec` may be left out: the apiserver defaults it, and every field in it.
    body = {"apiVersion": "serving.kvfleet.dev/v1alpha1", "kind": "InferenceRouter",
            "metadata": {"name": "bare", "namespace": namespace}}
    out = cluster.kubectl("apply", "--server-side", "--dry-run=server", "--field-manager=e2e-user", "-o", "json",
                          "-f", "-", stdin=json.dumps(body))
    assert json.loads(out.stdout)["spec"]["holdQueue"] == {"size": 256, "timeoutSeconds": 120}


def _running_router(cluster: LocalCluster, namespace: str) -> dict[str, Any] | None:
    ps = [p for p in pods(cluster, namespace, ROUTER_PODS) if is_running_ready(p)]
    return ps[0] if len(ps) == 1 else None


def test_lifecycle_of_an_inference_router(cluster: LocalCluster, operator: Operator, namespace: str,
                                          routers: list[str], tiny_model: Path) -> None:
    """Applied → its objects, owned and least-privilege; its pod Ready under its own bound token; the status counts
    the fleet's ready endpoints; a second apply and a healed drift write nothing else; deleted → all gone."""
    apply_cr(cluster, inference_deployment("tiny", namespace, tiny_model))
    apply_cr(cluster, router("front", namespace))
    cr = get_router(cluster, namespace, "front")
    objs = wait_for("the router's objects", lambda: (found if len(found := children(cluster, namespace, "front"))
                                                     == len(OWNED) else None), timeout=30)
    for kind, obj in objs.items():
        [ref] = obj["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (
            "InferenceRouter", "front", cr["metadata"]["uid"], True), kind
        assert "kvfleet-operator" in {m["manager"] for m in obj["metadata"]["managedFields"]}, kind
    assert objs["service"]["spec"]["type"] == "ClusterIP" and objs["service"]["spec"]["ports"][0]["port"] == 8080

    # The process kubelet runs the router pod; it is Ready once its discovery has listed the namespace.
    pod = wait_for("the router pod Running and Ready", lambda: _running_router(cluster, namespace), timeout=READY_S)
    assert any(e["pod"] == f"{namespace}/{pod['metadata']['name']}" for e in cluster.agent_processes().values())
    assert pod["spec"]["serviceAccountName"] == "front" and pod["metadata"]["labels"]["serving.kvfleet.dev/client"]
    wait_ready(cluster, namespace, "tiny", 1)

    def ready() -> dict[str, Any] | None:
        cr = get_router(cluster, namespace, "front")
        st, cond = cr.get("status", {}), condition(cr, "Ready")
        ok = (cond is not None and cond["status"] == "True" and st.get("readyReplicas") == 1
              and st.get("observedGeneration") == cr["metadata"]["generation"]
              and [(m.get("readyEndpoints"), m.get("heldRequests")) for m in st.get("models", [])] == [(1, 0)])
        return cr if ok else None

    # heldRequests 0: the operator scraped the router pod's held gauge (present when nothing is held).
    cr = wait_for("the router Ready, seeing 1 endpoint of tiny", ready, timeout=READY_S)
    assert cr["status"]["models"] == [{"model": "tiny", "namespace": namespace, "inferenceDeployment": "tiny",
                                       "readyEndpoints": 1, "heldRequests": 0}] and cr["status"]["modelCount"] == 1
    assert "MODELS" in cluster.kubectl("get", "ir", "front", "-n", namespace).stdout
    code = f"import urllib.request; print(urllib.request.urlopen('http://{pod['status']['podIP']}:8080/v1/models'" \
           ", timeout=10).read().decode())"
    listed = cluster.exec_in_pod_network(sys.executable, "-c", code)
    assert listed.returncode == 0 and "tiny" in {m["id"] for m in json.loads(listed.stdout)["data"]}, listed.stderr

    # Least privilege: read pods and InferenceDeployments here, nothing else, nowhere else.
    account = f"system:serviceaccount:{namespace}:front"
    for verb in ("get", "list", "watch"):
        assert can(cluster, account, verb, "pods", "-n", namespace)
        assert can(cluster, account, verb, "inferencedeployments.serving.kvfleet.dev", "-n", namespace)
    assert not can(cluster, account, "get", "secrets", "-n", namespace)
    assert not can(cluster, account, "create", "pods", "-n", namespace)
    assert not can(cluster, account, "patch", "inferencedeployments.serving.kvfleet.dev", "-n", namespace)
    assert not can(cluster, account, "list", "pods", "-n", "default")
    # The token the process kubelet requested is one the pod's node may request itself, and no other node.
    node, others = pod["spec"]["nodeName"], [n for n in cluster.node_names if n != pod["spec"]["nodeName"]]

    def node_token(as_node: str) -> int:
        return cluster.kubectl("create", "token", "front", "-n", namespace, "--bound-object-kind=Pod",
                               f"--bound-object-name={pod['metadata']['name']}",
                               f"--bound-object-uid={pod['metadata']['uid']}", f"--as=system:node:{as_node}",
                               "--as-group=system:nodes", "--as-group=system:authenticated", check=False).returncode

    assert node_token(node) == 0 and all(node_token(n) != 0 for n in others)

    # Idempotent: the same apply changes nothing; drift is healed and nothing else is written.
    before, cr_version = versions(children(cluster, namespace, "front")), cr["metadata"]["resourceVersion"]
    apply_cr(cluster, router("front", namespace))
    assert get_router(cluster, namespace, "front")["metadata"]["resourceVersion"] == cr_version
    cluster.kubectl("scale", "deployment", "front", "-n", namespace, "--replicas=2")
    wait_for("the hand-scaled router Deployment reverted", lambda: cluster.kubectl_json(
        "get", "deployment", "front", "-n", namespace)["spec"]["replicas"] == 1, timeout=30)
    after = versions(children(cluster, namespace, "front"))
    assert {k: v for k, v in after.items() if k != "deployment"} == {
        k: v for k, v in before.items() if k != "deployment"}
    # Once settled, a reconcile writes not even the status: a change of the fleet's Deployment triggers one.
    settled = wait_for("the router settled at 1 pod", lambda: (cr if len(pods(cluster, namespace, ROUTER_PODS)) == 1
                       and (cr := ready()) and cr["status"]["replicas"] == 1 else None), timeout=60)
    count = reconciles(cluster, operator, "fleet")
    cluster.kubectl("annotate", "deployment", "tiny", "-n", namespace, "e2e/touched=1")
    wait_for("a router reconcile after the fleet's Deployment changed",
             lambda: reconciles(cluster, operator, "fleet") > count, timeout=30)
    assert get_router(cluster, namespace, "front")["metadata"]["resourceVersion"] == \
        settled["metadata"]["resourceVersion"]
    assert versions(children(cluster, namespace, "front")) == after

    cluster.kubectl("delete", "inferencerouter", "front", "-n", namespace, "--wait=false")
    wait_for("the router's objects garbage-collected", lambda: not children(cluster, namespace, "front")
             and not pods(cluster, namespace, ROUTER_PODS), timeout=90)


def test_grants_follow_the_watched_namespaces(cluster: LocalCluster, namespace: str, routers: list[str]) -> None:
    """Another namespace gets a Role and RoleBinding without an owner reference (garbage collection would delete
    one at once); it loses them when left out, and when the router is deleted."""
    other = f"e2e-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", other)
    routers.append(other)
    grant, account = f"kvfleet-router:{namespace}:edge", f"system:serviceaccount:{namespace}:edge"

    def grants(ns: str) -> list[dict[str, Any]]:
        found = []
        for kind in ("role", "rolebinding"):
            proc = cluster.kubectl("get", kind, grant, "-n", ns, "-o", "json", check=False)
            if proc.returncode == 0:
                found.append(json.loads(proc.stdout))
        return found

    apply_cr(cluster, router("edge", namespace, replicas=0, watchNamespaces=[namespace, other]))
    there = wait_for(f"grants in {other}", lambda: found if len(found := grants(other)) == 2 else None, timeout=30)
    assert all("ownerReferences" not in g["metadata"] for g in there)
    assert can(cluster, account, "watch", "pods", "-n", other)
    assert not can(cluster, account, "delete", "pods", "-n", other)
    apply_cr(cluster, router("edge", namespace, replicas=0, watchNamespaces=[namespace]))
    wait_for(f"grants in {other} deleted", lambda: not grants(other), timeout=30)
    assert len(grants(namespace)) == 2 and not can(cluster, account, "list", "pods", "-n", other)
    apply_cr(cluster, router("edge", namespace, replicas=0, watchNamespaces=[other]))
    wait_for(f"grants in {other} only", lambda: len(grants(other)) == 2 and not grants(namespace), timeout=30)
    cluster.kubectl("delete", "inferencerouter", "edge", "-n", namespace, "--wait=false")
    wait_for(f"grants in {other} deleted with the router", lambda: not grants(other), timeout=30)


def test_a_foreign_service_account_is_neither_bound_nor_used(cluster: LocalCluster, namespace: str,
                                                             routers: list[str]) -> None:
    cluster.kubectl("create", "serviceaccount", "mine", "-n", namespace)
    apply_cr(cluster, router("mine", namespace))

    def refused() -> dict[str, Any] | None:
        cond = condition(get_router(cluster, namespace, "mine"), "Ready")
        return cond if cond is not None and cond["reason"] == "ResourceExists" else None

    cond = wait_for("Ready=False ResourceExists", refused, timeout=30)
    assert cond["status"] == "False" and "ServiceAccount" in cond["message"]
    objs = children(cluster, namespace, "mine")
    assert "rolebinding" not in objs and "deployment" not in objs  # nothing runs as, or grants to, their account
    assert "ownerReferences" not in objs["serviceaccount"]["metadata"]  # and it is left as it was
