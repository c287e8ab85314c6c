"""The kvfleet operator on the local cluster: installed from manifests/base, run as a process in the pod network
under its own ServiceAccount's token (never as admin), restartable by pid."""

from __future__ import annotations

import base64
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from cluster import ApiError, LocalCluster
from kube_util import wait_for
from procs import Proc, tail, terminate_all, write_secret

REPO = Path(__file__).resolve().parent.parent
NAMESPACE = "kvfleet-system"
SERVICE_ACCOUNT = "kvfleet-operator"
CRD = "inferencedeployments.serving.kvfleet.dev"


def install(cluster: LocalCluster) -> None:
    """`kubectl apply --server-side -k manifests/base`, once (it must apply in one pass, as a GitOps sync does);
    wait for the CRDs to be Established.

    The operator's own Deployment is scaled to zero: its image cannot be pulled here, so the tests run
    the same program as a process with that Deployment's ServiceAccount instead.
    """
    cluster.kubectl("apply", "--server-side", "--field-manager=kvfleet-e2e", "-k", str(REPO / "manifests/base"))
    wait_for(f"{CRD} Established", lambda: _established(cluster, CRD), timeout=30)
    cluster.kubectl("scale", "deployment", "kvfleet-operator", "-n", NAMESPACE, "--replicas=0")


def _established(cluster: LocalCluster, name: str) -> bool:
    try:
        crd = cluster.api("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
    except ApiError:
        return False
    conditions = crd.get("status", {}).get("conditions", [])
    return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)


def install_single_namespace(cluster: LocalCluster, namespace: str) -> None:
    """manifests/overlays/single-namespace into `namespace`, wrapped as a GitOps repository would wrap it (a
    kustomization of its own that sets the namespace); its operator Deployment scaled to zero, as in install()."""
    wrapper = cluster.run_dir / f"single-namespace-{namespace}"
    wrapper.mkdir()
    overlay = REPO / "manifests" / "overlays" / "single-namespace"
    (wrapper / "kustomization.yaml").write_text(json.dumps({  # JSON is YAML
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": namespace,
        "resources": [os.path.relpath(overlay, wrapper)]}))
    cluster.kubectl("apply", "--server-side", "--field-manager=kvfleet-e2e", "-k", str(wrapper))
    cluster.kubectl("scale", "deployment", "kvfleet-operator", "-n", namespace, "--replicas=0")


def service_account_kubeconfig(cluster: LocalCluster, namespace: str = NAMESPACE) -> Path:
    """A kubeconfig carrying a fresh token of the operator's ServiceAccount in `namespace` (TokenRequest API)."""
    request = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": 7200}}
    token = cluster.api("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{SERVICE_ACCOUNT}/token",
                        request)["status"]["token"]
    ca = base64.b64encode(cluster.pki.ca_crt.read_bytes()).decode()
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "operator",
        "clusters": [{"name": "local", "cluster": {"server": cluster.server, "certificate-authority-data": ca}}],
        "users": [{"name": SERVICE_ACCOUNT, "user": {"token": token}}],
        "contexts": [{"name": "operator", "context": {"cluster": "local", "user": SERVICE_ACCOUNT}}],
    }
    path = cluster.run_dir / ("operator.kubeconfig" if namespace == NAMESPACE else f"operator-{namespace}.kubeconfig")
    write_secret(path, json.dumps(config))  # JSON is YAML
    return path


