"""The one idempotent reconcile: plan, check ownership, apply, then write the status once (only if it changed)."""

from __future__ import annotations

import asyncio
from typing import Any

import kopf
from pydantic import ValidationError

from kvfleet_operator import metrics
from kvfleet_operator.builders import plan, replicas_for, selector_string
from kvfleet_operator.config import OperatorConfig
from kvfleet_operator.kube import AUTOSCALER_MANAGER, FIELD_MANAGER, ApiError, Kube
from kvfleet_operator.models import API_VERSION, KIND, InferenceDeployment
from kvfleet_operator.ownership import classify
from kvfleet_operator.status import (
    AUTOSCALER_CONDITIONS,
    RECONCILE_CONDITIONS,
    RECONCILE_FIELDS,
    invalid_spec,
    now_rfc3339,
    observe,
)


class ReconcileError(Exception):
    """Why a reconcile could not reach the desired state: a condition reason, and whether retrying can help."""

    def __init__(self, reason: str, message: str, *, permanent: bool) -> None:
        super().__init__(message)
        self.reason, self.message, self.permanent = reason, message, permanent


def _lock(memo: kopf.Memo, namespace: str, name: str) -> asyncio.Lock:
    # The CR's handlers, the Deployment watch, the resync and the autoscaler all reconcile; one at a time per
    # object keeps the writes ordered.
    locks: dict[tuple[str, str], asyncio.Lock] = memo["locks"]
    return locks.setdefault((namespace, name), asyncio.Lock())


async def reconcile_object(namespace: str, name: str, memo: kopf.Memo, *, uid: str | None = None,
                           replicas: int | None = None) -> int | None:
    """Reconcile one InferenceDeployment from its current state in the apiserver (level-triggered: whatever
    event woke us, the latest object is what counts). Returns the replicas applied, or None when the object is
    gone, being deleted or replaced (another uid than `uid`): then garbage collection, not us, owns its children.
    Raises ReconcileError (after writing the status), ApiError on a failed read, aiohttp/timeout errors."""
    async with _lock(memo, namespace, name):
        body = await memo["kube"].get(KIND, namespace, name)
        meta = (body or {}).get("metadata") or {}
        if body is None or meta.get("deletionTimestamp") or (uid is not None and meta.get("uid") != uid):
            return None
        desired = await _reconcile(body, memo, replicas)
        memo.setdefault("reconciled", {})[meta.get("uid")] = asyncio.get_running_loop().time()
        return desired


async def apply_desired(namespace: str, name: str, memo: kopf.Memo, replicas: int, *,
                        uid: str | None = None) -> int | None:
    """Apply the full plan with the autoscaler's replica count (the only way builtin mode changes replicas)."""
    return await reconcile_object(namespace, name, memo, uid=uid, replicas=replicas)


