"""Kubernetes discovery: InferenceDeployments and their agent pods → each model's ready endpoints, kept in a Fleet.

The served model name is an InferenceDeployment's spec.model.name. An InferenceDeployment with no ready pod still
makes its model known: requests for it are held (the scale-from-zero path), not refused. When several
InferenceDeployments serve one name (a canary, a second hardware pool, a namespace each), their ready pods are
merged into one pool of replicas, and all of them are recorded as serving it: the held-requests gauge carries the
model's full held count under each, so whichever can scale up from zero does, and its first ready pod releases them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any

from kvfleet_router.fleet import Fleet
from kvfleet_router.kube import KubeClient, list_watch

log = logging.getLogger(__name__)
# The operator's labels on agent pods and the agents' HTTP port: kvfleet_operator/builders.py (OWNER_LABEL,
# MANAGED_BY_LABEL, MANAGER, HTTP_PORT). Re-declared: the router imports nothing of the operator.
OWNER_LABEL = "serving.kvfleet.dev/inference-deployment"
MANAGED_BY_LABEL, MANAGER = "app.kubernetes.io/managed-by", "kvfleet-operator"
HTTP_PORT = 8000
POD_SELECTOR = f"{MANAGED_BY_LABEL}={MANAGER},{OWNER_LABEL}"  # the apiserver filters; served() checks again
IDP_API = "/apis/serving.kvfleet.dev/v1alpha1"

Key = tuple[str, str]  # (namespace, name)


@dataclass(frozen=True)
class Served:
    """One model's ready endpoints (replica name `namespace/pod` → http://podIP:port) and who serves it."""

    endpoints: dict[str, str]
    deployments: tuple[Key, ...]  # sorted


def pod_ready(pod: dict[str, Any]) -> bool:
    """Whether a pod may take traffic: an IP, phase Running, condition Ready=True, and not being deleted."""
    status = pod.get("status") or {}
    conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or [] if isinstance(c, dict)}
    return (bool(status.get("podIP")) and status.get("phase") == "Running" and conditions.get("Ready") == "True"
            and not (pod.get("metadata") or {}).get("deletionTimestamp"))


def pod_url(pod: dict[str, Any]) -> str:
    """The agent's base URL: the pod IP at the container port named http (the operator's), else HTTP_PORT."""
    ip = str((pod.get("status") or {}).get("podIP"))
    ports = [p for c in (pod.get("spec") or {}).get("containers") or [] for p in c.get("ports") or []]
    port = next((p.get("containerPort") for p in ports if p.get("name") == "http"), HTTP_PORT)
    return f"http://[{ip}]:{port}" if ":" in ip else f"http://{ip}:{port}"


def _key(obj: dict[str, Any]) -> Key:
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")


def served(deployments: Iterable[dict[str, Any]], pods: Iterable[dict[str, Any]],
           namespaces: Collection[str] | None = None) -> dict[str, Served]:
    """Pure: per served model name, the ready endpoints of the pods of the InferenceDeployments serving it (only
    in `namespaces` when given). A pod counts for the InferenceDeployment its owner label names now, in its own
    namespace, and only with the operator's managed-by label."""
    model_of: dict[Key, str] = {}
    for idp in deployments:
        key = _key(idp)
        name = ((idp.get("spec") or {}).get("model") or {}).get("name")
        if isinstance(name, str) and name and (namespaces is None or key[0] in namespaces):
            model_of[key] = name
    out: dict[str, Served] = {}
    for key in sorted(model_of):
        model = model_of[key]
        known = out.get(model, Served({}, ()))
        out[model] = Served(known.endpoints, (*known.deployments, key))
    for pod in pods:
        namespace, name = _key(pod)
        labels = (pod.get("metadata") or {}).get("labels") or {}
        owner = model_of.get((namespace, str(labels.get(OWNER_LABEL) or "")))
        if owner is not None and labels.get(MANAGED_BY_LABEL) == MANAGER and pod_ready(pod):
            out[owner].endpoints[f"{namespace}/{name}"] = pod_url(pod)
    return out


class Cache:
    """One kind's objects in one namespace, by name, as a list-watch keeps them; tells `changed` after each change."""

    def __init__(self, changed: Callable[[], None]) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.listed = False
        self.changed = changed

    def replace(self, items: list[dict[str, Any]]) -> None:
        """A (re-)list: the whole collection."""
        self.objects = {_key(o)[1]: o for o in items}
        self.listed = True
        self.changed()

    def apply(self, kind: str, obj: dict[str, Any]) -> None:
        """A watch event: ADDED, MODIFIED or DELETED (for a label-selected watch, also leaving the selection)."""
        if kind == "DELETED":
            self.objects.pop(_key(obj)[1], None)
        else:
            self.objects[_key(obj)[1]] = obj
        self.changed()


class Discovery:
    """Watches pods and InferenceDeployments in each namespace and keeps a Fleet equal to `served()` of them, at
    every event (a pod that turns unready or is deleted leaves at once). The Fleet is synced once every watch has
    listed once."""

    def __init__(self, fleet: Fleet, client: KubeClient, namespaces: Collection[str]) -> None:
        self.fleet, self.client, self.namespaces = fleet, client, sorted(set(namespaces))
        self.pods = {ns: Cache(self.refresh) for ns in self.namespaces}
        self.deployments = {ns: Cache(self.refresh) for ns in self.namespaces}
        self.shown: dict[str, tuple[int, tuple[Key, ...]]] = {}  # what was last logged of each model

    def refresh(self) -> None:
        """Recompute the models from the caches and apply them to the fleet."""
        now = served((o for c in self.deployments.values() for o in c.objects.values()),
                     (o for c in self.pods.values() for o in c.objects.values()), self.namespaces)
        for model in [m for m in self.fleet.models if m not in now]:
            log.info("model %s: no InferenceDeployment serves it any more", model)
            self.fleet.remove(model)
            self.shown.pop(model, None)
        for model, s in now.items():
            self.fleet.set_endpoints(model, s.endpoints, ready=True, deployments=s.deployments)
            if self.shown.get(model) != (len(s.endpoints), s.deployments):
                self.shown[model] = (len(s.endpoints), s.deployments)
                log.info("model %s: %d ready pod(s) of %s%s", model, len(s.endpoints),
                         ", ".join(f"{ns}/{name}" for ns, name in s.deployments),
                         " (replicas merged)" if len(s.deployments) > 1 else "")
        self.fleet.synced = all(c.listed for c in (*self.pods.values(), *self.deployments.values()))

    async def run(self) -> None:
        """Two list-watches per namespace, until cancelled (each retries on its own; none ends by itself)."""
        self.fleet.synced = False
        watches = [w for ns in self.namespaces for w in (
            list_watch(self.client, f"{IDP_API}/namespaces/{ns}/inferencedeployments", "", self.deployments[ns],
                       f"inferencedeployments in {ns}"),
            list_watch(self.client, f"/api/v1/namespaces/{ns}/pods", POD_SELECTOR, self.pods[ns], f"pods in {ns}"))]
        async with asyncio.TaskGroup() as group:  # a watch that fails unexpectedly stops the others: no half-view
            for watch in watches:
                group.create_task(watch)
