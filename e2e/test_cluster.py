"""End-to-end checks of the local control plane from e2e/cluster.py: API, fake GPU nodes, scheduling, GC."""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster import (  # e2e/ is not a package: imported via the sys.path entry above
    GPU_LABEL,
    GPU_RESOURCE,
    GPU_TAINT,
    GPU_TOLERATION,
    ApiError,
    ClusterError,
    LocalCluster,
    find_bin_dir,
)

T = TypeVar("T")
WAIT_S = 60.0
GPU_NODES = 2
GPUS_PER_NODE = 8


def _skip_reason() -> str | None:
    """Why these tests cannot run here (binaries not built and KVFLEET_BUILD_K8S unset), or None."""
    if os.environ.get("KVFLEET_BUILD_K8S"):
        return None  # the session fixture builds them (about 10 min cold)
    try:
        if find_bin_dir(build=False) is None:
            return ("control-plane binaries are not built: run `bash e2e/build.sh` (about 10 min) "
                    "or set KVFLEET_BUILD_K8S=1 to build them in the fixture")
    except ClusterError as exc:
        return f"cannot locate the control-plane binaries: {exc}"
    return None


_SKIP = _skip_reason()
pytestmark = [pytest.mark.cluster, pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")]


def wait_for(what: str, fn: Callable[[], T | None], timeout: float = WAIT_S) -> T:
    """Poll fn until it returns something truthy (returned); fail at the deadline with the last value seen."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while True:
        last = fn()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}")
        time.sleep(0.25)


@pytest.fixture(scope="session")
def cluster() -> Iterator[LocalCluster]:
    """One control plane for the session; KVFLEET_E2E_KEEP=1 keeps its run dir (logs) afterwards."""
    bin_dir = find_bin_dir(build=bool(os.environ.get("KVFLEET_BUILD_K8S")))
    assert bin_dir is not None
    c = LocalCluster(gpu_nodes=GPU_NODES, gpus_per_node=GPUS_PER_NODE, bin_dir=bin_dir,
                     keep=bool(os.environ.get("KVFLEET_E2E_KEEP")))
    c.start()
    print(f"\ncluster up in {c.timings['total']:.1f}s: {c.timings} (run dir {c.run_dir})")
    try:
        yield c
    finally:
        c.stop()


def namespace_gone(cluster: LocalCluster, name: str) -> bool:
    try:
        cluster.api("GET", f"/api/v1/namespaces/{name}")
    except ApiError as exc:
        return exc.status == 404
    return False


@pytest.fixture
def namespace(cluster: LocalCluster) -> Iterator[str]:
    """A fresh namespace; afterwards its pods are deleted (waited for, so they free their GPUs), then it is.

    The namespace itself is not waited for: the namespace controller holds every deletion for a fixed
    5 s grace period; test_namespace_deletion_completes covers it once.
    """
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "deployments,replicasets,pods", "--all", "-n", name, "--wait=false")
    wait_for(f"pods in {name} deleted", lambda: not cluster.kubectl_json("get", "pods", "-n", name)["items"])
    cluster.kubectl("delete", "namespace", name, "--wait=false")


def gpu_deployment(name: str, namespace: str, replicas: int, gpus: int) -> dict[str, Any]:
    """A Deployment whose pods each limit `gpus` nvidia.com/gpu and tolerate the GPU taint; image irrelevant."""
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "tolerations": [GPU_TOLERATION],
                    "nodeSelector": {GPU_LABEL: "true"},
                    "containers": [{
                        "name": "server",
                        "image": "registry.invalid/kvfleet/never-pulled:0",
                        "resources": {"limits": {GPU_RESOURCE: str(gpus)}},
                    }],
                },
            },
        },
    }


def apply(cluster: LocalCluster, obj: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(obj))


def pods(cluster: LocalCluster, namespace: str, selector: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = cluster.kubectl_json("get", "pods", "-n", namespace, "-l", selector)["items"]
    return items


def is_running_ready(pod: dict[str, Any]) -> bool:
    status = pod.get("status", {})
    conds = {c["type"]: c["status"] for c in status.get("conditions", [])}
    return status.get("phase") == "Running" and conds.get("Ready") == "True"


def wait_running(cluster: LocalCluster, namespace: str, selector: str, n: int) -> list[dict[str, Any]]:
    def ready() -> list[dict[str, Any]] | None:
        items = pods(cluster, namespace, selector)
        return items if len(items) == n and all(is_running_ready(p) for p in items) else None

    return wait_for(f"{n} pods {selector} Running and Ready", ready)


def test_apiserver_serves_and_lists_gpu_nodes(cluster: LocalCluster) -> None:
    assert cluster.api_text("GET", "/readyz") == "ok"
    assert cluster.api("GET", "/version")["gitVersion"].startswith("v1.")

    table = cluster.kubectl("get", "nodes").stdout  # the kubeconfig works for plain kubectl too
    for name in cluster.node_names:
        assert name in table

    nodes = {n["metadata"]["name"]: n for n in cluster.kubectl_json("get", "nodes")["items"]}
    assert sorted(nodes) == sorted(cluster.node_names)
    for node in nodes.values():
        assert node["metadata"]["labels"][GPU_LABEL] == "true"
        assert node["status"]["capacity"][GPU_RESOURCE] == str(GPUS_PER_NODE)
        assert node["status"]["allocatable"][GPU_RESOURCE] == str(GPUS_PER_NODE)
        assert GPU_TAINT in node["spec"]["taints"]
        conds = {c["type"]: c["status"] for c in node["status"]["conditions"]}
        assert conds["Ready"] == "True"


def test_gpu_deployment_pods_run_on_fake_gpu_nodes(cluster: LocalCluster, namespace: str) -> None:
    apply(cluster, gpu_deployment("gpu-app", namespace, replicas=3, gpus=4))
    running = wait_running(cluster, namespace, "app=gpu-app", 3)

    for pod in running:
        assert pod["spec"]["nodeName"] in cluster.node_names
        assert pod["status"].get("podIP"), pod["status"]
        assert pod["spec"]["containers"][0]["resources"]["requests"][GPU_RESOURCE] == "4"  # defaulted from limits
    # 8 GPUs per node and 4 per pod: the scheduler cannot put 3 pods on one node.
    assert len({p["spec"]["nodeName"] for p in running}) >= 2

    dep = wait_for("Deployment available", lambda: (
        d if (d := cluster.kubectl_json("get", "deployment", "gpu-app", "-n", namespace))["status"]
        .get("readyReplicas") == 3 else None))
    assert dep["status"]["availableReplicas"] == 3


def test_pods_beyond_gpu_capacity_stay_pending(cluster: LocalCluster, namespace: str) -> None:
    # 2 nodes x 8 GPUs: a third 8-GPU pod does not fit anywhere.
    apply(cluster, gpu_deployment("too-big", namespace, replicas=GPU_NODES + 1, gpus=GPUS_PER_NODE))

    def one_unschedulable() -> list[dict[str, Any]] | None:
        items = pods(cluster, namespace, "app=too-big")
        running = [p for p in items if is_running_ready(p)]
        pending = [
            p for p in items
            if any(c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable"
                   for c in p.get("status", {}).get("conditions", []))
        ]
        return items if len(running) == GPU_NODES and len(pending) == 1 else None

    items = wait_for("two pods running and one unschedulable", one_unschedulable)
    pending = next(p for p in items if not is_running_ready(p))
    message = next(c["message"] for c in pending["status"]["conditions"] if c["type"] == "PodScheduled")
    assert GPU_RESOURCE in message, message


def test_pod_without_gpu_toleration_is_not_scheduled(cluster: LocalCluster, namespace: str) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "no-toleration", "namespace": namespace, "labels": {"app": "no-toleration"}},
        "spec": {"containers": [{"name": "c", "image": "registry.invalid/kvfleet/never-pulled:0"}]},
    }
    apply(cluster, pod)

    def unschedulable() -> str | None:
        p = cluster.kubectl_json("get", "pod", "no-toleration", "-n", namespace)
        for c in p.get("status", {}).get("conditions", []):
            if c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable":
                return str(c["message"])
        return None

    message = wait_for("PodScheduled=False/Unschedulable", unschedulable)
    assert "untolerated taint" in message, message


def test_deleting_deployment_garbage_collects_replicaset_and_pods(cluster: LocalCluster, namespace: str) -> None:
    apply(cluster, gpu_deployment("gc-app", namespace, replicas=2, gpus=1))
    wait_running(cluster, namespace, "app=gc-app", 2)
    rs = cluster.kubectl_json("get", "replicasets", "-n", namespace, "-l", "app=gc-app")["items"]
    assert len(rs) == 1 and rs[0]["metadata"]["ownerReferences"][0]["kind"] == "Deployment"

    # Background propagation (kubectl's default): the Deployment goes at once; GC removes the
    # ReplicaSet, then the Pods (kwok's pod-delete stage finalizes pods marked for deletion).
    cluster.kubectl("delete", "deployment", "gc-app", "-n", namespace, "--wait=false")

    def all_gone() -> bool:
        left_rs = cluster.kubectl_json("get", "replicasets", "-n", namespace, "-l", "app=gc-app")["items"]
        return not left_rs and not pods(cluster, namespace, "app=gc-app")

    wait_for("ReplicaSet and Pods garbage-collected", all_gone)


def test_namespace_deletion_completes(cluster: LocalCluster) -> None:
    name = f"e2e-ns-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    cluster.kubectl("create", "configmap", "c", "-n", name, "--from-literal=k=v")
    cluster.kubectl("delete", "namespace", name, "--wait=false")
    wait_for(f"namespace {name} to be finalized", lambda: namespace_gone(cluster, name))
