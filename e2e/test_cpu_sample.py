"""The local cluster's untainted CPU node, and manifests/samples/tiny-cpu.yaml served on it with no GPU."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from cluster import GPU_LABEL, GPU_RESOURCE, LocalCluster  # e2e/ on sys.path (conftest)
from operator_proc import REPO, SELECTOR, Operator, apply_cr, wait_ready

SAMPLE = REPO / "manifests" / "samples" / "tiny-cpu.yaml"


def test_the_cpu_node_is_ready_untainted_and_has_no_gpu(cluster: LocalCluster) -> None:
    assert cluster.cpu_node_names
    for name in cluster.cpu_node_names:
        node = cluster.kubectl_json("get", "node", name)
        assert not node["spec"].get("taints"), node["spec"]
        assert GPU_RESOURCE not in node["status"]["capacity"] and GPU_LABEL not in node["metadata"]["labels"]
        assert {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"] == "True"


def sample(namespace: str, model: Path) -> dict[str, Any]:
    """The sample as shipped, in `namespace`, its hostPath pointed at the tiny checkpoint (the only change: the sample
    expects one made by hand at /var/lib/kvfleet/models/tiny-llama on each node)."""
    body: dict[str, Any] = yaml.safe_load(SAMPLE.read_text())
    body["metadata"]["namespace"] = namespace
    body["spec"]["model"]["source"]["hostPath"]["path"] = str(model)
    return body


def test_tiny_cpu_sample_serves_on_the_cpu_node_without_a_gpu(cluster: LocalCluster, operator: Operator,
                                                               namespace: str, tiny_model: Path) -> None:
    body = sample(namespace, tiny_model)
    apply_cr(cluster, body)
    name = body["metadata"]["name"]
    wait_ready(cluster, namespace, name, 1)

    pods = [p for p in cluster.kubectl_json("get", "pods", "-n", namespace, "-l", f"{SELECTOR}={name}")["items"]
            if not p["metadata"].get("deletionTimestamp")]
    assert len(pods) == 1, [p["metadata"]["name"] for p in pods]
    pod = pods[0]
    assert pod["spec"]["nodeName"] in cluster.cpu_node_names
    resources = pod["spec"]["containers"][0]["resources"]
    assert GPU_RESOURCE not in resources.get("requests", {}) and GPU_RESOURCE not in resources.get("limits", {})
    assert resources["requests"] == {"cpu": "1", "memory": "2Gi"}  # the sample's, as written
    assert all(t.get("key") != GPU_RESOURCE for t in pod["spec"].get("tolerations", []))

    # Ready is the agent's /ready; it answers too.
    request = json.dumps({"model": body["spec"]["model"]["name"], "prompt": "Hello", "max_tokens": 4}).encode()
    with cluster.port_forward(pod["status"]["podIP"], 8000) as port:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", request,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            answer = json.loads(resp.read())
    assert answer["usage"]["completion_tokens"] >= 1, answer
