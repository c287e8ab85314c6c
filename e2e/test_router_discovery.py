"""kvfleet-router --kubernetes on the real control plane: under a ServiceAccount that may only get/list/watch pods
and InferenceDeployments, it waits out RBAC (403, logged once), holds a request for an InferenceDeployment at zero
replicas, releases it to the first Ready agent pod, drops a pod on its watch event and forgets a deleted model;
its list-watch resumes across watch timeouts and watches a namespace created after it started."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import re
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cluster import LocalCluster
from kube_util import apply, pods, wait_for
from operator_proc import READY_S, SELECTOR, Operator, apply_cr, inference_deployment
from procs import Proc, tail, terminate_all, write_secret
from prometheus_client.parser import text_string_to_metric_families

# e2e/ is type-checked on its own (`cd e2e && mypy --strict *.py`), without the project's mypy_path.
from kvfleet_router import kube  # type: ignore[import-not-found]

ACCOUNT = "kvfleet-router"
READY_LINE = re.compile(r"kvfleet-router ready: http://127\.0\.0\.1:(\d+)")
Response = tuple[int, dict[str, str], str]


def router_account(cluster: LocalCluster, namespace: str) -> Path:
    """The router's ServiceAccount and Role (read pods and InferenceDeployments, nothing else; not bound yet), and
    a kubeconfig with a token of that account (TokenRequest)."""
    read = ["get", "list", "watch"]
    meta = {"name": ACCOUNT, "namespace": namespace}
    apply(cluster, {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta})
    apply(cluster, {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta,
                    "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": read},
                              {"apiGroups": ["serving.kvfleet.dev"], "resources": ["inferencedeployments"],
                               "verbs": read}]})
    request = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": 3600}}
    token = cluster.api("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{ACCOUNT}/token",
                        request)["status"]["token"]
    ca = base64.b64encode(cluster.pki.ca_crt.read_bytes()).decode()
    path = cluster.run_dir / f"router-{namespace}.kubeconfig"
    write_secret(path, json.dumps({  # JSON is YAML
        "apiVersion": "v1", "kind": "Config", "current-context": "router",
        "clusters": [{"name": "local", "cluster": {"server": cluster.server, "certificate-authority-data": ca}}],
        "users": [{"name": ACCOUNT, "user": {"token": token}}],
        "contexts": [{"name": "router", "context": {"cluster": "local", "user": ACCOUNT}}]}))
    return path


def bind(cluster: LocalCluster, namespace: str) -> None:
    apply(cluster, {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                    "metadata": {"name": ACCOUNT, "namespace": namespace},
                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": ACCOUNT},
                    "subjects": [{"kind": "ServiceAccount", "name": ACCOUNT, "namespace": namespace}]})


def call(port: int, path: str, body: dict[str, Any] | None = None, timeout: float = 10.0) -> Response:
    """One HTTP request to the router through the port forward: status, headers, body."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def models(port: int) -> dict[str, int]:
    """The router's models and their ready replica counts."""
    return {m["id"]: m["ready_replicas"] for m in json.loads(call(port, "/v1/models")[2])["data"]}


def held(port: int) -> dict[tuple[str, str, str], float]:
    """The held-requests gauge by (model, namespace, inference_deployment)."""
    out = {}
    for family in text_string_to_metric_families(call(port, "/metrics")[2]):
        if family.name == "kvfleet_router_held_requests":
            for s in family.samples:
                out[(s.labels["model"], s.labels["namespace"], s.labels["inference_deployment"])] = s.value
    return out


def lines(proc: Proc, pattern: str) -> list[str]:
    return [line for line in proc.log.read_text(errors="replace").splitlines() if re.search(pattern, line)]


