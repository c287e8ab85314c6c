"""kopf handlers: one idempotent reconcile (plan, apply, one status write) for every trigger; thin by design."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import kopf
from pydantic import ValidationError

from kvfleet_operator import metrics
from kvfleet_operator.builders import MANAGED_BY_LABEL, MANAGER, plan, replicas_for, selector_string
from kvfleet_operator.config import OperatorConfig
from kvfleet_operator.kube import ApiError, Kube, default_login
from kvfleet_operator.models import API_VERSION, GROUP, KIND, PLURAL, VERSION, InferenceDeployment
from kvfleet_operator.status import RECONCILE_CONDITIONS, now_rfc3339, observe

_RETRY_SECONDS = 10.0


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Shared state for every handler: the config, the API client and one lock per InferenceDeployment."""
    cfg = memo.get("cfg") or OperatorConfig.from_env()
    cfg.configure(settings)
    memo["cfg"] = cfg
    memo["kube"] = memo.get("kube") or Kube(lambda: default_login(settings))
    memo["locks"] = {}


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    kube: Kube | None = memo.get("kube")
    if kube is not None:
        await kube.close()


def _lock(memo: kopf.Memo, namespace: str, name: str) -> asyncio.Lock:
    # The CR's handlers and the Deployment watch both reconcile; one at a time per object keeps writes ordered.
    locks: dict[tuple[str, str], asyncio.Lock] = memo["locks"]
    return locks.setdefault((namespace, name), asyncio.Lock())


async def reconcile_object(namespace: str, name: str, memo: kopf.Memo, *, uid: str | None = None,
                           replicas: int | None = None) -> int | None:
    """Reconcile one InferenceDeployment from its current state in the apiserver (level-triggered: whatever
    event woke us, the latest object is what counts). Returns the replicas applied, or None when the object is
    gone, being deleted or replaced (other uid): then garbage collection, not us, owns its children."""
    async with _lock(memo, namespace, name):
        body = await memo["kube"].get(KIND, namespace, name)
        meta = (body or {}).get("metadata") or {}
        if body is None or meta.get("deletionTimestamp") or (uid is not None and meta.get("uid") != uid):
            return None
        return await _reconcile(body, memo, replicas)


async def _reconcile(body: dict[str, Any], memo: kopf.Memo, replicas: int | None) -> int:
    """Plan, apply, then write the status once (only if it changed); raises ApiError after writing it."""
    cfg: OperatorConfig = memo["cfg"]
    kube: Kube = memo["kube"]
    meta = body["metadata"]
    ns, name, generation = meta["namespace"], meta["name"], int(meta.get("generation") or 0)
    current = body.get("status") or {}
    previous = [c for c in current.get("conditions") or [] if c.get("type") in RECONCILE_CONDITIONS]
    try:
        cr = InferenceDeployment.model_validate(body)
    except ValidationError as e:
        # The CRD's schema and CEL rules should have refused this; it happens only if the CRD is out of date.
        msg = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        await _write_status(kube, ns, name, observe(generation=generation, desired=0, selector=selector_string(name),
                                                    deployment=None, error=f"invalid spec: {msg}",
                                                    previous=previous, now=now_rfc3339()))
        raise kopf.PermanentError(f"invalid spec (is the CRD up to date?): {msg}") from e
    live = await kube.get("Deployment", ns, name)
    live_replicas = live["spec"].get("replicas") if live else None
    desired = replicas if replicas is not None else replicas_for(cr.spec, live_replicas)
    p = plan(cr, cfg.agent_image, desired)
    applied: dict[str, Any] | None = live
    error: ApiError | None = None
    for obj in p.apply:
        try:
            result = await kube.apply(obj)
        except ApiError as e:
            metrics.APPLY_ERRORS.labels(kind=obj["kind"]).inc()
            error = error or ApiError(e.status, e.reason, f"{obj['kind']} {name}: {e.message}")
            continue  # still apply the rest: a bad Service must not keep a fixed Deployment from rolling
        if obj["kind"] == "Deployment":
            applied = result
    for _api_version, kind, obj_name in p.delete:
        try:
            await kube.delete(kind, ns, obj_name)
        except ApiError as e:
            metrics.APPLY_ERRORS.labels(kind=kind).inc()
            error = error or e
    status = observe(generation=generation, desired=desired, selector=selector_string(name), deployment=applied,
                     error=None if error is None else str(error), previous=previous, now=now_rfc3339())
    if _changed(current, status):
        await _write_status(kube, ns, name, status)
    metrics.DESIRED_REPLICAS.labels(namespace=ns, name=name).set(desired)
    if error is not None:
        raise error
    return desired


def _changed(current: dict[str, Any], new: dict[str, Any]) -> bool:
    ours = {k: current.get(k) for k in new if k != "conditions"}
    conds = [c for c in current.get("conditions") or [] if c.get("type") in RECONCILE_CONDITIONS]
    return ours != {k: v for k, v in new.items() if k != "conditions"} or conds != new["conditions"]


