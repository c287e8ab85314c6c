"""Scale to zero on the real control plane: the apiserver takes minReplicas 0 and enforces the idle window's rule;
an idle fleet, with a kvfleet-router answering, goes to zero once the window has passed, and its status says why."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cluster import LocalCluster
from gpu_nodes import GPU_TOLERATION
from kube_util import pods, wait_for, wait_running
from operator_proc import SELECTOR, Operator, apply_cr, condition, get_cr, inference_deployment, wait_ready

INTERVAL_S = 5
IDLE_S = 10  # spec.autoscaling.scaleToZeroAfterSeconds
ROUTER_SELECTOR = "app.kubernetes.io/name=kvfleet-router"


def router_pod(namespace: str) -> dict[str, Any]:
    """A kvfleet-router with a static endpoint: it answers /metrics with its held-requests gauge and holds nothing
    for any InferenceDeployment, so the autoscaler may take one to zero (a fleet no router fronts stays at one)."""
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "router", "namespace": namespace, "labels": {"app.kubernetes.io/name": "kvfleet-router"}},
        "spec": {
            "automountServiceAccountToken": False, "tolerations": [GPU_TOLERATION],
            "containers": [{
                "name": "router", "image": "kvfleet-router:e2e", "command": ["kvfleet-router"],
                "args": ["--endpoint", "static=http://127.0.0.1:9", "--host", "0.0.0.0", "--port", "8080"],
                "ports": [{"name": "http", "containerPort": 8080}],
                "readinessProbe": {"httpGet": {"path": "/metrics", "port": "http"}, "periodSeconds": 1}}],
        },
    }


def autoscaling(**extra: Any) -> dict[str, Any]:
    return {"mode": "builtin", "minReplicas": 0, "maxReplicas": 2, "intervalSeconds": INTERVAL_S,
            "windowSeconds": 20, "scaleToZeroAfterSeconds": IDLE_S, "targets": {"queueDepthPerReplica": 4},
            "behavior": {"scaleDown": {"stabilizationWindowSeconds": 0}}, **extra}


def test_an_idle_fleet_goes_to_zero_after_the_window_and_says_why(cluster: LocalCluster, operator: Operator,
                                                                   namespace: str, tiny_model: Path) -> None:
    # The CEL rule, as the apiserver runs it: a window shorter than a round cannot be observed.
    short = inference_deployment("short", namespace, tiny_model,
                                 autoscaling=autoscaling(intervalSeconds=30, scaleToZeroAfterSeconds=20))
    refused = apply_cr(cluster, short, check=False)
    assert refused.returncode != 0 and "scaleToZeroAfterSeconds must be >= intervalSeconds" in refused.stderr

    apply_cr(cluster, router_pod(namespace))
    wait_running(cluster, namespace, ROUTER_SELECTOR, 1)
    name = "idle"
    apply_cr(cluster, inference_deployment(name, namespace, tiny_model, autoscaling=autoscaling()))
    wait_ready(cluster, namespace, name, 1)  # minReplicas 0 still starts one replica

    def deployment_replicas() -> int:
        return int(cluster.kubectl_json("get", "deployment", name, "-n", namespace)["spec"]["replicas"])

    # Two rounds to read the request counters twice, the idle window, a round to notice: well under a minute.
    wait_for("the scale to zero", lambda: deployment_replicas() == 0, timeout=4 * INTERVAL_S + IDLE_S + 30)

    def decision_to_zero() -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
        # The replicas are applied first, then the decision is written to status (a moment later).
        history = get_cr(cluster, namespace, name).get("status", {}).get("autoscaling", {}).get("history", [])
        found = next((h for h in history if h["desiredReplicas"] == 0), None)
        return (history, found) if found is not None else None

    history, to_zero = wait_for("the decision to zero in status", decision_to_zero, timeout=2 * INTERVAL_S)
    assert to_zero["reason"].startswith("idle for ") and "scale-to-zero window 10s" in to_zero["reason"], history
    assert "none held at 1 router" in to_zero["reason"], history
    idle_for = float(to_zero["reason"].removeprefix("idle for ").split("s", 1)[0])
    assert idle_for >= IDLE_S, to_zero
    events = cluster.kubectl_json("get", "events", "-n", namespace, "--field-selector",
                                  f"involvedObject.name={name},reason=ScaledDown")["items"]
    assert any(e["message"].startswith("1 → 0 replicas: idle for") for e in events), events

    # At zero: the agent gone, the conditions say what zero means and what the autoscaler reads now.
    wait_for("the agent pod gone", lambda: not pods(cluster, namespace, f"{SELECTOR}={name}"), timeout=60)

    def settled() -> dict[str, Any] | None:
        cr = get_cr(cluster, namespace, name)
        ready, metrics = condition(cr, "Ready"), condition(cr, "MetricsAvailable")
        ok = (ready is not None and ready["reason"] == "ScaledToZero" and metrics is not None
              and metrics["reason"] == "RoutersReporting")
        return cr if ok else None

    cr = wait_for("Ready ScaledToZero and the router read", settled, timeout=3 * INTERVAL_S + 10)
    ready = condition(cr, "Ready")
    assert ready is not None and ready["status"] == "False", ready
    assert cr["status"]["autoscaling"]["lastDecision"]["reason"] == (
        "scaled to zero: nothing held at 1 router; keeping 0")
    assert deployment_replicas() == 0
