"""The fleet behind a router on the local cluster: an InferenceDeployment, an InferenceRouter in front of it, and
the readings the router tests compare (agents' own counters and gauges, the router's view, bounded load runs)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import netns
from cluster import LocalCluster
from gpu_nodes import GPU_TOLERATION
from kube_util import pods, wait_for, wait_running
from operator_proc import SELECTOR, apply_cr, inference_deployment, wait_ready
from prometheus_client.parser import text_string_to_metric_families

ROUTER_SELECTOR = "app.kubernetes.io/name=kvfleet-router"
AGENT_PORT, ROUTER_PORT = 8000, 8080
MODEL = "tiny"


def router_cr(name: str, namespace: str, **spec: Any) -> dict[str, Any]:
    """An InferenceRouter watching its own namespace (tolerating the GPU taint: every local node is a GPU node)."""
    return {"apiVersion": "serving.kvfleet.dev/v1alpha1", "kind": "InferenceRouter",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"replicas": 1, "pod": {"tolerations": [GPU_TOLERATION]}, **spec}}


def metrics(cluster: LocalCluster, ip: str, port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    """A pod's /metrics, read from inside the pod network: family sample name → (labels, value) pairs."""
    code = f"import urllib.request; print(urllib.request.urlopen('http://{ip}:{port}/metrics', timeout=5).read()" \
           ".decode())"
    return parse_metrics(cluster.exec_in_pod_network(sys.executable, "-c", code).stdout)


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """A Prometheus exposition's samples: family sample name → (labels, value) pairs."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def total(samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    """The sum of a sample name's values over the label sets that match `labels`."""
    return sum(v for ls, v in samples.get(name, []) if all(ls.get(k) == x for k, x in labels.items()))


@dataclass
class Fleet:
    """One InferenceDeployment (`fleet`) behind one InferenceRouter (`router`) in a namespace of its own."""

    cluster: LocalCluster
    namespace: str
    model_dir: Path
    name: str = "fleet"

    def apply(self, replicas: int, **spec: Any) -> None:
        """Apply the InferenceDeployment with this many replicas; wait until they are Ready and routed to."""
        # One OpenMP thread a replica: the replicas share this machine's cores, as pods on a node share theirs by
        # their CPU requests. With every replica's team as wide as the machine, three replicas oversubscribe it and
        # each parallel region waits on a descheduled thread: a scale-up would measure contention, not routing.
        runtime = {"dtype": "float32", "maxModelLen": 512, "maxNumSeqs": 8, "drainGracePeriodSeconds": 5,
                   "extraArgs": ["--num-threads", "1"]}
        apply_cr(self.cluster, inference_deployment(self.name, self.namespace, self.model_dir, replicas=replicas,
                                                    runtime=runtime, **spec))
        wait_ready(self.cluster, self.namespace, self.name, replicas)
        wait_for(f"the router routing to {replicas} replicas", lambda: self.routed_replicas() == replicas,
                 timeout=30)

    def start_router(self, **spec: Any) -> None:
        apply_cr(self.cluster, router_cr("router", self.namespace, **spec))
        wait_running(self.cluster, self.namespace, ROUTER_SELECTOR, 1, timeout=120)

    def router_ip(self) -> str:
        return str(pods(self.cluster, self.namespace, ROUTER_SELECTOR)[0]["status"]["podIP"])

    def agents(self) -> dict[str, str]:
        """Ready agent pods: name → IP."""
        return {p["metadata"]["name"]: p["status"]["podIP"]
                for p in pods(self.cluster, self.namespace, f"{SELECTOR}={self.name}")
                if p.get("status", {}).get("podIP") and not p["metadata"].get("deletionTimestamp")}

    def routed_replicas(self) -> int:
        """The ready replicas the router itself reports for the model (GET /v1/models)."""
        code = (f"import urllib.request; print(urllib.request.urlopen('http://{self.router_ip()}:{ROUTER_PORT}"
                "/v1/models', timeout=5).read().decode())")
        proc = self.cluster.exec_in_pod_network(sys.executable, "-c", code)
        if proc.returncode != 0:
            return -1
        models = {m["id"]: m for m in json.loads(proc.stdout)["data"]}
        return int(models.get(MODEL, {}).get("ready_replicas", 0))

    def agent_counter(self, name: str) -> dict[str, float]:
        """A counter of every ready agent, by pod name."""
        return {pod: total(metrics(self.cluster, ip, AGENT_PORT), name) for pod, ip in self.agents().items()}

    def bench(self, out: Path, *args: str, timeout: float = 180.0) -> dict[str, Any]:
        """`kvfleet-agent bench serve` against the router from inside the pod network; its JSON summary."""
        agent = str(Path(sys.executable).parent / "kvfleet-agent")
        argv = [agent, "bench", "serve", "--url", f"http://{self.router_ip()}:{ROUTER_PORT}", "--model", MODEL,
                "--result-json", str(out), "--no-progress", *args]
        proc = subprocess.run(netns.nsenter_argv(self.cluster.netns_pid or 0, argv), capture_output=True,
                              text=True, timeout=timeout)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        summary: dict[str, Any] = json.loads(out.read_text())["summary"]
        return summary


@contextlib.contextmanager
def fleet_behind_router(cluster: LocalCluster, prefix: str, model_dir: Path, name: str) -> Iterator[Fleet]:
    """A Fleet named `name` in a fresh namespace `prefix`-xxxxxx, its router started; everything deleted after."""
    namespace = f"{prefix}-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", namespace)
    f = Fleet(cluster, namespace, model_dir, name=name)
    try:
        f.start_router()
        yield f
    finally:
        cluster.kubectl("delete", "inferencedeployments,inferencerouters", "--all", "-n", namespace, "--wait=false",
                        check=False)
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
