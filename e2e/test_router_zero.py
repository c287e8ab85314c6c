"""Scale from zero through the router on the real control plane: a request to an InferenceDeployment at zero
replicas is held by the router, the operator reads the held demand and scales to one, the request completes."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fleet_client
import pytest
from cluster import LocalCluster
from kube_util import pods, wait_for
from operator_proc import SELECTOR, Operator, get_cr
from router_fleet import MODEL, ROUTER_PORT, Fleet, fleet_behind_router, metrics, total

INTERVAL_S = 5
IDLE_S = 10


@pytest.fixture
def zero_fleet(cluster: LocalCluster, operator: Operator, tiny_model: Path) -> Iterator[Fleet]:
    with fleet_behind_router(cluster, "e2e-zero", tiny_model, "zero") as f:
        yield f


def test_a_request_held_at_zero_replicas_is_served_once_the_operator_scales_up(zero_fleet: Fleet) -> None:
    f = zero_fleet
    autoscaling = {"mode": "builtin", "minReplicas": 0, "maxReplicas": 1, "intervalSeconds": INTERVAL_S,
                   "windowSeconds": 20, "scaleToZeroAfterSeconds": IDLE_S, "targets": {"queueDepthPerReplica": 4},
                   "behavior": {"scaleDown": {"stabilizationWindowSeconds": 0}}}
    f.apply(1, autoscaling=autoscaling)  # minReplicas 0 starts one replica; idle, it goes to zero

    def replicas() -> int:
        return int(f.cluster.kubectl_json("get", "deployment", f.name, "-n", f.namespace)["spec"]["replicas"])

    wait_for("the scale to zero", lambda: replicas() == 0, timeout=4 * INTERVAL_S + IDLE_S + 30)
    wait_for("the agent pod gone", lambda: not pods(f.cluster, f.namespace, f"{SELECTOR}={f.name}"), timeout=60)
    assert f.routed_replicas() == 0  # the router still knows the model: it holds, it does not 404

    body = {"model": MODEL, "prompt": "held until a replica is ready:", "max_tokens": 8}
    result: list[fleet_client.Run] = []
    with f.cluster.port_forward(f.router_ip(), ROUTER_PORT) as port:
        sender = threading.Thread(target=lambda: result.append(fleet_client.run(
            [f"http://127.0.0.1:{port}/v1/completions"], [body], concurrency=1, timeout=240)))
        sender.start()
        held = wait_for("the router holding the request", lambda: total(
            metrics(f.cluster, f.router_ip(), ROUTER_PORT), "kvfleet_router_held_requests",
            inference_deployment=f.name, namespace=f.namespace) >= 1, timeout=30)
        assert held
        wait_for("the operator scaling from zero", lambda: replicas() == 1, timeout=2 * INTERVAL_S + 15)
        sender.join(timeout=240)
    outcome = result[0].outcomes[0]
    assert outcome.fate == "done" and outcome.text, outcome

    def scale_from_zero() -> list[dict[str, Any]] | None:
        history = get_cr(f.cluster, f.namespace, f.name).get("status", {}).get("autoscaling", {}).get("history", [])
        return [h for h in history if h["currentReplicas"] == 0 and h["desiredReplicas"] == 1] or None

    up = wait_for("the decision from zero in status", scale_from_zero, timeout=2 * INTERVAL_S)
    assert "held at the router" in up[-1]["reason"], up
    router = metrics(f.cluster, f.router_ip(), ROUTER_PORT)
    assert total(router, "kvfleet_router_hold_seconds_count") >= 1
    print(f"\nheld {total(router, 'kvfleet_router_hold_seconds_sum'):.1f}s at zero replicas, then served; "
          f"the operator said: {up[-1]['reason']}")
