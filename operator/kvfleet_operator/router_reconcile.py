"""An InferenceRouter's reconcile (read once → router_plan → apply → one status write), and the cleanup of the
grants a deleted router left in other namespaces."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Callable
from typing import Any, cast

import aiohttp
import kopf

from kvfleet_operator import metrics
from kvfleet_operator import router_builders as rb
from kvfleet_operator.autoscaling.router_demand import RouterDemand, router_targets, scrape_routers
from kvfleet_operator.builders import MANAGED_BY_LABEL, MANAGER, OWNER_LABEL
from kvfleet_operator.kube import ApiError, KubeClient
from kvfleet_operator.models import API_VERSION, KIND
from kvfleet_operator.plan import ReconcileError
from kvfleet_operator.reconcile import Context
from kvfleet_operator.router_models import ROUTER_KIND
from kvfleet_operator.router_plan import (
    GRANT_KINDS,
    ChildKey,
    Fleet,
    Manifest,
    RouterDelete,
    RouterPlan,
    RouterRead,
    child_keys,
    make_plan,
    orphans,
    parse,
)
from kvfleet_operator.router_tiers import TierEvent
from kvfleet_operator.status import now_rfc3339

AGENT_PODS = f"{MANAGED_BY_LABEL}={MANAGER},{OWNER_LABEL}"  # every InferenceDeployment's agent pods
RESYNC_TRIGGER = "resync"
EventFn = Callable[..., None]  # kopf.event's signature; tests pass a recorder
log = logging.getLogger(__name__)
# kopf.event needs kopf's event queue, which only the context of a handler holds; the resync task (which reconciles
# routers, and so finds most promotions) was started from the startup handler, without it. The context of the last
# handler-run router reconcile is kept to post from there: kopf has one event queue per operator.
_HANDLER_CONTEXT: contextvars.Context | None = None


def _lock(ctx: Context, namespace: str, name: str) -> asyncio.Lock:
    # Apart from the InferenceDeployment of the same name: "/" never occurs in a name.
    return ctx.locks.setdefault((namespace, f"{ROUTER_KIND}/{name}"), asyncio.Lock())


async def _list(ctx: Context, kind: str, selector: str) -> list[Manifest]:
    """Objects of a kind by label in every namespace the operator serves (one list when it serves them all); a
    list's items carry no kind, so it is set here."""
    found: list[Manifest] = []
    for ns in ctx.cfg.namespaces or ("",):
        found += [{**obj, "kind": kind} for obj in await ctx.kube.list(kind, ns, selector)]
    return found


async def _grants(ctx: Context, selector: str) -> list[Manifest]:
    return [g for kind in GRANT_KINDS for g in await _list(ctx, kind, selector)]


async def _fleet(kube: KubeClient, namespace: str) -> Fleet:
    """What the router will see in one namespace; a refused read is reported, not raised (the others count)."""
    try:
        return Fleet(await kube.list(KIND, namespace, ""), await kube.list("Pod", namespace, AGENT_PODS))
    except ApiError as e:
        return Fleet(error=str(e))


async def _held(ctx: Context, namespace: str, name: str) -> RouterDemand | None:
    """What this router's ready pods report: the requests they hold, by (namespace, InferenceDeployment), and their
    /metrics texts (the tier metrics); None when none answered (then the status says nothing rather than a zero
    nobody measured)."""
    selector = ",".join(f"{k}={v}" for k, v in rb.selector_labels(name).items())
    try:
        pods = await ctx.kube.list("Pod", namespace, selector)
    except ApiError:
        return None
    demand = await scrape_routers(router_targets(pods), timeout=ctx.cfg.scrape_timeout_seconds)
    return demand if demand.reporting else None


async def reconcile_router(namespace: str, name: str, ctx: Context, *, uid: str | None = None,
                           post_event: EventFn | None = None) -> bool:
    """Reconcile one InferenceRouter from its current state in the apiserver. False when the object is gone, being
    deleted or replaced (another uid than `uid`). Raises ReconcileError (after writing the status), ApiError on a
    failed read, aiohttp/timeout errors. Promotion events go to `post_event` (default: kopf.event)."""
    async with _lock(ctx, namespace, name):
        body = await ctx.kube.get(ROUTER_KIND, namespace, name)
        meta = (body or {}).get("metadata") or {}
        if body is None or meta.get("deletionTimestamp") or (uid is not None and meta.get("uid") != uid):
            return False
        cr = parse(body)
        read = RouterRead({})
        if cr is not None:
            children: dict[ChildKey, Manifest | None] = {
                key: await ctx.kube.get(*key) for key in child_keys(cr)}
            demand = await _held(ctx, namespace, name)
            read = RouterRead(children, await _grants(ctx, rb.grant_selector(namespace, name)),
                              {ns: await _fleet(ctx.kube, ns) for ns in cr.watched},
                              None if demand is None else dict(demand.held),
                              None if demand is None else dict(demand.texts))
        await _execute(ctx.kube, make_plan(body, read, ctx.cfg), body, post_event)
        ctx.reconciled[meta.get("uid") or ""] = asyncio.get_running_loop().time()
        return True


