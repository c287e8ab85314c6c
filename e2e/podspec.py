"""Pure translation of a pod's first container into a local process: argv, environment, paths and probes.

The process kubelet runs every agent and router pod in one shared network namespace and without a mount
namespace, so it adapts four things a real kubelet gets from the container runtime:
- bind address: 0.0.0.0 would collide between pods, so KVFLEET_HOST (and any --host argument) is
  rewritten to the pod's own IP, which is what 0.0.0.0 means inside a real pod;
- volumes: a mount path in an argument or env value is rewritten to the directory that backs it
  (hostPath as is; a PVC is RUN_DIR/pvc/<namespace>/<claimName>; emptyDir and ConfigMap volumes are
  directories under the pod's own dir);
- probes: periods are capped (max_period) so tests do not wait out production-sized intervals;
- a router pod's API credentials (automountServiceAccountToken not false): a real kubelet mounts a
  projected token of the pod's ServiceAccount under /var/run/secrets/kubernetes.io/serviceaccount, and the
  apiserver is found through KUBERNETES_SERVICE_HOST/PORT; without a mount namespace or a Service network,
  the process gets KUBECONFIG instead: a file in its pod dir naming the apiserver as the pod network sees
  it (https://127.0.0.1:<api port>, the relay the operator uses too), the cluster CA, and a tokenFile
  beside it. The token comes from the TokenRequest API for the pod's ServiceAccount, bound to the pod,
  and is renewed before it expires (pod_runner.py), as a projected token is. The process kubelet asks as
  admin; a node's own kubelet may ask for exactly this token (the Node authorizer and NodeRestriction
  allow tokens bound to pods on that node), which e2e/test_router_operator.py checks by impersonating the
  node. POD_NAMESPACE and POD_NAME are set too (a real pod reads its namespace from the token mount).
Agent pods get none of this: they never call the API.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

AGENT_COMMAND, ROUTER_COMMAND = "kvfleet-agent", "kvfleet-router"
LOCAL_COMMANDS = (AGENT_COMMAND, ROUTER_COMMAND)
_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
CREDENTIALS_DIR = "serviceaccount"  # in the pod dir: kubeconfig, token


# kwok's selector for the pods it must leave alone: the same rule as runs_locally, as a jq query.
KWOK_LOCAL_EXCLUSION = {"key": ".spec.containers.[0].command.[0]", "operator": "NotIn",
                        "values": list(LOCAL_COMMANDS)}


def _command(pod: Mapping[str, Any]) -> str:
    containers = pod.get("spec", {}).get("containers") or [{}]
    return str((containers[0].get("command") or [""])[0])


def runs_locally(pod: Mapping[str, Any]) -> bool:
    """Whether the pod's first container's command is exactly `kvfleet-agent` or `kvfleet-router` (resolved on the
    kubelet's PATH).

    Exactly those words, no path: the process kubelet runs only the programs installed beside it, never an
    arbitrary host binary a pod names, and kwok's selector (KWOK_LOCAL_EXCLUSION) uses the same rule.
    """
    return _command(pod) in LOCAL_COMMANDS


def needs_credentials(pod: Mapping[str, Any]) -> bool:
    """A router pod that keeps its ServiceAccount token (see the module docstring)."""
    return _command(pod) == ROUTER_COMMAND and pod.get("spec", {}).get("automountServiceAccountToken") is not False


def kubeconfig(server: str, ca_pem: bytes, namespace: str, token_file: str) -> str:
    """A kubeconfig for a pod's process: the apiserver as the pod network reaches it, the cluster CA, and the
    token file beside it (relative: resolved against the kubeconfig's own directory)."""
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "pod",
        "clusters": [{"name": "cluster", "cluster": {
            "server": server, "certificate-authority-data": base64.b64encode(ca_pem).decode()}}],
        "users": [{"name": "serviceaccount", "user": {"tokenFile": token_file}}],
        "contexts": [{"name": "pod", "context": {"cluster": "cluster", "user": "serviceaccount",
                                                 "namespace": namespace}}],
    }
    return json.dumps(config, indent=1) + "\n"  # JSON is YAML


def expand(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined variables are substituted, $$ escapes, unknown refs stay."""
    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env.get(name, m.group(0))

    return _VAR_REF.sub(sub, value)


def field_ref(pod: Mapping[str, Any], path: str, pod_ip: str, host_ip: str) -> str:
    """The downward-API fields a pod spec can reference in env (fieldRef.fieldPath)."""
    meta = pod.get("metadata", {})
    values = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": pod.get("spec", {}).get("nodeName", ""),
        "spec.serviceAccountName": pod.get("spec", {}).get("serviceAccountName", ""),
        "status.podIP": pod_ip,
        "status.hostIP": host_ip,
    }
    if path in values:
        return str(values[path])
    m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if m:
        return str(meta.get(m.group(1), {}).get(m.group(2), ""))
    raise ValueError(f"fieldRef {path!r} is not supported by the process kubelet")


@dataclass(frozen=True)
class Probe:
    """An httpGet probe, as the kubelet runs it."""

    path: str
    port: int
    period: float
    failure_threshold: int
    initial_delay: float
    timeout: float


@dataclass
class ProcessSpec:
    """What to run for one pod: the program, its environment and working dir, and its probes."""

    argv: list[str]
    env: dict[str, str]
    cwd: Path
    dirs: list[Path] = field(default_factory=list)  # to create before start (emptyDir and friends)
    files: dict[Path, str] = field(default_factory=dict)  # ConfigMap volume contents
    startup: Probe | None = None
    readiness: Probe | None = None
    liveness: Probe | None = None
    grace_seconds: float = 30.0
    restart_policy: str = "Always"
    pre_stop_sleep: float = 0.0  # lifecycle.preStop.sleep: before SIGTERM, within the grace period
    credentials: Path | None = None  # where the kubelet writes the kubeconfig and token (needs_credentials)


def _probe(kind: str, spec: Mapping[str, Any] | None, ports: Mapping[str, int], max_period: float) -> Probe | None:
    """An httpGet probe with its period capped at max_period; the failure budget (period × threshold) is kept."""
    if not spec:
        return None
    if "httpGet" not in spec:
        raise ValueError(f"{kind}: only httpGet probes are supported by the process kubelet, not {sorted(spec)}")
    get = spec["httpGet"]
    if get.get("scheme", "HTTP") != "HTTP" or get.get("host"):
        raise ValueError(f"{kind}: httpGet with scheme or host is not supported by the process kubelet")
    port = get.get("port", 80)
    if isinstance(port, str) and port not in ports:
        raise ValueError(f"{kind}: the container has no port named {port!r}")
    period = float(spec.get("periodSeconds", 10))
    capped = min(period, max_period)
    threshold = int(spec.get("failureThreshold", 3))
    return Probe(path=get.get("path", "/"), port=ports[port] if isinstance(port, str) else int(port),
                 period=capped, failure_threshold=max(threshold, round(threshold * period / capped)),
                 initial_delay=float(spec.get("initialDelaySeconds", 0)),
                 timeout=float(spec.get("timeoutSeconds", 1)))


def _volume_dirs(pod: Mapping[str, Any], pod_dir: Path, run_dir: Path,
                 configmaps: Mapping[str, Mapping[str, str]]) -> tuple[dict[str, Path], dict[Path, str]]:
    """Each volume name → the local directory backing it; plus files to write for ConfigMap volumes."""
    namespace = pod["metadata"]["namespace"]
    dirs: dict[str, Path] = {}
    files: dict[Path, str] = {}
    for vol in pod["spec"].get("volumes", []):
        name = vol["name"]
        if "hostPath" in vol:
            dirs[name] = Path(vol["hostPath"]["path"])
        elif "persistentVolumeClaim" in vol:
            dirs[name] = run_dir / "pvc" / namespace / vol["persistentVolumeClaim"]["claimName"]
        elif "emptyDir" in vol or "configMap" in vol or "projected" in vol:
            dirs[name] = pod_dir / "volumes" / name
            # A projected volume (e.g. the service-account one) gets its ConfigMap sources and the
            # namespace; token sources are left out (nothing here reads them).
            sources = [vol] if "configMap" in vol else vol.get("projected", {}).get("sources", [])
            for source in sources:
                if "configMap" in source:
                    data = configmaps.get(source["configMap"]["name"], {})
                    items = source["configMap"].get("items") or [{"key": k, "path": k} for k in data]
                    for item in items:
                        files[dirs[name] / item["path"]] = data.get(item["key"], "")
                for item in source.get("downwardAPI", {}).get("items", []):
                    files[dirs[name] / item["path"]] = field_ref(pod, item["fieldRef"]["fieldPath"], "", "")
    return dirs, files


def _env_refs(pod: Mapping[str, Any], kind: str) -> set[str]:
    """Names of the objects (secretKeyRef or configMapKeyRef) the first container's env reads."""
    env = pod["spec"]["containers"][0].get("env", [])
    return {var["valueFrom"][kind]["name"] for var in env if kind in var.get("valueFrom", {})}


def configmap_names(pod: Mapping[str, Any]) -> set[str]:
    """ConfigMaps the pod's volumes read (the kubelet fetches them before start)."""
    names = set()
    for vol in pod["spec"].get("volumes", []):
        sources = [vol] if "configMap" in vol else vol.get("projected", {}).get("sources", [])
        names |= {src["configMap"]["name"] for src in sources if "configMap" in src}
    return names


def env_object_names(pod: Mapping[str, Any]) -> dict[str, set[str]]:
    """The ConfigMaps and Secrets the first container's env reads, by plural ("configmaps", "secrets")."""
    return {"configmaps": _env_refs(pod, "configMapKeyRef"), "secrets": _env_refs(pod, "secretKeyRef")}


def _key_ref(var: Mapping[str, Any], kind: str, objects: Mapping[str, Mapping[str, str]]) -> str | None:
    """A secretKeyRef or configMapKeyRef's value; None when it is missing and optional (the variable is left out).
    A missing required one raises, as a kubelet reports CreateContainerConfigError and retries."""
    ref = var["valueFrom"][kind]
    data = objects.get(ref["name"])
    if data is not None and ref["key"] in data:
        return data[ref["key"]]
    if ref.get("optional"):
        return None
    what = "secret" if kind == "secretKeyRef" else "configmap"
    raise ValueError(f"env {var['name']}: {what} {ref['name']!r}" + (" not found" if data is None
                                                                      else f" has no key {ref['key']!r}"))


def process_spec(pod: Mapping[str, Any], pod_ip: str, host_ip: str, pod_dir: Path, run_dir: Path,
                 base_env: Mapping[str, str], configmaps: Mapping[str, Mapping[str, str]] | None = None,
                 max_period: float = 1.0, secrets: Mapping[str, Mapping[str, str]] | None = None) -> ProcessSpec:
    """The local process for pod's first container; ValueError names what the process kubelet cannot do."""
    container = pod["spec"]["containers"][0]
    vol_dirs, files = _volume_dirs(pod, pod_dir, run_dir, configmaps or {})
    mounts: list[tuple[str, Path]] = []
    for m in container.get("volumeMounts", []):
        if m["name"] not in vol_dirs:
            raise ValueError(f"volume {m['name']!r} has a type the process kubelet does not support")
        mounts.append((m["mountPath"].rstrip("/") or "/", vol_dirs[m["name"]] / m.get("subPath", "")))
    mounts.sort(key=lambda mp: len(mp[0]), reverse=True)  # the most specific mount wins

    def local(value: str) -> str:
        """A path under a mount → the directory behind it; also after `@` (args file) and in `--flag=PATH`."""
        prefix, _, rest = value.rpartition("=") if value.startswith("--") and "=" in value else ("", "", value)
        at = "@" if rest.startswith("@") else ""
        path = rest[len(at):]
        for mount_path, directory in mounts:
            if path == mount_path or path.startswith(mount_path + "/"):
                path = str(directory) + path[len(mount_path):]
                break
        return f"{prefix}{'=' if prefix else ''}{at}{path}"

    env: dict[str, str] = {"HOME": str(pod_dir), "HOSTNAME": pod["metadata"]["name"]}
    env.update(base_env)
    credentials = pod_dir / CREDENTIALS_DIR if needs_credentials(pod) else None
    if credentials is not None:
        env.update({"KUBECONFIG": str(credentials / "kubeconfig"), "POD_NAMESPACE": pod["metadata"]["namespace"],
                    "POD_NAME": pod["metadata"]["name"]})
    for var in container.get("env", []):
        if "valueFrom" in var:
            source = var["valueFrom"]
            value: str | None
            if "fieldRef" in source:
                value = field_ref(pod, source["fieldRef"]["fieldPath"], pod_ip, host_ip)
            elif "secretKeyRef" in source:
                value = _key_ref(var, "secretKeyRef", secrets or {})
            elif "configMapKeyRef" in source:
                value = _key_ref(var, "configMapKeyRef", configmaps or {})
            else:
                raise ValueError(f"env {var['name']}: valueFrom {sorted(source)} is not supported by the process "
                                 "kubelet (fieldRef, secretKeyRef and configMapKeyRef are)")
            if value is not None:
                env[var["name"]] = value
        elif var["name"] != "PATH":  # the kubelet's PATH finds kvfleet-agent; a pod cannot redirect it
            env[var["name"]] = local(expand(var.get("value", ""), env))
    env["KVFLEET_HOST"] = pod_ip  # see the module docstring: 0.0.0.0 would be shared by every pod here
    for mount_path, directory in mounts:
        if mount_path == "/tmp":
            env["TMPDIR"] = str(directory)

    argv = [local(expand(a, env)) for a in [*container.get("command", []), *container.get("args", [])]]
    for i, arg in enumerate(argv):
        if arg == "--host" and i + 1 < len(argv):
            argv[i + 1] = pod_ip
        elif arg.startswith("--host="):
            argv[i] = f"--host={pod_ip}"

    ports = {p["name"]: int(p["containerPort"]) for p in container.get("ports", []) if "name" in p}
    grace = pod["metadata"].get("deletionGracePeriodSeconds", pod["spec"].get("terminationGracePeriodSeconds", 30))
    return ProcessSpec(
        argv=argv, env=env, cwd=pod_dir,
        dirs=sorted({d for d in vol_dirs.values() if d.is_relative_to(pod_dir)} | {pod_dir}
                    | ({credentials} if credentials is not None else set())),
        files=files,
        startup=_probe("startupProbe", container.get("startupProbe"), ports, max_period),
        readiness=_probe("readinessProbe", container.get("readinessProbe"), ports, max_period),
        liveness=_probe("livenessProbe", container.get("livenessProbe"), ports, max_period),
        restart_policy=pod["spec"].get("restartPolicy", "Always"),
        pre_stop_sleep=float(container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)),
        grace_seconds=float(grace),
        credentials=credentials,
    )
