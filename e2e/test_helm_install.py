"""charts/kvfleet installed on the real control plane: `helm template | kubectl apply --server-side`, then the operator
run under the chart's ServiceAccount serving an InferenceDeployment, in cluster and in namespace scope."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster import LocalCluster  # e2e/ on sys.path (conftest)
from operator_proc import REPO, Operator, apply_cr, inference_deployment, wait_ready

CHART = REPO / "charts" / "kvfleet"
MANAGER = "helm-e2e"  # the field manager of what the chart applies


def helm(*args: str) -> str:
    """The helm e2e/build_helm.sh built (`make test` builds it; a skip elsewhere, saying how)."""
    built = subprocess.run(["bash", str(REPO / "e2e" / "build_helm.sh")], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "CHECK_ONLY": "1"})
    if built.returncode == 3:
        pytest.skip("helm not built: run `bash e2e/build_helm.sh` (about 4 min cold)")
    assert built.returncode == 0, built.stderr
    out = subprocess.run([built.stdout.strip().splitlines()[-1], *args], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "HELM_CACHE_HOME": "/nonexistent", "KUBECONFIG": "/dev/null"})
    assert out.returncode == 0, out.stderr
    return out.stdout


def install_chart(cluster: LocalCluster, namespace: str, *values: str, force: bool = False) -> list[dict[str, Any]]:
    """`helm template` (no CRDs: as `helm install --skip-crds`) applied in one server-side pass; the operator
    Deployment scaled to zero, as operator_proc.install() does (its image is not pullable here: the tests run the
    same program as a process under the Deployment's ServiceAccount)."""
    manifest = helm("template", "kvfleet", str(CHART), "--namespace", namespace, *values)
    cluster.kubectl("apply", "--server-side", f"--field-manager={MANAGER}", *(["--force-conflicts"] if force else []),
                    "-f", "-", stdin=manifest)
    cluster.kubectl("scale", "deployment", "kvfleet-operator", "-n", namespace, "--replicas=0")
    return [d for d in yaml.safe_load_all(manifest) if d]


def deployment_env(docs: list[dict[str, Any]], namespace: str) -> dict[str, str]:
    """The chart's operator container env, its metadata.namespace references resolved, for the operator process. The
    port (a free one) and the log format (text, for the log checks) stay the test's."""
    (deployment,) = (d for d in docs if d["kind"] == "Deployment")
    env = {}
    for var in deployment["spec"]["template"]["spec"]["containers"][0]["env"]:
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            assert var["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}, var
            env[var["name"]] = namespace
    for own in ("KVFLEET_OPERATOR_PORT", "KVFLEET_LOG_FORMAT"):
        del env[own]
    return env


def serve_one(cluster: LocalCluster, op: Operator, namespace: str, model: Path) -> None:
    """op, started, reconciles an InferenceDeployment in `namespace` to Ready and is refused nothing on the way."""
    op.start()
    try:
        apply_cr(cluster, inference_deployment("charted", namespace, model))
        wait_ready(cluster, namespace, "charted", 1)
        assert op.proc is not None
        log = op.proc.log.read_text(errors="replace")
        assert "Forbidden" not in log and "Not enough permissions" not in log, op.log()
    finally:
        op.stop()


def test_chart_crds_are_the_installed_ones(cluster: LocalCluster, operator: Operator) -> None:
    """The session installed the CRDs from manifests/base, so the chart is applied with --skip-crds; its crds/ would
    change nothing: a server-side dry run of each under another manager has no conflict and the same spec."""
    crds = [d for path in sorted((CHART / "crds").glob("*.yaml")) for d in yaml.safe_load_all(path.read_text()) if d]
    assert len(crds) == 4  # InferenceDeployment, InferenceRouter, kopf's two peerings
    for crd in crds:
        name = crd["metadata"]["name"]
        out = cluster.kubectl("apply", "--server-side", "--dry-run=server", f"--field-manager={MANAGER}", "-o", "json",
                              "-f", "-", stdin=json.dumps(crd), check=False)
        # A conflict is a field the chart sets to another value: regenerate with `python -m kvfleet_operator.crd`.
        assert out.returncode == 0, f"{name}: {out.stderr}"
        assert json.loads(out.stdout)["spec"] == cluster.kubectl_json("get", "crd", name)["spec"], name


def test_cluster_scope_chart_runs_the_operator(cluster: LocalCluster, operator: Operator, namespace: str,
                                               tiny_model: Path) -> None:
    """Defaults (scope cluster) into a fresh release namespace. Cluster-scoped names are fixed (one cluster-wide
    operator per cluster), so the chart's ClusterRoleBinding takes over manifests/base's, rebinding it to the release's
    ServiceAccount: the session's operator pauses meanwhile, and the base is put back after."""
    release = f"kvfleet-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", release)
    operator.stop()
    try:
        docs = install_chart(cluster, release, force=True)
        assert {d["kind"] for d in docs} == {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Service",
                                             "Deployment"}
        binding = cluster.kubectl_json("get", "clusterrolebinding", "kvfleet-operator")
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "kvfleet-operator", "namespace": release}]
        env = deployment_env(docs, release)
        assert env["KVFLEET_WATCH_NAMESPACE"] == "" and env["KVFLEET_PEERING"] == "kvfleet"
        serve_one(cluster, Operator(cluster, namespace=release, env=env), namespace, tiny_model)
    finally:
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=kvfleet-e2e", "-k",
                        str(REPO / "manifests" / "base"))
        cluster.kubectl("scale", "deployment", "kvfleet-operator", "-n", "kvfleet-system", "--replicas=0")
        cluster.kubectl("delete", "namespace", release, "--wait=false")
        operator.start()


def test_namespace_scope_chart_runs_the_operator(cluster: LocalCluster, operator: Operator, namespace: str,
                                                 tiny_model: Path) -> None:
    """scope=namespace into the namespace it serves: namespaced objects only (nothing to fight over with the session's
    install), a Role; the session's cluster-wide operator would reconcile this namespace too, so it pauses."""
    docs = install_chart(cluster, namespace, "--set", "scope=namespace")
    assert {d["kind"] for d in docs} == {"ServiceAccount", "Role", "RoleBinding", "Service", "Deployment"}
    assert all(d["metadata"]["namespace"] == namespace for d in docs)
    env = deployment_env(docs, namespace)
    assert env["KVFLEET_WATCH_NAMESPACE"] == namespace and env["KVFLEET_PEERING"] == ""
    operator.stop()
    try:
        serve_one(cluster, Operator(cluster, namespace=namespace, env=env), namespace, tiny_model)
    finally:
        operator.start()