async def _write_status(kube: Kube, namespace: str, name: str, status: dict[str, Any]) -> None:
    # Server-side apply on the status subresource: our fields and our three conditions only, so the
    # autoscaler's conditions (another field manager) survive this write and vice versa.
    await kube.apply({"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name, "namespace": namespace},
                      "status": status}, subresource="status")


async def _reconcile_with_retry_policy(namespace: str, name: str, uid: str | None, memo: kopf.Memo,
                                      trigger: str) -> int | None:
    start = time.perf_counter()
    try:
        replicas = await reconcile_object(namespace, name, memo, uid=uid)
    except ApiError as e:
        metrics.RECONCILES.labels(trigger=trigger, result="error").inc()
        if e.permanent:
            raise kopf.PermanentError(f"the apiserver refused the desired state: {e}") from e
        raise kopf.TemporaryError(f"could not apply the desired state: {e}", delay=_RETRY_SECONDS) from e
    except kopf.PermanentError:
        metrics.RECONCILES.labels(trigger=trigger, result="invalid").inc()
        raise
    metrics.RECONCILES.labels(trigger=trigger, result="ok" if replicas is not None else "gone").inc()
    metrics.RECONCILE_SECONDS.observe(time.perf_counter() - start)
    return replicas


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
async def reconcile(body: kopf.Body, name: str, namespace: str | None, uid: str, reason: str, memo: kopf.Memo,
                    **_: Any) -> None:
    """Create, update and operator restart all run the same reconcile; kopf retries TemporaryError."""
    try:
        replicas = await _reconcile_with_retry_policy(namespace or "default", name, uid, memo, reason)
    except (kopf.PermanentError, kopf.TemporaryError) as e:
        permanent = isinstance(e, kopf.PermanentError)
        kopf.event(body, type="Warning", reason="ReconcileFailed" if permanent else "ReconcileRetrying",
                   message=str(e)[:1024])
        raise
    if replicas is not None and reason in (kopf.Reason.CREATE, kopf.Reason.UPDATE):
        verb = "created" if reason == kopf.Reason.CREATE else "updated"
        kopf.event(body, type="Normal", reason="Applied",
                   message=f"{verb}: Deployment (replicas {replicas}), Service, PodDisruptionBudget applied")


@kopf.on.event("apps", "v1", "deployments", labels={MANAGED_BY_LABEL: MANAGER})
async def deployment_changed(body: kopf.Body, type: str | None, memo: kopf.Memo, logger: kopf.Logger,
                             **_: Any) -> None:
    """An owned Deployment changed (pods became ready, a rollout moved, someone edited or deleted it):
    reconcile its InferenceDeployment, which refreshes the status and restores anything drifted (but leaves
    an owner that is being deleted to garbage collection)."""
    if type is None:
        return  # the initial listing; the CR's resume handler covers it
    owner = next((o for o in body.get("metadata", {}).get("ownerReferences") or []
                  if o.get("kind") == KIND and o.get("apiVersion", "").startswith(GROUP + "/") and o.get("controller")),
                 None)
    if owner is None:
        return
    ns = body["metadata"]["namespace"]
    try:
        await _reconcile_with_retry_policy(ns, owner["name"], owner.get("uid"), memo, "deployment")
    except (kopf.PermanentError, kopf.TemporaryError) as e:
        # No retry here: the next Deployment event, a CR change or the operator's restart reconciles again.
        logger.warning(f"reconcile of {ns}/{owner['name']} after a Deployment {type} failed: {e}")


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True)
async def deleted(namespace: str | None, name: str | None, **_: Any) -> None:
    """Forget the per-object metric; the owned objects go with the CR through garbage collection."""
    with contextlib.suppress(KeyError):  # never reconciled by this process
        metrics.DESIRED_REPLICAS.remove(namespace or "", name or "")


# AUTOSCALER HOOK (builtin mode). A kopf daemon or timer on InferenceDeployments with
# spec.autoscaling.mode == "builtin" scrapes the ready pods (scrape.py), calls autoscaler.decide(), then:
#   1. await apply_desired(namespace, name, memo, decision.desired_replicas)  # Deployment replicas, same manager
#   2. writes status.autoscaling and the Scaling*/CapacityBlocked/MetricsAvailable conditions with
#      kube.apply(..., subresource="status") under its own field manager (e.g. "kvfleet-autoscaler"), so this
#      module's status write (manager "kvfleet-operator") never removes them.
# The reconcile above keeps whatever replicas the Deployment has in builtin mode (clamped to min/max).
async def apply_desired(namespace: str, name: str, memo: kopf.Memo, replicas: int, *,
                        uid: str | None = None) -> int | None:
    """Apply the full plan with the autoscaler's replica count (the only way builtin mode changes replicas)."""
    return await reconcile_object(namespace, name, memo, uid=uid, replicas=replicas)
