"""The full demo (`make demo`): control plane up, CRDs and operator installed, an InferenceDeployment applied,
agents serving, an InferenceRouter in front of them, a request answered through it; then how to load it and watch
it scale. The cluster keeps running until `make cluster-down`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # e2e/ is not a package
from cluster import DEFAULT_RUN_DIR, ClusterError, LocalCluster, find_bin_dir
from operator_proc import Operator, condition, get_cr, install

NAME = "tiny-llama"
NAMESPACE = "default"


def demo_cr(model: Path) -> dict[str, Any]:
    """manifests/samples/tiny-cpu.yaml (no GPU: it runs on the local CPU node), autoscaled."""
    return {
        "apiVersion": "serving.kvfleet.dev/v1alpha1", "kind": "InferenceDeployment",
        "metadata": {"name": NAME, "namespace": NAMESPACE},
        "spec": {
            "model": {"name": NAME, "source": {"hostPath": {"path": str(model)}}},
            "runtime": {"dtype": "float32", "maxModelLen": 512, "maxNumSeqs": 16},
            "resources": {"gpusPerReplica": 0, "requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "4Gi"}},
            "autoscaling": {"mode": "builtin", "minReplicas": 1, "maxReplicas": 3,
                            "targets": {"queueDepthPerReplica": 4,
                                        "latency": [{"metric": "ttft", "percentile": 95, "seconds": 0.5}]}},
        },
    }


ROUTER = {"apiVersion": "serving.kvfleet.dev/v1alpha1", "kind": "InferenceRouter",
          "metadata": {"name": "router", "namespace": NAMESPACE},
          "spec": {"replicas": 1}}  # no GPU toleration: it runs on the CPU node


def wait_router(cluster: LocalCluster, deadline: float) -> dict[str, Any]:
    """The router's pod once it is Ready (its discovery has listed the namespace) and routes to the model."""
    while True:
        items = cluster.kubectl_json("get", "pods", "-n", NAMESPACE, "-l", "app.kubernetes.io/name=kvfleet-router")
        for pod in items["items"]:
            conds = {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions", [])}
            if conds.get("Ready") == "True":
                return dict(pod)
        if time.monotonic() > deadline:
            raise ClusterError(f"the router is not Ready: {items['items']}")
        time.sleep(1.0)  # polling the API server


def step(text: str) -> None:
    print(f"\n==> {text}", flush=True)


def main() -> int:
    """Run the demo; exit 1 with the reason if a step fails."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", default=str(DEFAULT_RUN_DIR))
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the agents to be Ready")
    args = parser.parse_args()
    run_dir = Path(args.run_dir)
    if (run_dir / "pids.json").exists():
        print(f"a cluster already runs in {run_dir}: stop it with `make cluster-down` first", file=sys.stderr)
        return 1
    bin_dir = find_bin_dir(build=False)
    if bin_dir is None:
        print("control-plane binaries are missing: run `bash e2e/build.sh` (make demo does)", file=sys.stderr)
        return 1

    step("starting the local control plane (etcd, kube-apiserver, controller-manager, scheduler, kwok GPU and CPU "
         "nodes, pod network, process kubelet)")
    cluster = LocalCluster(run_dir, gpu_nodes=2, bin_dir=bin_dir, keep=True)
    try:
        cluster.start()
        print(f"up in {cluster.timings['total']:.1f}s; logs in {run_dir / 'logs'}")
        model = run_dir / "models" / NAME
        step(f"writing a tiny random checkpoint and tokenizer to {model}")
        agent = Path(sys.executable).parent / "kvfleet-agent"
        subprocess.run([str(agent), "model", "init-tiny", str(model)], check=True, capture_output=True)

        step("installing the CRDs, RBAC and operator namespace: kubectl apply --server-side -k manifests/base")
        install(cluster)
        step("starting the operator under its ServiceAccount's token (in the pod network, so it can scrape agents)")
        op = Operator(cluster, env={"KVFLEET_LOG_LEVEL": "INFO"})
        op.start()

        step(f"applying InferenceDeployment {NAME}")
        cluster.kubectl("apply", "--server-side", "-f", "-", stdin=json.dumps(demo_cr(model)))
        deadline = time.monotonic() + args.timeout
        while True:
            cr = get_cr(cluster, NAMESPACE, NAME)
            ready = condition(cr, "Ready")
            if ready is not None and ready["status"] == "True":
                break
            if time.monotonic() > deadline:
                raise ClusterError(f"{NAME} not Ready after {args.timeout:.0f}s: {cr.get('status')}\n{op.log()}")
            time.sleep(1.0)  # polling the API server
        print(cluster.kubectl("get", "inferencedeployments,deployments,pods", "-n", NAMESPACE, "-o", "wide").stdout)

        step("applying InferenceRouter router: one OpenAI endpoint in front of every replica")
        cluster.kubectl("apply", "--server-side", "-f", "-", stdin=json.dumps(ROUTER))
        router = wait_router(cluster, time.monotonic() + args.timeout)
        ip = router["status"]["podIP"]
        step(f"asking the router on pod IP {ip} for a completion (through a port forward)")
        body = json.dumps({"model": NAME, "prompt": "The capital of France is", "max_tokens": 16}).encode()
        with cluster.port_forward(ip, 8080) as port:
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as resp:
                answer = json.loads(resp.read())
                route = resp.headers.get("x-kvfleet-route", "")
        print(f"x-kvfleet-route: {route}")
        print(json.dumps(answer, indent=1))
    except (ClusterError, subprocess.CalledProcessError, OSError) as exc:
        print(f"demo failed: {exc}\nthe cluster is left running for a look; stop it with `make cluster-down`",
              file=sys.stderr)
        return 1

    stop = "make cluster-down" if run_dir == DEFAULT_RUN_DIR else f"python e2e/cluster.py down --run-dir {run_dir}"
    shell = " ".join(["nsenter", f"--target={cluster.netns_pid}", "--user", "--net", "--preserve-credentials"])
    print(f"""
==> the cluster keeps running. Watch it:
  export KUBECONFIG={cluster.kubeconfig} PATH={bin_dir}:$PATH
  kubectl get infd -w                       # READY / REPLICAS / DESIRED / MODEL / AUTOSCALING / TTFT-P95 / ITL-P95
  kubectl get inferencerouters              # the router: ready, models it routes
  kubectl describe infd {NAME}              # conditions, the last scaling decision and why
  kubectl get events --field-selector involvedObject.name={NAME}
Put load on the router from inside the pod network (pod IPs live there), and watch it scale and spread:
  {shell} {agent} bench serve --url http://{ip}:8080 --request-rate 40 --num-requests 2000
Operator log: {op.proc.log if op.proc else '-'}
Stop everything: {stop}""")
    return 0


if __name__ == "__main__":
    sys.exit(main())
