"""The API key from a Secret and the agents' NetworkPolicy, on the real control plane with real agents behind them."""

from __future__ import annotations

import json
import secrets
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from cluster import LocalCluster
from kube_util import is_running_ready, pods, wait_for
from operator_proc import READY_S, SELECTOR, Operator, apply_cr, inference_deployment, wait_ready

NAME = "guarded"
POLICY = f"{NAME}-agents"


def http_status(port: int, path: str, key: str | None = None) -> tuple[int, Any]:
    """GET path on a forwarded agent port, with `Authorization: Bearer key` if given: (status, JSON body or None)."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            text = resp.read().decode()
            return resp.status, json.loads(text) if path.startswith("/v1/") else None
    except urllib.error.HTTPError as e:
        return e.code, None


def ready_pod(cluster: LocalCluster, namespace: str, not_uids: tuple[str, ...] = ()) -> dict[str, Any]:
    """The one Running and Ready agent pod of NAME whose uid is not in not_uids (a rollout replaced the others)."""
    def one() -> dict[str, Any] | None:
        ps = [p for p in pods(cluster, namespace, f"{SELECTOR}={NAME}") if is_running_ready(p)]
        fresh = [p for p in ps if p["metadata"]["uid"] not in not_uids]
        return fresh[0] if len(ps) == 1 and fresh else None

    return wait_for(f"one fresh ready pod of {NAME}", one, timeout=READY_S)


def check_key(cluster: LocalCluster, pod: dict[str, Any], good: str, bad: str) -> None:
    """/v1 answers 401 without the key or with another one and 200 with it; probes and metrics need none."""
    with cluster.port_forward(pod["status"]["podIP"], 8000) as port:
        assert http_status(port, "/v1/models")[0] == 401
        assert http_status(port, "/v1/models", bad)[0] == 401
        status, models = http_status(port, "/v1/models", good)
        assert status == 200 and [m["id"] for m in models["data"]] == ["tiny"], models
        for open_path in ("/health", "/ready", "/metrics"):
            assert http_status(port, open_path)[0] == 200, open_path


def test_api_key_from_a_secret_and_the_network_policy(cluster: LocalCluster, operator: Operator, namespace: str,
                                                      tiny_model: Path) -> None:
    first, rotated = secrets.token_hex(16), secrets.token_hex(16)
    cluster.kubectl("create", "secret", "generic", "tiny-api-key", "-n", namespace, f"--from-literal=api-key={first}",
                    f"--from-literal=rotated={rotated}")
    cluster.kubectl("create", "configmap", "agent-settings", "-n", namespace, "--from-literal=log-level=INFO")
    env = [{"name": "KVFLEET_LOG_LEVEL", "valueFrom": {"configMapKeyRef": {"name": "agent-settings",
                                                                           "key": "log-level"}}},
           {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
           {"name": "NOTE", "value": "served by $(POD_NAME)"}]
    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    body = inference_deployment(NAME, namespace, tiny_model, pod={"env": env},
                                auth={"apiKeySecretRef": {"name": "tiny-api-key", "key": "api-key"}},
                                networkPolicy={"from": [monitoring]})
    apply_cr(cluster, body)
    cr = wait_ready(cluster, namespace, NAME, 1)  # Ready: the probes pass without the key

    # The pod spec carries a reference to the Secret, never the key; the env overrides are rendered as written.
    deployment = cluster.kubectl_json("get", "deployment", NAME, "-n", namespace)
    assert first not in json.dumps(deployment) and first not in json.dumps(cr)
    rendered = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    assert rendered[1:] == [{"name": "KVFLEET_API_KEY", "valueFrom": {"secretKeyRef": {"name": "tiny-api-key",
                                                                                      "key": "api-key"}}},
                            *env[:1], {"name": "POD_NAME", "valueFrom": {"fieldRef": {
                                "apiVersion": "v1", "fieldPath": "metadata.name"}}}, env[2]]
    pod = ready_pod(cluster, namespace)
    check_key(cluster, pod, first, rotated)

    # The NetworkPolicy: rendered, accepted by the apiserver and owned like the other children. This cluster has
    # no network plugin, so nothing enforces it here: its shape is what is checked.
    policy = cluster.kubectl_json("get", "networkpolicy", POLICY, "-n", namespace)
    ref = policy["metadata"]["ownerReferences"][0]
    assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (
        "InferenceDeployment", NAME, cr["metadata"]["uid"], True)
    live = cluster.api("GET", f"/apis/networking.k8s.io/v1/namespaces/{namespace}/networkpolicies/{POLICY}")
    assert "kvfleet-operator" in {m["manager"] for m in live["metadata"]["managedFields"]}
    spec = policy["spec"]
    assert spec["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert spec["policyTypes"] == ["Ingress"]
    clients, operator_rule = spec["ingress"]
    assert clients["from"] == [{"podSelector": {"matchLabels": {"serving.kvfleet.dev/client": "true"}}}, monitoring]
    assert {p["port"] for p in clients["ports"]} == {8000, 50051}
    assert operator_rule["from"][0]["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "kvfleet-operator"}}
    assert [p["port"] for p in operator_rule["ports"]] == [8000]  # /metrics only

    # Another key of the Secret: the config hash changes, the pods roll, and only the new key opens /v1.
    body["spec"]["auth"]["apiKeySecretRef"]["key"] = "rotated"
    apply_cr(cluster, body)
    new_pod = ready_pod(cluster, namespace, (pod["metadata"]["uid"],))
    wait_ready(cluster, namespace, NAME, 1)
    check_key(cluster, new_pod, rotated, first)

    # Opting out removes the NetworkPolicy, and only it: the pods do not roll for it.
    body["spec"]["networkPolicy"] = {"enabled": False}
    apply_cr(cluster, body)
    wait_for("the NetworkPolicy deleted", lambda: not cluster.kubectl_json(
        "get", "networkpolicies", "-n", namespace, "-l", f"{SELECTOR}={NAME}")["items"], timeout=60)
    assert [p["metadata"]["uid"] for p in pods(cluster, namespace, f"{SELECTOR}={NAME}")] == [
        new_pod["metadata"]["uid"]]
