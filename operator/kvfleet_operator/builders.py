"""Pure builders: an InferenceDeployment → its Deployment, Service, PDB, NetworkPolicy and (rarely) ConfigMap."""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from kvfleet_operator.core_types import LabelSelector, NetworkPolicyPeer
from kvfleet_operator.model_sources import ModelSource
from kvfleet_operator.models import API_VERSION, KIND, InferenceDeployment, InferenceDeploymentSpec
from kvfleet_operator.rules import API_KEY_ENV
from kvfleet_operator.speculative_models import DRAFT_MODELS_DIR, TARGET_MODELS_DIR

Manifest = dict[str, Any]

HTTP_PORT, GRPC_PORT = 8000, 50051
NAME_LABEL, INSTANCE_LABEL = "app.kubernetes.io/name", "app.kubernetes.io/instance"
MANAGED_BY_LABEL, OWNER_LABEL = "app.kubernetes.io/managed-by", "serving.kvfleet.dev/inference-deployment"
MANAGER = "kvfleet-operator"
CONFIG_HASH_ANNOTATION = "serving.kvfleet.dev/config-hash"
ARGS_FILE_DIR, ARGS_FILE_KEY = "/etc/kvfleet", "extra-args"
# Past this many characters of extraArgs, they move to a ConfigMap the agent reads as `@file` (argparse
# fromfile_prefix_chars), keeping the pod spec readable; a pod spec itself would take far more.
ARGS_INLINE_LIMIT = 4096
GPU_RESOURCE = "nvidia.com/gpu"
# spec.runtime.compileCache is mounted here; each compiler gets its own directory under it (they create them).
COMPILE_CACHE_DIR = "/var/cache/kvfleet"
COMPILE_CACHE_ENV = {"TRITON_CACHE_DIR": f"{COMPILE_CACHE_DIR}/triton",
                     "TORCHINDUCTOR_CACHE_DIR": f"{COMPILE_CACHE_DIR}/inductor"}
STARTUP_PERIOD_SECONDS, STARTUP_FAILURES = 10, 360  # model loads may take up to an hour before /health answers
# The NetworkPolicy admits pods of the InferenceDeployment's namespace that carry this label (routers, gateways,
# clients), and the operator's own pods (manifests/base/operator/deployment.yaml) in the operator's namespace.
CLIENT_LABEL, CLIENT_LABEL_VALUE = "serving.kvfleet.dev/client", "true"
OPERATOR_POD_LABELS = {NAME_LABEL: "kvfleet-operator"}
DEFAULT_OPERATOR_NAMESPACE = "kvfleet-system"


@dataclass
class Desired:
    """What the spec wants: objects to server-side apply, and owned objects to delete (kind, name); plan.py then
    decides, with the live objects, which of these may be written."""

    apply: list[Manifest] = field(default_factory=list)
    delete: list[tuple[str, str, str]] = field(default_factory=list)  # (apiVersion, kind, name)


def selector_labels(name: str) -> dict[str, str]:
    """The two labels that select a resource's pods; stable for its lifetime (Deployment selectors are immutable)."""
    return {OWNER_LABEL: name, MANAGED_BY_LABEL: MANAGER}


def selector_string(name: str) -> str:
    """selector_labels as the string the scale subresource reports (status.selector)."""
    return ",".join(f"{k}={v}" for k, v in selector_labels(name).items())


def common_labels(name: str) -> dict[str, str]:
    return {NAME_LABEL: "kvfleet-agent", INSTANCE_LABEL: name, **selector_labels(name)}


def owner_reference(cr: InferenceDeployment) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": KIND, "name": cr.metadata.name, "uid": cr.metadata.uid,
            "controller": True, "blockOwnerDeletion": True}


def _metadata(cr: InferenceDeployment, name: str) -> dict[str, Any]:
    return {"name": name, "namespace": cr.metadata.namespace, "labels": common_labels(cr.metadata.name),
            "ownerReferences": [owner_reference(cr)]}


