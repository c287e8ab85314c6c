"""The one idempotent reconcile: read the CR and its children once, plan (plan.py), apply, write the status once."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

import aiohttp

from kvfleet_operator import metrics
from kvfleet_operator.config import OperatorConfig
from kvfleet_operator.kube import AUTOSCALER_MANAGER, FIELD_MANAGER, ApiError, KubeClient
from kvfleet_operator.models import API_VERSION, KIND
from kvfleet_operator.plan import ChildKey, Manifest, Plan, ReconcileError, child_keys, make_plan
from kvfleet_operator.status import now_rfc3339


class Context(Protocol):
    """The parts of the operator's state (state.OperatorState) a reconcile uses."""

    cfg: OperatorConfig
    kube: KubeClient
    locks: dict[tuple[str, str], asyncio.Lock]  # one per InferenceDeployment (namespace, name)
    reconciled: dict[str, float]  # uid → event-loop time of its last successful reconcile


def _lock(ctx: Context, namespace: str, name: str) -> asyncio.Lock:
    # The CR's handlers, the Deployment watch, the resync and the autoscaler all reconcile; one at a time per
    # object keeps the writes ordered.
    return ctx.locks.setdefault((namespace, name), asyncio.Lock())


async def reconcile_object(namespace: str, name: str, ctx: Context, *, uid: str | None = None,
                           replicas: int | None = None) -> int | None:
    """Reconcile one InferenceDeployment from its current state in the apiserver (level-triggered: whatever
    event woke us, the latest object is what counts). Returns the replicas applied, or None when the object is
    gone, being deleted or replaced (another uid than `uid`): then garbage collection, not us, owns its children.
    Raises ReconcileError (after writing the status), ApiError on a failed read, aiohttp/timeout errors."""
    async with _lock(ctx, namespace, name):
        body = await ctx.kube.get(KIND, namespace, name)
        meta = (body or {}).get("metadata") or {}
        if body is None or meta.get("deletionTimestamp") or (uid is not None and meta.get("uid") != uid):
            return None
        children = {key: await ctx.kube.get(key[0], namespace, key[1]) for key in child_keys(name)}
        desired = await _execute(ctx, make_plan(body, children, ctx.cfg, replicas))
        ctx.reconciled[meta.get("uid") or ""] = asyncio.get_running_loop().time()
        return desired


async def apply_desired(namespace: str, name: str, ctx: Context, replicas: int, *,
                        uid: str | None = None) -> int | None:
    """Apply the full plan with the autoscaler's replica count (the only way builtin mode changes replicas)."""
    return await reconcile_object(namespace, name, ctx, uid=uid, replicas=replicas)


async def reconcile_counted(namespace: str, name: str, ctx: Context, trigger: str, *,
                            uid: str | None = None) -> int | None:
    """reconcile_object, counted in the operator's metrics by what triggered it and how it ended."""
    start = time.perf_counter()
    try:
        replicas = await reconcile_object(namespace, name, ctx, uid=uid)
    except ReconcileError as e:
        metrics.RECONCILES.labels(trigger=trigger, result="invalid" if e.permanent else "error").inc()
        raise
    except (ApiError, aiohttp.ClientError, TimeoutError):  # asyncio.TimeoutError is TimeoutError
        metrics.RECONCILES.labels(trigger=trigger, result="error").inc()
        raise
    metrics.RECONCILES.labels(trigger=trigger, result="ok" if replicas is not None else "gone").inc()
    metrics.RECONCILE_SECONDS.observe(time.perf_counter() - start)
    return replicas


async def _execute(ctx: Context, plan: Plan) -> int:
    """Apply the plan, write its status (once, if it changed), then raise the errors it met, if any."""
    kube, ns, name = ctx.kube, plan.namespace, plan.name
    if plan.invalid is not None:
        await _write_status(kube, ns, name, plan.status(deployment=None, errors=(), now=now_rfc3339()))
        raise plan.invalid
    deployment, errors = await _apply(kube, plan)
    status = plan.status_to_write(deployment=deployment, errors=errors, now=now_rfc3339())
    if status is not None:
        await _write_status(kube, ns, name, status)
    if plan.clears_autoscaler_status:
        # An empty apply by the autoscaler's field manager removes exactly the fields it owned.
        await _write_status(kube, ns, name, {}, manager=AUTOSCALER_MANAGER)
    if not plan.builtin:
        metrics.set_desired(ns, name, "spec", plan.desired)  # in builtin mode the autoscaler reports its reason
    if errors:
        # Retry while any error may heal; a foreign object or an invalid object is permanent until changed.
        raise ReconcileError(errors[0].reason, "; ".join(e.message for e in errors),
                             permanent=all(e.permanent for e in errors))
    return plan.desired


async def _apply(kube: KubeClient, plan: Plan) -> tuple[Manifest | None, list[ReconcileError]]:
    """The writes and deletes the plan allows; returns the Deployment as applied (else as read) and the errors
    met, in apply order. One failure does not stop the rest: a bad Service must not keep a fixed Deployment
    from rolling."""
    deployment, errors = plan.deployment, []
    applied: set[ChildKey] = set()
    for w in plan.writes:
        kind = w.key[0]
        if not all(key in applied for key in w.needs):
            continue
        if w.refusal is not None:
            metrics.APPLY_ERRORS.labels(kind=kind).inc()
            errors.append(w.refusal)
            continue
        try:
            result = await kube.apply(w.manifest)
        except ApiError as e:
            metrics.APPLY_ERRORS.labels(kind=kind).inc()
            errors.append(ReconcileError("ApplyFailed", f"{kind} {plan.name}: {e}", permanent=e.permanent))
            continue
        applied.add(w.key)
        if kind == "Deployment":
            deployment = result
    for d in plan.deletes:
        if not d.ours:
            continue  # absent, or someone else's namesake: never ours to delete
        try:  # the uid precondition: a namesake created since our read survives
            await kube.delete(d.kind, plan.namespace, d.name, uid=d.uid)
        except ApiError as e:
            metrics.APPLY_ERRORS.labels(kind=d.kind).inc()
            errors.append(ReconcileError("ApplyFailed", f"{d.kind} {d.name}: {e}", permanent=e.permanent))
    return deployment, errors


async def _write_status(kube: KubeClient, namespace: str, name: str, status: dict[str, Any], *,
                        manager: str = FIELD_MANAGER) -> None:
    # Server-side apply on the status subresource: our fields and our four conditions only, so the
    # autoscaler's (another field manager) survive this write and vice versa.
    await kube.apply({"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name, "namespace": namespace},
                      "status": status}, subresource="status", manager=manager)
