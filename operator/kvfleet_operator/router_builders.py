"""Pure builders: an InferenceRouter → its ServiceAccount, a Role and RoleBinding per watched namespace, Deployment,
Service and PodDisruptionBudget."""

from __future__ import annotations

import copy
import json
from typing import Any

from kvfleet_contract.metrics import ROUTER_APP, ROUTER_PORT
from kvfleet_operator.builders import (
    CLIENT_LABEL,
    CLIENT_LABEL_VALUE,
    INSTANCE_LABEL,
    MANAGED_BY_LABEL,
    MANAGER,
    NAME_LABEL,
    Manifest,
)
from kvfleet_operator.models import API_VERSION, GROUP, PLURAL
from kvfleet_operator.router_models import ROUTER_KIND, InferenceRouter, InferenceRouterSpec

RBAC_API = "rbac.authorization.k8s.io/v1"
# Every Role and RoleBinding of a router carries these, so the operator finds its own in any namespace: a grant in
# another namespace than the router's cannot have an owner reference (garbage collection would delete it at once).
ROUTER_LABEL = "serving.kvfleet.dev/inference-router"
ROUTER_NAMESPACE_LABEL = "serving.kvfleet.dev/inference-router-namespace"
GRANTS_SELECTOR = f"{MANAGED_BY_LABEL}={MANAGER},{ROUTER_NAMESPACE_LABEL}"  # every router's grants
# What the router's discovery reads in a watched namespace, and nothing else (no Secrets, no writes).
GRANTED_RULES = [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
                 {"apiGroups": [GROUP], "resources": [PLURAL], "verbs": ["get", "list", "watch"]}]
TERMINATION_GRACE_SECONDS = 70  # the preStop pause, then up to a minute for relayed streams to finish


def selector_labels(name: str) -> dict[str, str]:
    """The router pods' selector; stable for the router's lifetime (Deployment selectors are immutable)."""
    return {NAME_LABEL: ROUTER_APP, INSTANCE_LABEL: name, MANAGED_BY_LABEL: MANAGER}


def common_labels(name: str) -> dict[str, str]:
    return {**selector_labels(name), ROUTER_LABEL: name}


def grant_name(namespace: str, name: str) -> str:
    """The Role and RoleBinding of router `namespace`/`name` in each watched namespace (unique across routers:
    namespaces and router names hold no ':')."""
    return f"kvfleet-router:{namespace}:{name}"


def grant_selector(namespace: str, name: str) -> str:
    """The label selector of one router's Roles and RoleBindings, wherever they are."""
    return f"{MANAGED_BY_LABEL}={MANAGER},{ROUTER_LABEL}={name},{ROUTER_NAMESPACE_LABEL}={namespace}"


def owner_reference(cr: InferenceRouter) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": ROUTER_KIND, "name": cr.metadata.name, "uid": cr.metadata.uid,
            "controller": True, "blockOwnerDeletion": True}


def _metadata(cr: InferenceRouter, name: str) -> dict[str, Any]:
    return {"name": name, "namespace": cr.metadata.namespace, "labels": common_labels(cr.metadata.name),
            "ownerReferences": [owner_reference(cr)]}


def _grant_metadata(cr: InferenceRouter, namespace: str) -> dict[str, Any]:
    meta = cr.metadata
    out: dict[str, Any] = {"name": grant_name(meta.namespace, meta.name), "namespace": namespace,
                           "labels": {**common_labels(meta.name), ROUTER_NAMESPACE_LABEL: meta.namespace}}
    if namespace == meta.namespace:
        out["ownerReferences"] = [owner_reference(cr)]  # same namespace: garbage collection removes it with the CR
    return out


def service_account(cr: InferenceRouter) -> Manifest:
    """The router pods' identity: the RoleBindings grant it read access to the watched namespaces."""
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _metadata(cr, cr.metadata.name)}


def role(cr: InferenceRouter, namespace: str) -> Manifest:
    """Read access to pods and InferenceDeployments in one watched namespace: what discovery lists and watches."""
    return {"apiVersion": RBAC_API, "kind": "Role", "metadata": _grant_metadata(cr, namespace),
            "rules": copy.deepcopy(GRANTED_RULES)}


def role_binding(cr: InferenceRouter, namespace: str) -> Manifest:
    """role() bound to the router's ServiceAccount (in the router's namespace)."""
    meta = cr.metadata
    return {"apiVersion": RBAC_API, "kind": "RoleBinding", "metadata": _grant_metadata(cr, namespace),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                        "name": grant_name(meta.namespace, meta.name)},
            "subjects": [{"kind": "ServiceAccount", "name": meta.name, "namespace": meta.namespace}]}