def model_dir(spec: InferenceDeploymentSpec) -> str:
    """Where the agent finds the checkpoint inside its pod."""
    image = spec.model.source.image
    return image.path if image is not None else f"{TARGET_MODELS_DIR}/{spec.model.name}"


def draft_dir(spec: InferenceDeploymentSpec) -> str | None:
    """Where the agent finds the draft model's checkpoint (speculative method draft_model), or None."""
    sc = spec.runtime.speculative_config
    if sc is None or sc.draft_model is None:
        return None
    image = sc.draft_model.source.image
    return image.path if image is not None else f"{DRAFT_MODELS_DIR}/{spec.model.name}"


def agent_args(spec: InferenceDeploymentSpec, *, args_file: bool = False) -> list[str]:
    """`kvfleet-agent serve` arguments; every runtime value is explicit, so agent default changes never leak in."""
    rt = spec.runtime
    args = ["serve", "--model", model_dir(spec), "--served-model-name", spec.model.name,
            "--port", str(HTTP_PORT), "--grpc-port", str(GRPC_PORT), "--generation-config", "vllm",
            "--tensor-parallel-size", str(rt.tensor_parallel_size), "--dtype", rt.dtype,
            "--max-num-seqs", str(rt.max_num_seqs), "--block-size", str(rt.block_size),
            "--gpu-memory-utilization", str(rt.gpu_memory_utilization),
            "--max-queue-length", str(rt.max_queue_length),
            "--drain-grace-period", str(rt.drain_grace_period_seconds), "--metrics-compat", rt.metrics_compat]
    if rt.max_model_len is not None:
        args += ["--max-model-len", str(rt.max_model_len)]
    if rt.max_num_batched_tokens is not None:
        args += ["--max-num-batched-tokens", str(rt.max_num_batched_tokens)]
    # Both only when they say something (auto is the agent's default), so images without the flags still start.
    if rt.quantization is not None:
        args += ["--quantization", rt.quantization]
    if rt.kv_cache_dtype is not None and rt.kv_cache_dtype != "auto":
        args += ["--kv-cache-dtype", rt.kv_cache_dtype]
    if not rt.enable_prefix_caching:
        args.append("--no-prefix-caching")  # the agent has only the negative flags; on is its default
    if not rt.enable_chunked_prefill:
        args.append("--no-chunked-prefill")
    if rt.speculative_config is not None:  # the draft runs unsharded on rank 0: nothing to say about TP
        config = rt.speculative_config.agent_config(draft_dir(spec))
        args += ["--speculative-config", json.dumps(config, separators=(",", ":"))]
    return args + ([f"@{ARGS_FILE_DIR}/{ARGS_FILE_KEY}"] if args_file else list(rt.extra_args))


def _uses_args_file(spec: InferenceDeploymentSpec) -> bool:
    return sum(len(a) + 1 for a in spec.runtime.extra_args) > ARGS_INLINE_LIMIT


