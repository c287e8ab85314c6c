"""Fake nodes run by kwok (GPU nodes, and an untainted CPU node): labels, taint, capacity, kwok's stages, readiness."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from errors import ClusterError
from podspec import KWOK_LOCAL_EXCLUSION

# Fake GPU nodes: kwok manages nodes carrying this annotation; workloads need the GPU toleration.
KWOK_ANNOTATION_KEY = "kwok.x-k8s.io/node"
KWOK_ANNOTATION_VALUE = "fake"
GPU_RESOURCE = "nvidia.com/gpu"
GPU_LABEL = "nvidia.com/gpu.present"
GPU_TAINT: dict[str, str] = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
GPU_TOLERATION: dict[str, str] = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
NODE_PREFIX = "kvfleet-gpu-"
# A plain CPU node (no GPU label, taint or capacity), for workloads that take no GPU (manifests/samples/tiny-cpu.yaml).
# kwok manages it like the GPU nodes (the same annotation), so the process kubelet runs agent pods on it too.
CPU_NODE_PREFIX = "kvfleet-cpu-"
CPU_NODE_RESOURCES = {"cpu": "16", "memory": "64Gi", "pods": "110", "ephemeral-storage": "1Ti"}

NODE_IP = "10.249.0.1"  # InternalIP kwok reports for every fake node

# kwok v0.8 has no built-in stages; these are the files kwokctl uses by default, read from the
# kwok module that build.sh downloaded (never copied into the repo).
KWOK_STAGE_FILES = (
    "kustomize/stage/node/fast/node-initialize.yaml",
    "kustomize/stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "kustomize/stage/pod/fast/pod-ready.yaml",
    "kustomize/stage/pod/fast/pod-complete.yaml",
    "kustomize/stage/pod/fast/pod-delete.yaml",
)


def node_manifest(name: str, gpus_per_node: int) -> dict[str, Any]:
    """A fake GPU node: kwok-managed, labelled and tainted for GPUs, with nvidia.com/gpu capacity."""
    resources = {"cpu": "64", "memory": "512Gi", "pods": "110", "ephemeral-storage": "1Ti",
                 GPU_RESOURCE: str(gpus_per_node)}
    node = _kwok_node(name, resources)
    node["metadata"]["labels"].update({GPU_LABEL: "true", "nvidia.com/gpu.count": str(gpus_per_node)})
    node["spec"] = {"taints": [dict(GPU_TAINT)]}
    return node


def cpu_node_manifest(name: str) -> dict[str, Any]:
    """A fake CPU node: kwok-managed, untainted, with no GPU label or capacity."""
    return _kwok_node(name, dict(CPU_NODE_RESOURCES))


def _kwok_node(name: str, resources: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {KWOK_ANNOTATION_KEY: KWOK_ANNOTATION_VALUE, "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
            },
        },
        "spec": {},
        # Kept on create (as when a kubelet registers); kwok's node-initialize stage keeps it too.
        "status": {"capacity": dict(resources), "allocatable": dict(resources)},
    }


def nodes_ready(nodes: Sequence[dict[str, Any]], leases: Sequence[dict[str, Any]], names: Sequence[str]) -> bool:
    """The named nodes are Ready, have a heartbeat lease, and KCM has lifted the not-ready taint (else no scheduling).

    nodes and leases are the items of a Node list and of a kube-node-lease Lease list.
    """
    items = {n["metadata"]["name"]: n for n in nodes}
    lease_names = {x["metadata"]["name"] for x in leases}
    for name in names:
        node = items.get(name)
        if node is None or name not in lease_names:
            return False
        conds = {c["type"]: c["status"] for c in node.get("status", {}).get("conditions", [])}
        taints = {t["key"] for t in node.get("spec", {}).get("taints", [])}
        if conds.get("Ready") != "True" or any(k.startswith("node.kubernetes.io/") for k in taints):
            return False
    return True


def kwok_module_dir(kwok: Path) -> Path:
    """The source dir of the kwok module matching the kwok binary, from Go's module cache."""
    out = subprocess.run([str(kwok), "--version"], capture_output=True, text=True, check=False).stdout
    version = next((w for w in out.split() if w.startswith("v") and w[1:2].isdigit()), None)
    if version is None:
        raise ClusterError(f"cannot read a version from `{kwok} --version`: {out!r}")
    env = dict(os.environ, GOWORK="off", GOFLAGS="-mod=mod")
    with tempfile.TemporaryDirectory(prefix="kvfleet-kwok-mod-") as tmp:  # no go.mod around: module mode only
        try:
            proc = subprocess.run(
                ["go", "mod", "download", "-json", f"sigs.k8s.io/kwok@{version}"],
                cwd=tmp,
                env=env,
                capture_output=True,
                text=True,
                check=False,
            )
        except FileNotFoundError as exc:
            raise ClusterError("`go` is not on PATH; it locates kwok's stage files in the module cache") from exc
    try:
        info = json.loads(proc.stdout)
        return Path(info["Dir"])
    except (ValueError, KeyError) as exc:
        raise ClusterError(
            f"`go mod download sigs.k8s.io/kwok@{version}` failed; kwok's stage files come from that module: "
            f"{proc.stdout.strip()} {proc.stderr.strip()}"
        ) from exc


def _with_agent_exclusion(stage: str) -> str:
    """A kwok pod stage that no longer matches the agent and router pods the process kubelet runs (the YAML edited
    as text: no YAML parser here)."""
    anchor = "    matchExpressions:\n"
    if anchor not in stage:
        raise ClusterError(f"kwok pod stage without a matchExpressions list; cannot exclude agent pods:\n{stage}")
    rule = KWOK_LOCAL_EXCLUSION  # the pods the process kubelet runs (podspec.runs_locally)
    values = "".join(f"      - {v!r}\n" for v in rule["values"])
    lines = f"    - key: {rule['key']!r}\n      operator: {rule['operator']!r}\n      values:\n{values}"
    return stage.replace(anchor, anchor + lines, 1)


def write_kwok_config(path: Path, kwok: Path) -> None:
    """kwok's config at path: the default kwokctl stages, from the module matching the kwok binary."""
    mod = kwok_module_dir(kwok)
    docs = []
    for rel in KWOK_STAGE_FILES:
        src = mod / rel
        if not src.is_file():
            raise ClusterError(f"kwok stage file missing: {src}")
        text = src.read_text().strip()
        if "/pod/" in rel:
            text = _with_agent_exclusion(text)
        docs.append(text)
    path.write_text("\n---\n".join(docs) + "\n")