class Operator:
    """One operator process at a time; start() again after stop() or kill() for a restart."""

    def __init__(self, cluster: LocalCluster, env: dict[str, str] | None = None, namespace: str = NAMESPACE) -> None:
        """An operator under the token of the kvfleet-operator ServiceAccount of `namespace` (where it is
        installed)."""
        self.cluster = cluster
        self.kubeconfig = service_account_kubeconfig(cluster, namespace)
        self.label = "operator" if namespace == NAMESPACE else f"operator-{namespace}"  # its logs/LABEL-N.log
        self.extra_env = env or {}
        self.proc: Proc | None = None
        self.starts = 0

    def start(self) -> Proc:
        """Start `python -m kvfleet_operator` in the pod network (it scrapes agents on pod IPs)."""
        self.starts += 1
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "KVFLEET_OPERATOR_PORT": "0",
               "KVFLEET_LOG_FORMAT": "text", "KVFLEET_LOG_LEVEL": "DEBUG", **self.extra_env}
        self.proc = self.cluster.spawn_in_pod_network(f"{self.label}-{self.starts}", [sys.executable, "-m",
                                                                                  "kvfleet_operator"], env)
        return self.proc

    def stop(self) -> None:
        if self.proc is not None:
            terminate_all([self.proc], grace=10.0)
            self.proc = None

    def kill(self) -> None:
        """SIGKILL: no cleanup, as when a node dies under it."""
        if self.proc is not None and self.proc.popen is not None:
            self.proc.popen.kill()
            self.proc.popen.wait()
            self.proc = None

    def log(self) -> str:
        return tail(self.proc.log, 80) if self.proc is not None else "(not running)"

    def metrics_port(self) -> int:
        """The port of its /healthz and /metrics in the pod network (it binds port 0: the one it logged)."""
        assert self.proc is not None
        log = self.proc.log
        found = wait_for("the operator's metrics port in its log", lambda: re.findall(
            r"health and metrics on port (\d+)", log.read_text(errors="replace")), timeout=30)
        return int(found[-1])


def get_cr(cluster: LocalCluster, namespace: str, name: str) -> dict[str, Any]:
    result: dict[str, Any] = cluster.api(
        "GET", f"/apis/serving.kvfleet.dev/v1alpha1/namespaces/{namespace}/inferencedeployments/{name}")
    return result


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == kind), None)


READY_S = 150.0  # CR applied → agents loaded and Ready, on 2 shared cores
SELECTOR = "serving.kvfleet.dev/inference-deployment"


def inference_deployment(name: str, namespace: str, model: Path, **spec: Any) -> dict[str, Any]:
    """A CR serving the tiny model from a hostPath on one (fake) GPU per replica."""
    body: dict[str, Any] = {
        "apiVersion": "serving.kvfleet.dev/v1alpha1", "kind": "InferenceDeployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "model": {"name": "tiny", "source": {"hostPath": {"path": str(model)}}},
            "runtime": {"dtype": "float32", "maxModelLen": 256, "maxNumSeqs": 8, "drainGracePeriodSeconds": 5},
            "resources": {"gpusPerReplica": 1},
            "replicas": 1,
        },
    }
    body["spec"].update(spec)
    return body


def apply_cr(cluster: LocalCluster, body: dict[str, Any], check: bool = True) -> Any:
    return cluster.kubectl("apply", "--server-side", "--field-manager=e2e-user", "-f", "-", stdin=json.dumps(body),
                           check=check)


def owned(cluster: LocalCluster, namespace: str, name: str) -> dict[str, list[dict[str, Any]]]:
    """The Deployments, Services and PDBs that carry this CR's label."""
    sel = f"{SELECTOR}={name}"
    return {kind: cluster.kubectl_json("get", kind, "-n", namespace, "-l", sel)["items"]
            for kind in ("deployments", "services", "poddisruptionbudgets")}


def wait_ready(cluster: LocalCluster, namespace: str, name: str, replicas: int) -> dict[str, Any]:
    """Wait until the CR reports Ready=True with `replicas` ready replicas for its current generation."""
    def ready() -> dict[str, Any] | None:
        cr = get_cr(cluster, namespace, name)
        st, cond = cr.get("status", {}), condition(cr, "Ready")
        ok = (cond is not None and cond["status"] == "True" and st.get("readyReplicas") == replicas
              and st.get("replicas") == replicas and st.get("observedGeneration") == cr["metadata"]["generation"])
        return cr if ok else None

    return wait_for(f"{name} Ready with {replicas} replicas", ready, timeout=READY_S, interval=0.5)