def _source_volume(src: ModelSource, name: str, path: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    mount = {"name": name, "mountPath": path, "readOnly": True}
    if src.pvc is not None:
        if src.pvc.path:
            mount["subPath"] = src.pvc.path
        claim = {"claimName": src.pvc.claim_name, "readOnly": True}
        return [{"name": name, "persistentVolumeClaim": claim}], [mount]
    if src.host_path is not None:
        return [{"name": name, "hostPath": {"path": src.host_path.path, "type": "Directory"}}], [mount]
    return [], []  # baked into the image


def _model_volume(spec: InferenceDeploymentSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The target model's volume and mount, then the draft model's (speculative method draft_model)."""
    volumes, mounts = _source_volume(spec.model.source, "model", model_dir(spec))
    sc, path = spec.runtime.speculative_config, draft_dir(spec)
    if sc is not None and sc.draft_model is not None and path is not None:
        draft_volumes, draft_mounts = _source_volume(sc.draft_model.source, "draft-model", path)
        volumes, mounts = volumes + draft_volumes, mounts + draft_mounts
    return volumes, mounts


def _compile_cache_volume(spec: InferenceDeploymentSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    cache = spec.runtime.compile_cache
    if cache is None:
        return [], []
    mount = {"name": "compile-cache", "mountPath": COMPILE_CACHE_DIR} | ({"subPath": cache.path} if cache.path else {})
    return [{"name": "compile-cache", "persistentVolumeClaim": {"claimName": cache.claim_name}}], [mount]


def _resources(spec: InferenceDeploymentSpec) -> dict[str, Any]:
    out: dict[str, dict[str, Any]] = {}
    for kind, lst in (("requests", spec.resources.requests), ("limits", spec.resources.limits)):
        if lst is not None:
            out[kind] = {k: str(v) for k, v in (("cpu", lst.cpu), ("memory", lst.memory)) if v is not None}
        if spec.gpus_per_replica:
            # Extended resources need requests == limits; setting both keeps that true whatever else is given.
            out.setdefault(kind, {})[GPU_RESOURCE] = str(spec.gpus_per_replica)
    return {k: v for k, v in out.items() if v}


def _env(spec: InferenceDeploymentSpec) -> list[dict[str, Any]]:
    # KVFLEET_HOST rather than --host: the local harness rebinds each agent to its pod IP through it.
    env: dict[str, dict[str, Any]] = {"KVFLEET_HOST": {"name": "KVFLEET_HOST", "value": "0.0.0.0"}}
    if (ref := spec.auth.api_key_secret_ref) is not None:
        # A reference only: the kubelet reads the Secret, never the operator, and the key stays out of the pod spec.
        env[API_KEY_ENV] = {"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}
    if spec.runtime.compile_cache is not None:
        env.update({k: {"name": k, "value": v} for k, v in COMPILE_CACHE_ENV.items()})
    env.update({e.name: e.manifest() for e in spec.pod.env})  # a user entry for the same name wins (in place)
    return list(env.values())


def _probe(path: str, period: int, failures: int, timeout: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period, "failureThreshold": failures,
            "timeoutSeconds": timeout}


def _container(spec: InferenceDeploymentSpec, image: str, args_file: bool) -> dict[str, Any]:
    _, mounts = _model_volume(spec)
    mounts = [{"name": "tmp", "mountPath": "/tmp"}, *mounts, *_compile_cache_volume(spec)[1]]
    if spec.runtime.tensor_parallel_size > 1:
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})  # TP workers exchange tensors through shared memory
    if args_file:
        mounts.append({"name": "args", "mountPath": ARGS_FILE_DIR, "readOnly": True})
    c: dict[str, Any] = {
        "name": "agent", "image": image, "command": ["kvfleet-agent"], "args": agent_args(spec, args_file=args_file),
        "env": _env(spec),
        "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"},
                  {"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"}],
        "startupProbe": _probe("/health", STARTUP_PERIOD_SECONDS, STARTUP_FAILURES, 5),
        "readinessProbe": _probe("/ready", 5, 3, 3),
        "livenessProbe": _probe("/health", 15, 4, 5),
        # Endpoints take a moment to drop a terminating pod; keep serving until they have (the agent then drains).
        "lifecycle": {"preStop": {"sleep": {"seconds": 5}}},
        "volumeMounts": mounts,
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}},
    }
    if spec.image_pull_policy:
        c["imagePullPolicy"] = spec.image_pull_policy
    if resources := _resources(spec):
        c["resources"] = resources
    return c


def pod_template(cr: InferenceDeployment, default_image: str) -> dict[str, Any]:
    """The agent pod template, with the config-hash annotation over everything that shapes a pod."""
    spec, name = cr.spec, cr.metadata.name
    args_file = _uses_args_file(spec)
    model_volumes, _ = _model_volume(spec)
    volumes = [{"name": "tmp", "emptyDir": {}}, *model_volumes, *_compile_cache_volume(spec)[0]]
    if spec.runtime.tensor_parallel_size > 1:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
    if args_file:
        volumes.append({"name": "args", "configMap": {"name": args_config_map_name(name)}})
    tolerations = [t.model_dump(by_alias=True, exclude_none=True) for t in spec.pod.tolerations]
    if spec.gpus_per_replica:
        tolerations.insert(0, {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
    pod: dict[str, Any] = {
        "automountServiceAccountToken": False,  # the agent never calls the Kubernetes API
        "enableServiceLinks": False,  # service links would inject e.g. KVFLEET_PORT, which the agent reads as a flag
        "terminationGracePeriodSeconds": spec.runtime.drain_grace_period_seconds + 15,
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [_container(spec, spec.image or default_image, args_file)],
        "volumes": volumes,
    }
    for key, value in (("nodeSelector", spec.pod.node_selector), ("tolerations", tolerations),
                       ("affinity", spec.pod.affinity), ("priorityClassName", spec.pod.priority_class_name),
                       ("serviceAccountName", spec.pod.service_account_name)):
        if value:
            pod[key] = copy.deepcopy(value)
    template = {"metadata": {"labels": {**spec.pod.labels, **common_labels(name)},
                             "annotations": dict(spec.pod.annotations)}, "spec": pod}
    extra = {"args": _args_file_text(spec)} if args_file else {}
    template["metadata"]["annotations"][CONFIG_HASH_ANNOTATION] = config_hash(template, extra)
    return template


def config_hash(template: dict[str, Any], extra: dict[str, Any]) -> str:
    """A short digest of the pod template and the files it reads: it changes exactly when pods must roll."""
    blob = json.dumps({"template": template, "files": extra}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def deployment(cr: InferenceDeployment, default_image: str, replicas: int) -> Manifest:
    """The agents' Deployment. `replicas` is explicit: under server-side apply an omitted field drops ownership."""
    name = cr.metadata.name
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": _metadata(cr, name),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector_labels(name)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            # Longer than the startup probe's budget, so a slow model load is not reported as a stalled rollout.
            "progressDeadlineSeconds": STARTUP_PERIOD_SECONDS * STARTUP_FAILURES + 300,
            "revisionHistoryLimit": 3,
            "template": pod_template(cr, default_image),
        },
    }


