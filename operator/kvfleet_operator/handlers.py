"""kopf handlers: every trigger runs the one reconcile (reconcile.py) and keeps the state's loops current; thin."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, TypeVar

import aiohttp
import kopf

from kvfleet_contract.metrics import ROUTER_APP
from kvfleet_operator import metrics, router_reconcile
from kvfleet_operator.builders import MANAGED_BY_LABEL, MANAGER, NAME_LABEL
from kvfleet_operator.kube import ApiError
from kvfleet_operator.models import GROUP, KIND, PLURAL, VERSION
from kvfleet_operator.plan import ReconcileError
from kvfleet_operator.reconcile import reconcile_counted
from kvfleet_operator.router_models import ROUTER_KIND, ROUTER_PLURAL
from kvfleet_operator.state import OperatorState

T = TypeVar("T")

# No handler here may make kopf put its finalizer on an InferenceDeployment or an InferenceRouter (a daemon, a timer
# or a deletion handler that is not optional): the object would stay undeletable while the operator is down or
# uninstalled, and a GitOps tool pruning an app together with its operator would hang. test_handlers.py checks it.

_RETRY_SECONDS, _MAX_RETRY_SECONDS = 5.0, 300.0
_GC_RETRY_SECONDS = 5.0  # an owner's namesake left by a deleted CR: garbage collection takes seconds


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """kopf's settings from our config, then the operator-wide loop (the state was built by __main__)."""
    state = OperatorState.of(memo)
    state.cfg.configure(settings)
    state.start()


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    await OperatorState.of(memo).close()


def _backoff(retry: int) -> float:
    return min(_RETRY_SECONDS * 2.0 ** min(retry, 10), _MAX_RETRY_SECONDS)


async def run_reconcile(namespace: str, name: str, state: OperatorState, trigger: str, *, uid: str | None = None,
                        retry: int = 0) -> int | None:
    """The reconcile with its failures turned into kopf's retry policy (see _kopf_errors)."""
    return await _kopf_errors(reconcile_counted(namespace, name, state, trigger, uid=uid), retry)


async def run_router_reconcile(namespace: str, name: str, state: OperatorState, trigger: str, *,
                               uid: str | None = None, retry: int = 0) -> bool:
    """An InferenceRouter's reconcile with its failures turned into kopf's retry policy (see _kopf_errors)."""
    return await _kopf_errors(router_reconcile.reconcile_router_counted(namespace, name, state, trigger, uid=uid),
                              retry)


async def _kopf_errors(call: Awaitable[T], retry: int) -> T:
    """Await a reconcile, its failures turned into PermanentError when only a changed object can help (an invalid
    spec, an object of the same name we do not control), else TemporaryError with back-off (API errors that heal,
    a network error or timeout towards the apiserver)."""
    try:
        return await call
    except ReconcileError as e:
        if e.permanent:
            raise kopf.PermanentError(e.message) from e
        delay = _GC_RETRY_SECONDS if e.reason == "WaitingForGarbageCollection" else _backoff(retry)
        raise kopf.TemporaryError(e.message, delay=delay) from e
    except ApiError as e:
        if e.permanent:
            raise kopf.PermanentError(f"the apiserver refused a request: {e}") from e
        raise kopf.TemporaryError(f"could not reach the desired state: {e}", delay=_backoff(retry)) from e
    except (aiohttp.ClientError, TimeoutError) as e:  # asyncio.TimeoutError is TimeoutError
        raise kopf.TemporaryError(f"the apiserver did not answer: {type(e).__name__}: {e}",
                                  delay=_backoff(retry)) from e


def _failure_reason(e: kopf.PermanentError | kopf.TemporaryError) -> str:
    cause = e.__cause__
    if isinstance(cause, ReconcileError) and cause.reason in ("ResourceExists", "InvalidSpec"):
        return cause.reason
    return "ReconcileFailed" if isinstance(e, kopf.PermanentError) else "ReconcileRetrying"


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
async def reconcile(body: kopf.Body, name: str, namespace: str | None, uid: str, reason: str, memo: kopf.Memo,
                    retry: int = 0, **_: Any) -> None:
    """Create, update and operator restart all run the same reconcile; kopf retries TemporaryError. The object
    is tracked first, so the loops follow it (and a switch of its autoscaling mode) even while this fails."""
    state, ns = OperatorState.of(memo), namespace or "default"
    mode = ((body.get("spec") or {}).get("autoscaling") or {}).get("mode")
    await state.track(ns, name, uid, builtin=mode == "builtin")
    try:
        replicas = await run_reconcile(ns, name, state, reason, uid=uid, retry=retry)
    except (kopf.PermanentError, kopf.TemporaryError) as e:
        kopf.event(body, type="Warning", reason=_failure_reason(e), message=str(e)[:1024])
        raise
    if replicas is not None and reason in (kopf.Reason.CREATE, kopf.Reason.UPDATE):
        verb = "created" if reason == kopf.Reason.CREATE else "updated"
        kopf.event(body, type="Normal", reason="Applied",
                   message=f"{verb}: Deployment (replicas {replicas}), Service, PodDisruptionBudget applied")