async def _reconcile(body: dict[str, Any], memo: kopf.Memo, replicas: int | None) -> int:
    cfg: OperatorConfig = memo["cfg"]
    kube: Kube = memo["kube"]
    meta = body["metadata"]
    ns, name, generation = meta["namespace"], meta["name"], int(meta.get("generation") or 0)
    current = body.get("status") or {}
    try:
        # The spec only: the status is ours to write, and a field a newer operator added there must not make
        # this one refuse to reconcile.
        cr = InferenceDeployment.model_validate({k: v for k, v in body.items() if k != "status"})
    except ValidationError as e:
        # The CRD's schema and CEL rules should have refused this; it happens only if the CRD is out of date.
        msg = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        message = f"invalid spec (is the CRD up to date?): {msg}"
        await _write_status(kube, ns, name, invalid_spec(current, generation=generation, message=message,
                                                          now=now_rfc3339()))
        raise ReconcileError("InvalidSpec", message, permanent=True) from e
    live = await kube.get("Deployment", ns, name)
    ours = live if classify(live, "Deployment", ns, name, cr.metadata.uid).verdict == "ours" else None
    live_replicas = ours["spec"].get("replicas") if ours is not None else None
    desired = replicas if replicas is not None else replicas_for(cr.spec, live_replicas)
    p = plan(cr, cfg.agent_image, desired)
    applied = ours  # the status reports our Deployment as it is when this reconcile cannot apply it
    errors: list[ReconcileError] = []
    for obj in p.apply:
        kind = obj["kind"]
        if kind == "Deployment" and errors:
            continue  # the args ConfigMap (applied first) failed: its pods would read someone else's or none
        existing = live if kind == "Deployment" else await kube.get(kind, ns, obj["metadata"]["name"])
        owner = classify(existing, kind, ns, name, cr.metadata.uid)
        if not owner.writable:
            metrics.APPLY_ERRORS.labels(kind=kind).inc()
            foreign = owner.verdict == "foreign"
            errors.append(ReconcileError("ResourceExists" if foreign else "WaitingForGarbageCollection",
                                         owner.message, permanent=foreign))
            continue
        try:
            result = await kube.apply(obj)
        except ApiError as e:
            metrics.APPLY_ERRORS.labels(kind=kind).inc()
            errors.append(ReconcileError("ApplyFailed", f"{kind} {name}: {e}", permanent=e.permanent))
            continue  # still apply the rest: a bad Service must not keep a fixed Deployment from rolling
        if kind == "Deployment":
            applied = result
    for _api_version, kind, obj_name in p.delete:
        existing = await kube.get(kind, ns, obj_name)
        if classify(existing, kind, ns, name, cr.metadata.uid).verdict != "ours":
            continue  # absent, or someone else's namesake: never ours to delete
        try:  # the uid precondition: a namesake created since our read survives
            await kube.delete(kind, ns, obj_name, uid=(existing or {}).get("metadata", {}).get("uid"))
        except ApiError as e:
            metrics.APPLY_ERRORS.labels(kind=kind).inc()
            errors.append(ReconcileError("ApplyFailed", f"{kind} {obj_name}: {e}", permanent=e.permanent))
    first = errors[0] if errors else None
    status = observe(generation=generation, desired=desired, selector=selector_string(name),
                     deployment=applied,
                     error=None if first is None else first.message, previous=_ours(current), now=now_rfc3339(),
                     error_reason="ApplyFailed" if first is None else first.reason)
    if _changed(current, status):
        await _write_status(kube, ns, name, status)
    if cr.spec.autoscaling.mode != "builtin" and (current.get("autoscaling") or any(
            c.get("type") in AUTOSCALER_CONDITIONS for c in current.get("conditions") or [])):
        # Builtin autoscaling was switched off: its decision and conditions would go stale. An empty apply by its
        # field manager removes exactly the fields it owned.
        await _write_status(kube, ns, name, {}, manager=AUTOSCALER_MANAGER)
    if cr.spec.autoscaling.mode != "builtin":
        metrics.set_desired(ns, name, "spec", desired)  # in builtin mode the autoscaler reports its reason
    if first is not None:
        # Retry while any error may heal; a foreign object or an invalid object is permanent until changed.
        raise ReconcileError(first.reason, "; ".join(e.message for e in errors),
                             permanent=all(e.permanent for e in errors))
    return desired


def _ours(status: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in status.get("conditions") or [] if c.get("type") in RECONCILE_CONDITIONS]


def _changed(current: dict[str, Any], new: dict[str, Any]) -> bool:
    return any(current.get(k) != new.get(k) for k in RECONCILE_FIELDS) or _ours(current) != new["conditions"]


async def _write_status(kube: Kube, namespace: str, name: str, status: dict[str, Any], *,
                        manager: str = FIELD_MANAGER) -> None:
    # Server-side apply on the status subresource: our fields and our four conditions only, so the
    # autoscaler's (another field manager) survive this write and vice versa.
    await kube.apply({"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name, "namespace": namespace},
                      "status": status}, subresource="status", manager=manager)
