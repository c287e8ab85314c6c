"""Builtin autoscaling end to end: real agents under bounded load scale up within two intervals, explain why,
scale down only after the stabilization window, and never scale down while their metrics are unreachable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import netns
from cluster import LocalCluster
from kube_util import wait_for
from operator_proc import SELECTOR, Operator, apply_cr, condition, get_cr, inference_deployment, wait_ready

INTERVAL_S = 5
DOWN_WINDOW_S = 20
LOAD_S = 40


def deployment_replicas(cluster: LocalCluster, namespace: str, name: str) -> int:
    return int(cluster.kubectl_json("get", "deployment", name, "-n", namespace)["spec"]["replicas"])


def scaling_events(cluster: LocalCluster, namespace: str, name: str, reason: str) -> list[dict[str, Any]]:
    """The CR's events with this reason (kopf posts events in the background: poll for them)."""
    items: list[dict[str, Any]] = cluster.kubectl_json(
        "get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={name},reason={reason}")["items"]
    return items


def start_load(cluster: LocalCluster, ip: str, log: Path) -> subprocess.Popen[bytes]:
    """A bounded closed-loop load (16 clients, LOAD_S seconds) from inside the pod network, above one replica."""
    agent = str(Path(sys.executable).parent / "kvfleet-agent")
    argv = [agent, "bench", "serve", "--url", f"http://{ip}:8000", "--concurrency", "16", "--duration", str(LOAD_S),
            "--timeout", str(LOAD_S + 30), "--max-tokens", "96", "--ignore-eos", "--prompt-len", "64", "--no-progress"]
    with log.open("wb") as out:
        return subprocess.Popen(netns.nsenter_argv(cluster.netns_pid or 0, argv), stdout=out,
                                stderr=subprocess.STDOUT)


def test_scales_on_load_explains_and_waits_out_the_window(cluster: LocalCluster, operator: Operator,
                                                         namespace: str, tiny_model: Path, tmp_path: Path) -> None:
    name = "auto"
    autoscaling = {
        "mode": "builtin", "minReplicas": 1, "maxReplicas": 3, "intervalSeconds": INTERVAL_S, "windowSeconds": 20,
        "targets": {"queueDepthPerReplica": 4},
        "behavior": {"scaleDown": {"stabilizationWindowSeconds": DOWN_WINDOW_S,
                                   "policies": [{"type": "Percent", "value": 100, "periodSeconds": INTERVAL_S}]}},
    }
    apply_cr(cluster, inference_deployment(name, namespace, tiny_model, autoscaling=autoscaling))
    wait_ready(cluster, namespace, name, 1)
    first = cluster.kubectl_json("get", "pods", "-n", namespace, "-l", f"{SELECTOR}={name}")["items"][0]

    load = start_load(cluster, first["status"]["podIP"], tmp_path / "load.log")
    started = time.monotonic()
    try:
        wait_for("a scale-up", lambda: deployment_replicas(cluster, namespace, name) > 1,
                 timeout=2 * INTERVAL_S + 10, interval=0.25)
        up_after = time.monotonic() - started

        def scale_up_decision() -> dict[str, Any] | None:
            # The replicas are applied first, then the decision is written to status (a moment later).
            d = get_cr(cluster, namespace, name).get("status", {}).get("autoscaling", {}).get("lastDecision")
            return d if d and d["desiredReplicas"] > d["currentReplicas"] else None

        decision = wait_for("the scale-up decision in status", scale_up_decision, timeout=2 * INTERVAL_S)
        # The load's own signal proposed it: the queue over its target of 4, or the capacity model's demand over one
        # replica's capacity (sized at that queue target), whichever has the figures first on the machine at hand.
        assert any(p["source"] in ("queue", "capacity") and p["observed"] > p["target"] and p["replicas"] > 1
                   for p in decision["proposals"]), decision
        assert "queue" in decision["reason"], decision
        ups = wait_for("a ScaledUp event", lambda: scaling_events(cluster, namespace, name, "ScaledUp"), timeout=10)
        assert "queue" in ups[0]["message"], ups
        print(f"\nscaled up {up_after:.1f}s after the load started: {decision['reason']}")
        wait_ready(cluster, namespace, name, 3)  # the new agents load and go Ready
    finally:
        load.wait(timeout=LOAD_S + 60)
    stopped_at = time.monotonic()
    assert load.returncode == 0, (tmp_path / "load.log").read_text()[-2000:]

    # Queue empty, metrics fine: the scale-down waits for the stabilization window.
    while time.monotonic() - stopped_at < DOWN_WINDOW_S - INTERVAL_S:
        assert deployment_replicas(cluster, namespace, name) == 3, "scaled down inside the window"
        time.sleep(1.0)  # sampling the replica count while the window passes

    # Metrics unreachable (every agent frozen; pods stay Ready within the readiness budget): no scale-down,
    # even past the window, and the CR says why.
    pids = [e["pid"] for e in cluster.agent_processes().values() if e["pod"].startswith(f"{namespace}/")]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        frozen_until = time.monotonic() + DOWN_WINDOW_S + 2 * INTERVAL_S
        seen_unavailable = False
        while time.monotonic() < frozen_until:
            assert deployment_replicas(cluster, namespace, name) == 3
            cond = condition(get_cr(cluster, namespace, name), "MetricsAvailable")
            seen_unavailable |= cond is not None and cond["status"] == "False"
            time.sleep(1.0)  # sampling the replica count while the window passes
        assert seen_unavailable, get_cr(cluster, namespace, name)["status"]
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)

    # Metrics back, queue empty: it scales down.
    wait_for("a scale-down", lambda: deployment_replicas(cluster, namespace, name) < 3,
             timeout=DOWN_WINDOW_S + 4 * INTERVAL_S)
    downs = wait_for("a ScaledDown event", lambda: scaling_events(cluster, namespace, name, "ScaledDown"), timeout=10)
    assert "queue" in downs[0]["message"], downs
    history = get_cr(cluster, namespace, name)["status"]["autoscaling"]["history"]
    assert len(history) >= 2 and all("reason" in h for h in history)
