"""The single-namespace install (manifests/overlays/single-namespace) on the real control plane: a Role instead of
the ClusterRole, the operator watching its own namespace only, and an InferenceDeployment served under it."""

from __future__ import annotations

from pathlib import Path

from cluster import LocalCluster
from operator_proc import (
    SERVICE_ACCOUNT,
    Operator,
    apply_cr,
    inference_deployment,
    install_single_namespace,
    wait_ready,
)


def test_single_namespace_install_serves_its_namespace_with_a_role(cluster: LocalCluster, operator: Operator,
                                                                    namespace: str, tiny_model: Path) -> None:
    sa = f"system:serviceaccount:{namespace}:{SERVICE_ACCOUNT}"

    def can(*args: str) -> bool:
        return cluster.kubectl("auth", "can-i", *args, f"--as={sa}", check=False).stdout.strip() == "yes"

    install_single_namespace(cluster, namespace)
    assert can("patch", "deployments.apps", "-n", namespace)
    assert can("patch", "inferencedeployments.serving.kvfleet.dev/status", "-n", namespace)
    assert can("delete", "networkpolicies.networking.k8s.io", "-n", namespace)
    assert not can("patch", "deployments.apps", "-n", "default")  # nothing outside its namespace
    assert not can("list", "namespaces") and not can("list", "customresourcedefinitions.apiextensions.k8s.io")
    assert not can("get", "secrets", "-n", namespace)

    # The session's cluster-wide operator would reconcile this namespace too: it pauses while this one runs.
    operator.stop()
    scoped = Operator(cluster, namespace=namespace, env={
        # What the overlay's Deployment sets (its downward-API references resolved: this runs as a process).
        "KVFLEET_WATCH_NAMESPACE": namespace, "KVFLEET_OPERATOR_NAMESPACE": namespace, "KVFLEET_PEERING": ""})
    scoped.start()
    try:
        apply_cr(cluster, inference_deployment("solo", namespace, tiny_model))
        cr = wait_ready(cluster, namespace, "solo", 1)
        assert cr["status"]["replicas"] == 1
        policy = cluster.kubectl_json("get", "networkpolicy", "solo-agents", "-n", namespace)
        operator_peer = policy["spec"]["ingress"][1]["from"][0]
        assert operator_peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": namespace}
        assert scoped.proc is not None
        log = scoped.proc.log.read_text(errors="replace")
        # kopf neither tried cluster-scoped reads nor was refused anything.
        # Every refusal's text says forbidden (the API's reason "Forbidden" and its message "... is forbidden: ...",
        # kvfleet's ApiError "403 Forbidden: ..."); a bare "403" also matched a log line stamped at millisecond 403
        # and failed a run that had no refusal at all.
        assert "Not enough permissions" not in log and "forbidden" not in log.lower(), scoped.log()
    finally:
        scoped.stop()
        operator.start()