@kopf.on.event("apps", "v1", "deployments", labels={MANAGED_BY_LABEL: MANAGER})
async def deployment_changed(body: kopf.Body, type: str | None, memo: kopf.Memo, logger: kopf.Logger,
                             **_: Any) -> None:
    """An owned Deployment changed (pods became ready, a rollout moved, someone edited or deleted it): reconcile
    the InferenceDeployment of that name, which refreshes the status and restores anything drifted. By name, not
    by the owner's uid: after a CR is deleted and recreated under the same name, the old Deployment's events
    (its deletion by garbage collection above all) must wake the new CR, whose reconcile decides."""
    if type is None:
        return  # the initial listing; the CR's resume handler covers it
    owner = next((o for o in body.get("metadata", {}).get("ownerReferences") or []
                  if o.get("kind") == KIND and o.get("apiVersion", "").startswith(GROUP + "/") and o.get("controller")),
                 None)
    if owner is None:
        return
    ns, state = body["metadata"]["namespace"], OperatorState.of(memo)
    try:
        await run_reconcile(ns, owner["name"], state, "deployment")
    except (kopf.PermanentError, kopf.TemporaryError) as e:
        # Event handlers are not retried; the CR's own handlers and the resync loop are.
        logger.warning(f"reconcile of {ns}/{owner['name']} after a Deployment {type} failed: {e}")
    # The agents' readiness moved (or the fleet came or went): the routers serving this namespace report it.
    for (router_ns, router), uid in state.routers_serving(ns):
        try:
            await run_router_reconcile(router_ns, router, state, "fleet", uid=uid)
        except (kopf.PermanentError, kopf.TemporaryError) as e:
            logger.warning(f"reconcile of InferenceRouter {router_ns}/{router} after a Deployment {type} failed: {e}")


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True)
async def deleted(namespace: str | None, name: str | None, uid: str | None, memo: kopf.Memo, **_: Any) -> None:
    """Forget the per-object metric, loop and memory; the owned objects go with the CR through garbage
    collection. Optional: kopf calls it when it sees the deletion, and needs no finalizer for that."""
    metrics.forget(namespace or "", name or "")
    if uid is not None:
        await OperatorState.of(memo).forget(namespace or "default", name or "", uid)


@kopf.on.resume(GROUP, VERSION, ROUTER_PLURAL)
@kopf.on.create(GROUP, VERSION, ROUTER_PLURAL)
@kopf.on.update(GROUP, VERSION, ROUTER_PLURAL)
async def reconcile_router(body: kopf.Body, name: str, namespace: str | None, uid: str, reason: str,
                           memo: kopf.Memo, retry: int = 0, **_: Any) -> None:
    """An InferenceRouter: tracked (for the resync, and for refreshes when its fleets change), then reconciled."""
    state, ns = OperatorState.of(memo), namespace or "default"
    watched = tuple(str(n) for n in (body.get("spec") or {}).get("watchNamespaces") or ()) or (ns,)
    state.track_router(ns, name, uid, watched)
    try:
        found = await run_router_reconcile(ns, name, state, reason, uid=uid, retry=retry)
    except (kopf.PermanentError, kopf.TemporaryError) as e:
        kopf.event(body, type="Warning", reason=_failure_reason(e), message=str(e)[:1024])
        raise
    if found and reason in (kopf.Reason.CREATE, kopf.Reason.UPDATE):
        verb = "created" if reason == kopf.Reason.CREATE else "updated"
        kopf.event(body, type="Normal", reason="Applied",
                   message=f"{verb}: ServiceAccount, a Role and RoleBinding in {', '.join(watched)}, Deployment, "
                           "Service, PodDisruptionBudget applied")


@kopf.on.event("apps", "v1", "deployments", labels={MANAGED_BY_LABEL: MANAGER, NAME_LABEL: ROUTER_APP})
async def router_deployment_changed(body: kopf.Body, type: str | None, memo: kopf.Memo, logger: kopf.Logger,
                                    **_: Any) -> None:
    """A router's Deployment changed (its pods became ready, someone edited it): reconcile that router (by name,
    as deployment_changed does for InferenceDeployments)."""
    owner = next((o for o in body.get("metadata", {}).get("ownerReferences") or []
                  if o.get("kind") == ROUTER_KIND and o.get("apiVersion", "").startswith(GROUP + "/")
                  and o.get("controller")), None)
    if type is None or owner is None:
        return  # the initial listing (the CR's resume handler covers it), or not a router's
    ns = body["metadata"]["namespace"]
    try:
        await run_router_reconcile(ns, owner["name"], OperatorState.of(memo), "deployment")
    except (kopf.PermanentError, kopf.TemporaryError) as e:
        logger.warning(f"reconcile of InferenceRouter {ns}/{owner['name']} after a Deployment {type} failed: {e}")


@kopf.on.event(GROUP, VERSION, ROUTER_PLURAL)
async def router_deleted(type: str | None, namespace: str | None, name: str | None, uid: str | None,
                         memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """Forget the router and delete its grants in other namespaces (garbage collection takes the rest).

    On the watch's DELETED event, not an optional on.delete handler: without a finalizer the object is gone before
    kopf would run one, so kopf may skip it; every watch event reaches an event handler. A deletion missed while
    the operator was down is swept by the resync."""
    if type != "DELETED":
        return
    state, ns = OperatorState.of(memo), namespace or "default"
    if uid is not None:
        state.forget_router(ns, name or "", uid)
    try:
        await router_reconcile.release(state, ns, name or "")
    except (ReconcileError, ApiError, aiohttp.ClientError, TimeoutError) as e:
        logger.warning(f"deleting the grants of InferenceRouter {ns}/{name} failed (the resync retries): {e}")
