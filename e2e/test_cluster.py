"""End-to-end checks of the local control plane from e2e/cluster.py: API, fake GPU nodes, scheduling, GC."""

from __future__ import annotations

import uuid
from typing import Any

from cluster import GPU_LABEL, GPU_RESOURCE, GPU_TAINT, GPU_TOLERATION, LocalCluster  # e2e/ on sys.path (conftest)
from kube_util import GPU_NODES, GPUS_PER_NODE, apply, is_running_ready, namespace_gone, pods, wait_for, wait_running


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


def test_apiserver_serves_and_lists_gpu_nodes(cluster: LocalCluster) -> None:
    assert cluster.api_text("GET", "/readyz") == "ok"
    assert cluster.api("GET", "/version")["gitVersion"].startswith("v1.")

    table = cluster.kubectl("get", "nodes").stdout  # the kubeconfig works for plain kubectl too
    for name in cluster.node_names:
        assert name in table

    nodes = {n["metadata"]["name"]: n for n in cluster.kubectl_json("get", "nodes")["items"]}
    assert sorted(nodes) == sorted(cluster.node_names + cluster.cpu_node_names)  # the CPU node: test_cpu_sample.py
    for node in (nodes[name] for name in cluster.node_names):
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
        # Asking for a GPU node (the CPU node, untainted, would take it otherwise) without tolerating its taint.
        "spec": {"nodeSelector": {GPU_LABEL: "true"},
                 "containers": [{"name": "c", "image": "registry.invalid/kvfleet/never-pulled:0"}]},
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
