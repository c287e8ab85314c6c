"""Fixtures of the cluster tier (`-m cluster`): one local control plane per session, fresh namespaces, a tiny model."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # e2e/ is not a package
from cluster import ClusterError, LocalCluster, find_bin_dir
from kube_util import GPU_NODES, GPUS_PER_NODE, wait_for
from operator_proc import Operator, install


def _skip_reason() -> str | None:
    """Why the cluster tier cannot run here (binaries not built and KVFLEET_BUILD_K8S unset), or None."""
    if os.environ.get("KVFLEET_BUILD_K8S"):
        return None  # the session fixture builds them (about 10 min cold)
    try:
        if find_bin_dir(build=False) is None:
            return ("control-plane binaries are not built: run `bash e2e/build.sh` (about 10 min) "
                    "or set KVFLEET_BUILD_K8S=1 to build them in the fixture")
    except ClusterError as exc:
        return f"cannot locate the control-plane binaries: {exc}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).resolve().parent
    reason = _skip_reason()
    for item in items:
        if Path(str(item.fspath)).resolve().parent == here:
            item.add_marker(pytest.mark.cluster)
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def cluster() -> Iterator[LocalCluster]:
    """One control plane, pod network and process kubelet for the session; KVFLEET_E2E_KEEP=1 keeps its logs."""
    bin_dir = find_bin_dir(build=bool(os.environ.get("KVFLEET_BUILD_K8S")))
    assert bin_dir is not None
    c = LocalCluster(gpu_nodes=GPU_NODES, gpus_per_node=GPUS_PER_NODE, bin_dir=bin_dir,
                     keep=bool(os.environ.get("KVFLEET_E2E_KEEP")))
    c.start()
    print(f"\ncluster up in {c.timings['total']:.1f}s: {c.timings} (run dir {c.run_dir})")
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def namespace(cluster: LocalCluster) -> Iterator[str]:
    """A fresh namespace; afterwards its pods are deleted (waited for, so they free their GPUs), then it is.

    The namespace itself is not waited for: the namespace controller holds every deletion for a fixed
    5 s grace period; test_namespace_deletion_completes covers it once.
    """
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    # InferenceDeployments and InferenceRouters first (if their CRDs are installed), or the operator would recreate
    # what they own.
    for kind in ("inferencedeployments", "inferencerouters"):
        cluster.kubectl("delete", kind, "--all", "-n", name, "--wait=false", check=False)
    cluster.kubectl("delete", "deployments,replicasets,pods", "--all", "-n", name, "--wait=false")
    wait_for(f"pods in {name} deleted", lambda: not cluster.kubectl_json("get", "pods", "-n", name)["items"])
    cluster.kubectl("delete", "namespace", name, "--wait=false")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama checkpoint with a locally trained tokenizer, for agents in pods."""
    path = tmp_path_factory.mktemp("models") / "tiny"
    agent = Path(sys.executable).parent / "kvfleet-agent"
    subprocess.run([str(agent), "model", "init-tiny", str(path)], check=True, capture_output=True)
    return path


@pytest.fixture(scope="session")
def operator(cluster: LocalCluster) -> Iterator[Operator]:
    """CRDs and RBAC from manifests/base, and one operator process (its ServiceAccount) for the session."""
    install(cluster)
    op = Operator(cluster)
    op.start()
    try:
        yield op
    finally:
        op.stop()