def router_args(spec: InferenceRouterSpec, namespaces: tuple[str, ...]) -> list[str]:
    """`kvfleet-router` arguments; every setting explicit, so a change of the router's defaults never leaks in."""
    watch = [arg for ns in namespaces for arg in ("--watch-namespace", ns)]
    args = ["--kubernetes", "--host", "0.0.0.0", "--port", str(ROUTER_PORT), *watch,
            "--epsilon", str(float(spec.epsilon)), "--scrape-interval", str(float(spec.scrape_interval_seconds)),
            "--hold-queue-size", str(spec.hold_queue.size),
            "--hold-timeout", str(float(spec.hold_queue.timeout_seconds))]
    if spec.tiered_models:
        args += ["--tiers", tiers_json(spec)]
    return args


def tiers_json(spec: InferenceRouterSpec) -> str:
    """spec.tieredModels as `kvfleet-router --tiers` reads it: compact JSON, camelCase, every default written out
    (the router then runs what the CR shows, whatever its own defaults are)."""
    tiers = [t.model_dump(mode="json", by_alias=True, exclude_none=True) for t in spec.tiered_models]
    return json.dumps(tiers, separators=(",", ":"))


def _resources(spec: InferenceRouterSpec) -> dict[str, Any]:
    out: dict[str, dict[str, str]] = {}
    for kind, lst in (("requests", spec.resources.requests), ("limits", spec.resources.limits)):
        if lst is not None:
            out[kind] = {k: str(v) for k, v in (("cpu", lst.cpu), ("memory", lst.memory)) if v is not None}
    return {k: v for k, v in out.items() if v}


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period, "failureThreshold": failures,
            "timeoutSeconds": 2}


def _field(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def pod_template(cr: InferenceRouter, default_image: str) -> dict[str, Any]:
    """The router pod: the CR's ServiceAccount (its token mounted: discovery calls the API), one container."""
    spec, name = cr.spec, cr.metadata.name
    container: dict[str, Any] = {
        "name": "router", "image": spec.image or default_image, "command": [ROUTER_APP],
        "args": router_args(spec, cr.watched),
        "env": [_field("POD_NAMESPACE", "metadata.namespace"), _field("POD_NAME", "metadata.name")],
        "ports": [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}],
        # /ready answers once discovery has listed the watched namespaces; /health while the process serves.
        "readinessProbe": _probe("/ready", 5, 2),
        "livenessProbe": _probe("/health", 10, 3),
        # Endpoints take a moment to drop a terminating pod; keep accepting requests until they have.
        "lifecycle": {"preStop": {"sleep": {"seconds": 5}}},
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}},
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    if resources := _resources(spec):
        container["resources"] = resources
    pod: dict[str, Any] = {
        "serviceAccountName": name,
        "automountServiceAccountToken": True,
        "enableServiceLinks": False,  # nothing reads them, and they would grow with every Service in the namespace
        "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": [{"name": "tmp", "emptyDir": {}}],
    }
    if spec.pod.node_selector:
        pod["nodeSelector"] = dict(spec.pod.node_selector)
    if spec.pod.tolerations:
        pod["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in spec.pod.tolerations]
    # The client label: the agents' NetworkPolicy admits pods carrying it from their own namespace.
    labels = {**spec.pod.labels, **common_labels(name), CLIENT_LABEL: CLIENT_LABEL_VALUE}
    metadata: dict[str, Any] = {"labels": labels}
    if spec.pod.annotations:
        metadata["annotations"] = dict(spec.pod.annotations)
    return {"metadata": metadata, "spec": pod}


def deployment(cr: InferenceRouter, default_image: str) -> Manifest:
    """The router's Deployment: rolls one surge pod at a time and never below the ready replicas it has."""
    name = cr.metadata.name
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": _metadata(cr, name),
        "spec": {"replicas": cr.spec.replicas, "selector": {"matchLabels": selector_labels(name)},
                 "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
                 "revisionHistoryLimit": 3, "template": pod_template(cr, default_image)},
    }


def service(cr: InferenceRouter) -> Manifest:
    """The one OpenAI endpoint: ClusterIP, http on the router's port."""
    name = cr.metadata.name
    return {"apiVersion": "v1", "kind": "Service", "metadata": _metadata(cr, name),
            "spec": {"type": "ClusterIP", "selector": selector_labels(name),
                     "ports": [{"name": "http", "port": ROUTER_PORT, "targetPort": "http", "protocol": "TCP"}]}}


def pod_disruption_budget(cr: InferenceRouter) -> Manifest:
    """At most one router down for voluntary disruptions. maxUnavailable, not minAvailable: with one replica
    minAvailable 1 would block every node drain, and from two replicas on this keeps at least one serving."""
    name = cr.metadata.name
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _metadata(cr, name),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(name)},
                     "unhealthyPodEvictionPolicy": "AlwaysAllow"}}


def desired(cr: InferenceRouter, default_image: str) -> list[Manifest]:
    """Everything a router needs, in apply order: its identity and grants before the pods that use them."""
    grants: list[Manifest] = []
    for ns in cr.watched:
        grants += [role(cr, ns), role_binding(cr, ns)]
    return [service_account(cr), *grants, deployment(cr, default_image), service(cr), pod_disruption_budget(cr)]
