"""Helpers shared by the cluster-tier tests: polling with a deadline, applying objects, pod state."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, TypeVar

from cluster import ApiError, LocalCluster

T = TypeVar("T")
WAIT_S = 60.0
GPU_NODES = 2
GPUS_PER_NODE = 8


def wait_for(what: str, fn: Callable[[], T | None], timeout: float = WAIT_S, interval: float = 0.25) -> T:
    """Poll fn until it returns something truthy (returned); fail at the deadline with the last value seen."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while True:
        last = fn()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}")
        time.sleep(interval)  # polling interval against a real API server, not a synchronisation


def namespace_gone(cluster: LocalCluster, name: str) -> bool:
    try:
        cluster.api("GET", f"/api/v1/namespaces/{name}")
    except ApiError as exc:
        return exc.status == 404
    return False


def apply(cluster: LocalCluster, obj: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(obj))


def pods(cluster: LocalCluster, namespace: str, selector: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = cluster.kubectl_json("get", "pods", "-n", namespace, "-l", selector)["items"]
    return items


def is_running_ready(pod: dict[str, Any]) -> bool:
    status = pod.get("status", {})
    conds = {c["type"]: c["status"] for c in status.get("conditions", [])}
    return status.get("phase") == "Running" and conds.get("Ready") == "True"


def wait_running(cluster: LocalCluster, namespace: str, selector: str, n: int,
                 timeout: float = WAIT_S) -> list[dict[str, Any]]:
    def ready() -> list[dict[str, Any]] | None:
        items = pods(cluster, namespace, selector)
        return items if len(items) == n and all(is_running_ready(p) for p in items) else None

    return wait_for(f"{n} pods {selector} Running and Ready", ready, timeout)
