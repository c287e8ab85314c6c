"""kopf handlers: every trigger runs the one reconcile (reconcile.py); daemons resync and autoscale; thin by design."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from typing import Any, TypeVar

import aiohttp
import kopf

from kvfleet_operator import autoscaling_loop, metrics
from kvfleet_operator.builders import MANAGED_BY_LABEL, MANAGER
from kvfleet_operator.config import OperatorConfig
from kvfleet_operator.kube import ApiError, Kube, default_login
from kvfleet_operator.models import GROUP, KIND, PLURAL, VERSION
from kvfleet_operator.reconcile import ReconcileError, apply_desired, reconcile_object

__all__ = ["apply_desired", "reconcile_object"]  # the autoscaler's hook and the reconcile, for callers and tests

_RETRY_SECONDS, _MAX_RETRY_SECONDS = 5.0, 300.0
_GC_RETRY_SECONDS = 5.0  # an owner's namesake left by a deleted CR: garbage collection takes seconds
Fn = TypeVar("Fn", bound=Callable[..., Any])


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


def _backoff(retry: int) -> float:
    return min(_RETRY_SECONDS * 2.0 ** min(retry, 10), _MAX_RETRY_SECONDS)


async def run_reconcile(namespace: str, name: str, memo: kopf.Memo, trigger: str, *, uid: str | None = None,
                        retry: int = 0) -> int | None:
    """reconcile_object with its failures turned into kopf's retry policy: PermanentError when only a changed
    object can help (an invalid spec, an object of the same name we do not control), else TemporaryError with
    back-off (API errors that heal, a network error or timeout towards the apiserver)."""
    start = time.perf_counter()
    try:
        replicas = await reconcile_object(namespace, name, memo, uid=uid)
    except ReconcileError as e:
        metrics.RECONCILES.labels(trigger=trigger, result="invalid" if e.permanent else "error").inc()
        if e.permanent:
            raise kopf.PermanentError(e.message) from e
        delay = _GC_RETRY_SECONDS if e.reason == "WaitingForGarbageCollection" else _backoff(retry)
        raise kopf.TemporaryError(e.message, delay=delay) from e
    except ApiError as e:
        metrics.RECONCILES.labels(trigger=trigger, result="error").inc()
        if e.permanent:
            raise kopf.PermanentError(f"the apiserver refused a request: {e}") from e
        raise kopf.TemporaryError(f"could not reach the desired state: {e}", delay=_backoff(retry)) from e
    except (aiohttp.ClientError, TimeoutError) as e:  # asyncio.TimeoutError is TimeoutError
        metrics.RECONCILES.labels(trigger=trigger, result="error").inc()
        raise kopf.TemporaryError(f"the apiserver did not answer: {type(e).__name__}: {e}",
                                  delay=_backoff(retry)) from e
    metrics.RECONCILES.labels(trigger=trigger, result="ok" if replicas is not None else "gone").inc()
    metrics.RECONCILE_SECONDS.observe(time.perf_counter() - start)
    return replicas


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
    """Create, update and operator restart all run the same reconcile; kopf retries TemporaryError."""
    try:
        replicas = await run_reconcile(namespace or "default", name, memo, reason, uid=uid, retry=retry)
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
    ns = body["metadata"]["namespace"]
    try:
        await run_reconcile(ns, owner["name"], memo, "deployment")
    except (kopf.PermanentError, kopf.TemporaryError) as e:
        # Event handlers are not retried; the CR's own handlers and the resync daemon are.
        logger.warning(f"reconcile of {ns}/{owner['name']} after a Deployment {type} failed: {e}")


def _daemon(**kwargs: Any) -> Callable[[Fn], Fn]:
    """kopf.daemon, minus the finalizer kopf puts on every object that has one.

    kopf's finalizer guarantees a daemon stops before its object disappears; ours exit by themselves within
    one round once their object is gone or replaced, so they need no such guarantee, and a finalizer would make
    every InferenceDeployment undeletable while the operator is down or uninstalled (a GitOps tool pruning an
    app together with its operator would hang). The registry fields are kopf internals; a unit test checks
    that no handler of ours requires a finalizer, so a kopf upgrade that changes them fails there."""

    def decorator(fn: Fn) -> Fn:
        kopf.daemon(GROUP, VERSION, PLURAL, **kwargs)(fn)
        spawning = kopf.get_default_registry()._spawning
        spawning._handlers[:] = [dataclasses.replace(h, requires_finalizer=False) if h.fn is fn else h
                                 for h in spawning._handlers]
        return fn

    return decorator


@_daemon(id="resync", cancellation_timeout=5.0)
async def resync(name: str, namespace: str | None, uid: str, memo: kopf.Memo, stopped: kopf.DaemonStopped,
                 logger: kopf.Logger, **_: Any) -> None:
    """Reconcile every object at least every resync_seconds, so a lost or failed event (a Deployment event is
    never retried) or drift nobody was told about heals. Cheap: an unchanged object's applies are server-side
    no-ops and the status is only written when it changed. Objects reconciled recently are skipped (an in-memory
    idle test: kopf's own `idle` would reset on every status write and never fire for an autoscaled object)."""
    cfg: OperatorConfig = memo["cfg"]
    while not stopped:
        await stopped.wait(cfg.resync_seconds)
        last = memo.get("reconciled", {}).get(uid)
        if stopped or (last is not None and _now() - last < cfg.resync_seconds / 2):
            continue
        try:
            if await run_reconcile(namespace or "default", name, memo, "resync", uid=uid) is None:
                memo.get("reconciled", {}).pop(uid, None)
                return  # gone or replaced: the daemon of a recreated object is a new one
        except (kopf.PermanentError, kopf.TemporaryError) as e:
            logger.warning(f"resync of {namespace}/{name} failed: {e}")  # the status says why; next round retries


def _now() -> float:
    return asyncio.get_running_loop().time()  # the clock reconcile_object stamps "reconciled" with


def _builtin(spec: kopf.Spec, **_: Any) -> bool:
    return bool((spec.get("autoscaling") or {}).get("mode") == "builtin")


@_daemon(id="autoscale", when=_builtin, cancellation_timeout=5.0)
async def autoscale(name: str, namespace: str | None, uid: str, memo: kopf.Memo, stopped: kopf.DaemonStopped,
                    logger: kopf.Logger, **_: Any) -> None:
    """Builtin autoscaling, one loop per InferenceDeployment with mode builtin (kopf stops it when the mode
    changes, and pauses it while another operator instance leads)."""
    await autoscaling_loop.run(namespace or "default", name, uid, memo, stopped, logger)


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True)
async def deleted(namespace: str | None, name: str | None, uid: str | None, memo: kopf.Memo, **_: Any) -> None:
    """Forget the per-object metric and memory; the owned objects go with the CR through garbage collection."""
    metrics.forget(namespace or "", name or "")
    memo.get("reconciled", {}).pop(uid, None)
    memo.get("autoscaling", {}).pop(uid, None)