def service(cr: InferenceDeployment) -> Manifest:
    """ClusterIP Service over the ready agents: HTTP (OpenAI API and /metrics) and gRPC."""
    return {
        "apiVersion": "v1", "kind": "Service", "metadata": _metadata(cr, cr.metadata.name),
        "spec": {"type": "ClusterIP", "selector": selector_labels(cr.metadata.name),
                 "ports": [{"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"},
                           {"name": "grpc", "port": GRPC_PORT, "targetPort": "grpc", "protocol": "TCP",
                            "appProtocol": "kubernetes.io/h2c"}]},
    }


def pod_disruption_budget(cr: InferenceDeployment) -> Manifest:
    """At most one agent down for voluntary disruptions (node drains); unready pods never block a drain."""
    return {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _metadata(cr, cr.metadata.name),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(cr.metadata.name)},
                 "unhealthyPodEvictionPolicy": "AlwaysAllow"},
    }


def network_policy_name(name: str) -> str:
    # Not the bare name: a NetworkPolicy named after the app is often there already, written by its team.
    return f"{name}-agents"


def _selector(sel: LabelSelector) -> dict[str, Any]:
    """A label selector without empty lists; `{}` (everything) stays `{}`."""
    out: dict[str, Any] = {}
    if sel.match_labels:
        out["matchLabels"] = dict(sel.match_labels)
    if sel.match_expressions:
        out["matchExpressions"] = [{"key": r.key, "operator": r.operator, **({"values": list(r.values)} if r.values
                                                                              else {})}
                                   for r in sel.match_expressions]
    return out