async def reconcile_router_counted(namespace: str, name: str, ctx: Context, trigger: str, *,
                                   uid: str | None = None) -> bool:
    """reconcile_router, counted in the operator's metrics (trigger router-<trigger>)."""
    global _HANDLER_CONTEXT
    if trigger != RESYNC_TRIGGER:  # from a kopf handler (state.py's resync passes RESYNC_TRIGGER)
        _HANDLER_CONTEXT = contextvars.copy_context()
    start, label = time.perf_counter(), f"router-{trigger}"
    try:
        found = await reconcile_router(namespace, name, ctx, uid=uid)
    except ReconcileError as e:
        metrics.RECONCILES.labels(trigger=label, result="invalid" if e.permanent else "error").inc()
        raise
    except (ApiError, aiohttp.ClientError, TimeoutError):
        metrics.RECONCILES.labels(trigger=label, result="error").inc()
        raise
    metrics.RECONCILES.labels(trigger=label, result="ok" if found else "gone").inc()
    metrics.RECONCILE_SECONDS.observe(time.perf_counter() - start)
    return found


async def _execute(kube: KubeClient, plan: RouterPlan, body: Manifest, post_event: EventFn | None = None) -> None:
    """Apply the plan, write its status (once, if it changed) and post the promotion events that write makes
    true, then raise the errors it met, if any."""
    if plan.invalid is not None:
        await _write_status(kube, plan, plan.status(deployment=None, errors=(), now=now_rfc3339()))
        raise plan.invalid
    deployment, errors = plan.deployment, []
    applied: set[ChildKey] = set()
    for w in plan.writes:
        if not all(key in applied for key in w.needs):
            continue  # what it needs was refused or failed: that error is already reported
        if w.refusal is not None:
            metrics.APPLY_ERRORS.labels(kind=w.key[0]).inc()
            errors.append(w.refusal)
            continue
        try:
            result = await kube.apply(w.manifest)
        except ApiError as e:
            metrics.APPLY_ERRORS.labels(kind=w.key[0]).inc()
            errors.append(ReconcileError("ApplyFailed", f"{w.key[0]} {w.key[1]}/{w.key[2]}: {e}",
                                         permanent=e.permanent))
            continue
        applied.add(w.key)
        if w.key[0] == "Deployment":
            deployment = result
    errors += await _delete(kube, plan.deletes)
    status = plan.status_to_write(deployment=deployment, errors=errors, now=now_rfc3339())
    if status is not None:
        await _write_status(kube, plan, status)
        _post(post_event, body, plan.events(status))
    errors = [*plan.read_errors, *errors]
    if errors:
        raise ReconcileError(errors[0].reason, "; ".join(e.message for e in errors),
                             permanent=all(e.permanent for e in errors))


def _post(post_event: EventFn | None, body: Manifest, events: list[TierEvent]) -> None:
    for e in events:
        if post_event is not None:
            _event(post_event, body, e)
            continue
        try:
            _event(kopf.event, body, e)
        except LookupError:  # no kopf event queue in this context: the resync's (see _HANDLER_CONTEXT)
            if _HANDLER_CONTEXT is None:
                log.warning(f"event {e.reason} not posted (no kopf handler has run yet): {e.message}")
            else:
                _HANDLER_CONTEXT.run(_event, kopf.event, body, e)


def _event(post: EventFn, body: Manifest, e: TierEvent) -> None:
    # kopf.event reads only apiVersion, kind and metadata, through Mapping.get: the body as read serves.
    post(cast(kopf.Body, body), type="Normal", reason=e.reason, message=e.message[:1024])


async def _delete(kube: KubeClient, deletes: tuple[RouterDelete, ...] | list[RouterDelete]) -> list[ReconcileError]:
    """Delete grants that are ours, each only as that very object (a namesake created since survives with a 409)."""
    errors = []
    for d in deletes:
        try:
            await kube.delete(d.kind, d.namespace, d.name, uid=d.uid)
        except ApiError as e:
            metrics.APPLY_ERRORS.labels(kind=d.kind).inc()
            errors.append(ReconcileError("ApplyFailed", f"{d.kind} {d.namespace}/{d.name}: {e}",
                                         permanent=e.permanent))
    return errors


async def _write_status(kube: KubeClient, plan: RouterPlan, status: dict[str, Any]) -> None:
    await kube.apply({"apiVersion": API_VERSION, "kind": ROUTER_KIND,
                      "metadata": {"name": plan.name, "namespace": plan.namespace}, "status": status},
                     subresource="status")


async def release(ctx: Context, namespace: str, name: str) -> None:
    """A router was deleted: delete its grants outside its namespace (no owner reference can take them away)."""
    await sweep(ctx, rb.grant_selector(namespace, name))


async def sweep(ctx: Context, selector: str = rb.GRANTS_SELECTOR) -> None:
    """Delete the grants (matching `selector`) whose router no longer exists: those a router deleted while the
    operator was down left behind. Raises the first failed delete after trying them all."""
    grants = await _grants(ctx, selector)
    exists: dict[tuple[str, str], bool] = {}
    for g in grants:
        labels = g["metadata"].get("labels") or {}
        key = (labels.get(rb.ROUTER_NAMESPACE_LABEL, ""), labels.get(rb.ROUTER_LABEL, ""))
        if key not in exists and all(key):
            router = await ctx.kube.get(ROUTER_KIND, *key)
            exists[key] = router is not None and not router["metadata"].get("deletionTimestamp")
    if errors := await _delete(ctx.kube, orphans(grants, exists)):
        raise errors[0]