def test_router_discovers_holds_from_zero_routes_and_drops_pods_on_watch_events(
        cluster: LocalCluster, operator: Operator, namespace: str, tiny_model: Path) -> None:
    kubeconfig = router_account(cluster, namespace)
    sa = f"--as=system:serviceaccount:{namespace}:{ACCOUNT}"

    def can(*args: str) -> bool:
        return cluster.kubectl("auth", "can-i", *args, sa, "-n", namespace, check=False).stdout.strip() == "yes"

    # A scrape interval of an hour: every readiness change below can only come from the watch.
    router = cluster.spawn_in_pod_network(f"router-{namespace}", [
        sys.executable, "-m", "kvfleet_router.cli", "--kubernetes", "--kubeconfig", str(kubeconfig),
        "--watch-namespace", namespace, "--host", "127.0.0.1", "--port", "0", "--scrape-interval", "3600",
        "--hold-timeout", str(READY_S), "--log-level", "DEBUG"], dict(os.environ))
    try:
        port = int(wait_for("the router's ready line", lambda: READY_LINE.search(router.log.read_text()),
                            timeout=30).group(1))
        with cluster.port_forward("127.0.0.1", port) as local:
            # No RoleBinding yet: both watches are refused, the router is not ready, and says so once per watch.
            assert call(local, "/health")[0] == 200 and call(local, "/ready")[0] == 503
            wait_for("a retried 403 on both watches", lambda: len(lines(router, r"WARNING.* 403: ")) == 2
                     and lines(router, r"DEBUG.*still failing \(403"), timeout=30)
            bind(cluster, namespace)
            wait_for("the router ready once its Role is bound", lambda: call(local, "/ready")[0] == 200, timeout=30)
            assert len(lines(router, r" 403: ")) == 2, tail(router.log)  # logged once per watch, not per attempt
            assert can("watch", "pods") and can("list", "inferencedeployments.serving.kvfleet.dev")
            assert not can("get", "secrets") and not can("list", "deployments.apps") and not can("create", "pods")

            status, _, text = call(local, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1})
            assert status == 404 and "not served here" in text

            # At zero replicas the model is known: a request is held, counted under its InferenceDeployment.
            apply_cr(cluster, inference_deployment("alpha", namespace, tiny_model, replicas=0))
            wait_for("tiny known with no ready replica", lambda: models(local) == {"tiny": 0})
            key = ("tiny", namespace, "alpha")
            assert held(local) == {key: 0.0}
            answer: list[Response] = []
            sender = threading.Thread(target=lambda: answer.append(call(
                local, "/v1/completions", {"model": "tiny", "prompt": "held", "max_tokens": 3}, timeout=READY_S + 30)))
            sender.start()
            wait_for("the request held", lambda: held(local).get(key) == 1.0)
            assert not answer

            # Scale from zero: the first Ready pod, on its watch event, releases the held request to itself.
            cluster.kubectl("scale", "inferencedeployment", "alpha", "-n", namespace, "--replicas=1")
            sender.join(READY_S + 40)
            status, headers, text = answer[0]
            assert status == 200, text
            assert json.loads(text)["usage"]["completion_tokens"] == 3
            (pod,) = pods(cluster, namespace, f"{SELECTOR}=alpha")
            assert headers["x-kvfleet-route"].startswith(f"replica={namespace}/{pod['metadata']['name']};")
            assert models(local) == {"tiny": 1} and held(local) == {key: 0.0}
            status, _, _ = call(local, "/v1/completions", {"model": "tiny", "prompt": "again", "max_tokens": 2})
            assert status == 200

            # Back to zero: the pod leaves the router when it starts terminating (its agent still drains).
            cluster.kubectl("scale", "inferencedeployment", "alpha", "-n", namespace, "--replicas=0")
            wait_for("the pod out of the router", lambda: models(local) == {"tiny": 0}, timeout=30)
            leaving = pods(cluster, namespace, f"{SELECTOR}=alpha")
            assert leaving and all(p["metadata"].get("deletionTimestamp") for p in leaving)

            # Deleted: the model is unknown again.
            cluster.kubectl("delete", "inferencedeployment", "alpha", "-n", namespace)
            wait_for("tiny forgotten", lambda: models(local) == {}, timeout=30)
            assert call(local, "/v1/completions", {"model": "tiny", "prompt": "x"})[0] == 404
            assert router.alive(), tail(router.log)
    finally:
        terminate_all([router], grace=10.0)


class Recorder:
    """A list-watch's store that remembers what it was told."""

    def __init__(self) -> None:
        self.lists: list[list[str]] = []
        self.events: list[tuple[str, str]] = []

    def replace(self, items: list[dict[str, Any]]) -> None:
        self.lists.append([o["metadata"]["name"] for o in items])

    def apply(self, kind: str, obj: dict[str, Any]) -> None:
        self.events.append((kind, obj["metadata"]["name"]))


async def until(what: str, check: Callable[[], bool], timeout: float = 30.0) -> None:
    """Poll check() on the event loop (the watches run beside it) until it holds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(0.1)  # a polling interval against the real apiserver, not a synchronisation


def test_list_watch_resumes_across_watch_timeouts_and_sees_a_namespace_created_later(
        cluster: LocalCluster, namespace: str, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """(410 Gone is not shown here: this apiserver's watch cache serves old versions instead, even after an etcd
    compaction; tests/router/test_discovery.py replays it.)"""
    monkeypatch.setattr(kube, "WATCH_S", (2, 2))  # watches end every 2 s: several resumptions within the test
    later = f"{namespace}-later"
    probe = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "probe", "namespace": later},
             "spec": {"containers": [{"name": "c", "image": "none"}]}}  # never scheduled: the GPU nodes are tainted
    config = kube.load_config(str(cluster.kubeconfig), {})  # the admin's kubeconfig: a client certificate, as data
    resumed = "later: the watch ended, resuming at resourceVersion"

    async def main() -> Recorder:
        store = Recorder()
        async with kube.KubeClient(config) as client:
            task = asyncio.create_task(kube.list_watch(client, f"/api/v1/namespaces/{later}/pods", "", store, "later"))
            try:
                await until("a list of the namespace that does not exist yet", lambda: bool(store.lists))
                await asyncio.to_thread(cluster.kubectl, "create", "namespace", later)
                # Pods are admitted once the namespace's default ServiceAccount exists.
                await asyncio.to_thread(wait_for, "the probe pod created", lambda: cluster.kubectl(
                    "apply", "-f", "-", stdin=json.dumps(probe), check=False).returncode == 0, 30.0)
                await until("the probe's ADDED event", lambda: ("ADDED", "probe") in store.events)
                await until("two resumed watches", lambda: caplog.text.count(resumed) >= 2)
                await asyncio.to_thread(cluster.kubectl, "delete", "pod", "probe", "-n", later)
                await until("the probe's DELETED event", lambda: ("DELETED", "probe") in store.events)
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        return store

    try:
        with caplog.at_level(logging.DEBUG, logger="kvfleet_router.kube"):
            store = asyncio.run(main())
        assert store.lists == [[]], store.lists  # one list (of a namespace that did not exist): never again
        assert store.events[0] == ("ADDED", "probe") and store.events.count(("ADDED", "probe")) == 1, store.events
        assert store.events[-1] == ("DELETED", "probe")  # nothing lost or repeated across the resumptions
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    finally:
        cluster.kubectl("delete", "namespace", later, "--wait=false", check=False)