def _peer(peer: NetworkPolicyPeer) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if peer.pod_selector is not None:
        out["podSelector"] = _selector(peer.pod_selector)
    if peer.namespace_selector is not None:
        out["namespaceSelector"] = _selector(peer.namespace_selector)
    if peer.ip_block is not None:
        out["ipBlock"] = {"cidr": peer.ip_block.cidr, **({"except": list(peer.ip_block.except_)}
                                                         if peer.ip_block.except_ else {})}
    return out


def network_policy(cr: InferenceDeployment, operator_namespace: str) -> Manifest:
    """Ingress to the agents: HTTP and gRPC from labelled clients in the namespace and the spec's extra peers; HTTP
    from the operator, which scrapes /metrics. Kubelet probes come from the node, which network plugins admit."""
    name = cr.metadata.name

    def ports(*numbers: int) -> list[dict[str, Any]]:
        return [{"protocol": "TCP", "port": n} for n in numbers]

    clients = [{"podSelector": {"matchLabels": {CLIENT_LABEL: CLIENT_LABEL_VALUE}}},
               *(_peer(p) for p in cr.spec.network_policy.from_)]
    operator = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": operator_namespace}},
                "podSelector": {"matchLabels": dict(OPERATOR_POD_LABELS)}}
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": _metadata(cr, network_policy_name(name)),
        "spec": {"podSelector": {"matchLabels": selector_labels(name)}, "policyTypes": ["Ingress"],
                 "ingress": [{"from": clients, "ports": ports(HTTP_PORT, GRPC_PORT)},
                             {"from": [operator], "ports": ports(HTTP_PORT)}]},
    }


def args_config_map_name(name: str) -> str:
    return f"{name}-args"


def _args_file_text(spec: InferenceDeploymentSpec) -> str:
    return "".join(f"{a}\n" for a in spec.runtime.extra_args)  # argparse reads one argument per line


def args_config_map(cr: InferenceDeployment) -> Manifest:
    """extraArgs too long to inline, as the file the agent reads through `@/etc/kvfleet/extra-args`."""
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _metadata(cr, args_config_map_name(cr.metadata.name)),
            "data": {ARGS_FILE_KEY: _args_file_text(cr.spec)}}


def plan(cr: InferenceDeployment, default_image: str, replicas: int, *,
         operator_namespace: str = DEFAULT_OPERATOR_NAMESPACE) -> Desired:
    """Everything one reconcile applies or removes, in apply order (the ConfigMap before the pods that mount it)."""
    out = Desired()
    name = cr.metadata.name
    if _uses_args_file(cr.spec):
        out.apply.append(args_config_map(cr))
    else:
        out.delete.append(("v1", "ConfigMap", args_config_map_name(name)))
    out.apply += [deployment(cr, default_image, replicas), service(cr), pod_disruption_budget(cr)]
    if cr.spec.network_policy.enabled:
        out.apply.append(network_policy(cr, operator_namespace))
    else:
        out.delete.append(("networking.k8s.io/v1", "NetworkPolicy", network_policy_name(name)))
    return out


def replicas_for(spec: InferenceDeploymentSpec, current: int | None) -> int:
    """The Deployment's replica count for this reconcile; `current` is the live Deployment's (None before creation).

    off/external: spec.replicas, which an HPA or KEDA may drive through the scale subresource.
    builtin: the autoscaler owns the number. The reconcile keeps the live value (minReplicas on creation),
    clamped to [minReplicas, maxReplicas] so an edited bound takes effect at once.
    The builtin autoscaler (autoscaling/loop.py) applies its decision through reconcile.apply_desired(), the
    same full plan with `replicas` set to the decision; this function must never undo that, so it only keeps
    and clamps.
    """
    if spec.autoscaling.mode != "builtin":
        return spec.replicas
    a = spec.autoscaling
    return min(max(current if current is not None else a.min_replicas, a.min_replicas), a.max_replicas)
