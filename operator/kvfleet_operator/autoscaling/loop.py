"""The builtin autoscaler's loop for one InferenceDeployment: pods → scrape → window → decide() → replicas + status."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol, cast

import aiohttp
import kopf
from pydantic import ValidationError

from kvfleet_operator import metrics, reconcile
from kvfleet_operator.autoscaling.decide import Decision, Observation, decide
from kvfleet_operator.autoscaling.fleet import Fleet, classify
from kvfleet_operator.autoscaling.memory import Memory
from kvfleet_operator.autoscaling.router_demand import RouterDemand, router_demand
from kvfleet_operator.autoscaling.scrape import scrape_pods
from kvfleet_operator.autoscaling.status import autoscaling_status, conditions, policy, rebuild_state
from kvfleet_operator.builders import selector_string
from kvfleet_operator.config import OperatorConfig
from kvfleet_operator.kube import AUTOSCALER_MANAGER, ApiError, KubeClient
from kvfleet_operator.models import API_VERSION, KIND, InferenceDeploymentSpec
from kvfleet_operator.ownership import classify as ownership
from kvfleet_operator.peering import Leadership
from kvfleet_operator.plan import ReconcileError
from kvfleet_operator.status import AUTOSCALER_CONDITIONS, CAPACITY_BLOCKED, METRICS_AVAILABLE, now_rfc3339

log = logging.getLogger(__name__)
DEFAULT_INTERVAL = 15.0
EventFn = Callable[..., None]
Sleep = Callable[[float], Awaitable[None]]


class Context(reconcile.Context, Protocol):
    """The parts of the operator's state (state.OperatorState) an autoscaling loop uses."""

    leadership: Leadership
    memories: dict[str, Memory]  # uid → what its loop keeps between rounds


def memory(ctx: Context, uid: str) -> Memory:
    return ctx.memories.setdefault(uid, Memory())


def router_scope(cfg: OperatorConfig) -> tuple[str, ...] | None:
    """Where router pods are looked for: the namespaces this operator watches, or every namespace (None) when it
    runs cluster-wide. Not only the deployment's own: an InferenceRouter may route to other namespaces."""
    return cfg.namespaces or None


async def run(namespace: str, name: str, uid: str, ctx: Context, *, sleep: Sleep = asyncio.sleep) -> None:
    """Decide every spec.autoscaling.intervalSeconds until the object is gone or replaced (then forget its
    memory) or the task is cancelled. Rounds are skipped while another operator instance leads."""
    interval, gone = DEFAULT_INTERVAL, False
    try:
        while True:
            if await ctx.leadership.leading():
                try:
                    following = await tick(namespace, name, uid, ctx)
                except (ApiError, ReconcileError, aiohttp.ClientError, TimeoutError) as e:
                    metrics.AUTOSCALE_TICKS.labels(result="error").inc()
                    log.warning(f"{namespace}/{name}: autoscaling round failed, next in {interval:g}s: {e}")
                except Exception:  # a bug in one round must not stop scaling for good (kopf retried daemons too)
                    metrics.AUTOSCALE_TICKS.labels(result="error").inc()
                    log.exception(f"{namespace}/{name}: autoscaling round failed, next in {interval:g}s")
                else:
                    if following is None:
                        gone = True
                        return
                    interval = following
            await sleep(interval)
    finally:
        if gone:
            ctx.memories.pop(uid, None)


async def tick(namespace: str, name: str, uid: str, ctx: Context, *, clock: Callable[[], float] = time.time,
               post_event: EventFn | None = None) -> float | None:
    """One round. Returns the seconds until the next, or None once the object is gone or replaced. A round that
    cannot decide (no Deployment yet, an invalid spec, mode no longer builtin) changes nothing."""
    kube, cfg = ctx.kube, ctx.cfg
    cr = await kube.get(KIND, namespace, name)
    meta = (cr or {}).get("metadata") or {}
    if cr is None or meta.get("uid") != uid or meta.get("deletionTimestamp"):
        return None
    try:
        spec = InferenceDeploymentSpec.model_validate(cr.get("spec") or {})
    except ValidationError:
        return DEFAULT_INTERVAL  # the reconcile reports it (Degraded=InvalidSpec)
    a = spec.autoscaling
    if a.mode != "builtin":
        return float(a.interval_seconds)
    dep = await kube.get("Deployment", namespace, name)
    if dep is None or ownership(dep, "Deployment", namespace, name, uid).verdict != "ours":
        return float(a.interval_seconds)  # not created yet, or not ours to scale: the reconcile says why
    now = clock()
    mem = memory(ctx, uid)
    fleet = classify(await kube.list("Pod", namespace, selector_string(name)), now, cfg.unschedulable_grace_seconds)
    # The routers are read every round, not only at zero: a router holding requests (no replica was ready) is
    # demand at any replica count, and scaling to zero needs them all read and holding nothing.
    result, demand = await asyncio.gather(
        scrape_pods(fleet.targets(), timeout=cfg.scrape_timeout_seconds, clock=clock),
        router_demand(kube, router_scope(cfg), timeout=cfg.scrape_timeout_seconds))
    for err in result.errors.values():
        metrics.SCRAPE_ERRORS.labels(reason=metrics.scrape_error_reason(err)).inc()
    mem.window.seconds = float(a.window_seconds)
    # The window follows the ready pods: one that misses a scrape keeps its history, one that stops serving
    # (unready, deleted) leaves it.
    mem.window.update(result.snapshots.values(), live={p.name for p in fleet.ready}, now=now)
    pol = policy(a)
    previous = (cr.get("status") or {}).get("autoscaling")
    complete = len(result.snapshots) == len(fleet.ready)
    # The window's sums cover every pod in it, so with a pod missing this round they would add that pod's
    # stale sample to a total decide() divides by the pods that reported: then take this round's fresh sum,
    # and no mean (decide() moves down only when the newest depth and the window's mean agree).
    queue: float | None = None
    queue_mean: float | None = None
    if result.snapshots:
        if complete:
            queue, queue_mean = mem.window.queue_depth(), mem.window.mean_queue_depth()
        else:
            queue = sum(s.queue_depth for s in result.snapshots.values())
    obs = Observation(
        now=now, current_replicas=int(dep["spec"].get("replicas") or 0), ready_replicas=len(fleet.ready),
        starting_replicas=len(fleet.starting), reporting_replicas=len(result.snapshots),
        unschedulable_replicas=len(fleet.unschedulable), queue_depth=queue, queue_depth_mean=queue_mean,
        request_rate=mem.window.request_rate(),  # decide() takes no rate sample on partial metrics
        latency={t.source: mem.window.latency(t.metric, t.percentile / 100) for t in pol.latency_targets},
        new_startup_durations=mem.startups.observe(fleet), starting_ages=fleet.starting_ages(now),
        held_requests=demand.of(namespace, name), routers_reporting=len(demand.reporting),
        routers_failing=len(demand.errors), requests_arrived=mem.window.arrivals() if complete else None,
        # The capacity model reads the flow only when every ready pod reported: a silent pod's load is unknown.
        flow=mem.window.flow() if complete else None, flow_last=mem.window.flow(last=True) if complete else None,
        queue_time_p95=mem.window.quantile("queue", 0.95) if complete else None,
        kv_usage=max((s.kv_usage for s in result.snapshots.values() if s.kv_usage is not None), default=None))
    carried = mem.state if mem.state is not None else rebuild_state(previous)
    d = decide(pol, obs, carried)
    if d.desired_replicas != d.current_replicas:
        # The same full plan and field manager as the reconcile, with the decided replicas; it fails loudly
        # (and this round's state is dropped, so the next round decides again) if the object changed hands.
        if await reconcile.apply_desired(namespace, name, ctx, d.desired_replicas, uid=uid) is None:
            return None  # deleted or replaced meanwhile
        up = d.desired_replicas > d.current_replicas
        _event(post_event, cr, "Normal", "ScaledUp" if up else "ScaledDown",
               f"{d.current_replicas} → {d.desired_replicas} replicas: {d.reason}")
    mem.state = d.state
    metrics.set_desired(namespace, name, d.limited_by, d.desired_replicas)
    metrics.set_capacity(namespace, name, d.proposals)
    metrics.AUTOSCALE_TICKS.labels(result="scaled" if d.desired_replicas != d.current_replicas else "kept").inc()
    p95 = (mem.window.quantile("ttft", 0.95), mem.window.quantile("itl", 0.95))  # the columns kubectl get shows
    await _write_status(kube, cr, d, fleet, result.errors, demand, p95, post_event)
    return float(a.interval_seconds)


async def _write_status(kube: KubeClient, cr: dict[str, Any], d: Decision, fleet: Fleet, errors: Mapping[str, str],
                        routers: RouterDemand, p95: tuple[float | None, float | None],
                        post_event: EventFn | None) -> None:
    meta, status = cr["metadata"], cr.get("status") or {}
    previous = [c for c in status.get("conditions") or [] if c.get("type") in AUTOSCALER_CONDITIONS]
    conds = conditions(d, fleet, errors, generation=int(meta.get("generation") or 0), now=now_rfc3339(),
                       previous=previous, routers=routers)
    was = {c["type"]: c.get("status") for c in previous}
    for c in conds:  # a warning when capacity or metrics go missing, once per transition rather than every round
        blocked = c["type"] == CAPACITY_BLOCKED and c["status"] == "True"
        blind = c["type"] == METRICS_AVAILABLE and c["reason"] in ("ScrapeFailed", "RouterScrapeFailed", "NoRouter")
        if (blocked or blind) and was.get(c["type"]) != c["status"]:
            _event(post_event, cr, "Warning", c["reason"], c["message"])
    body = autoscaling_status(d, status.get("autoscaling"), *p95).model_dump(mode="json", by_alias=True,
                                                                             exclude_none=True)
    await kube.apply({"apiVersion": API_VERSION, "kind": KIND,
                      "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
                      "status": {"autoscaling": body, "conditions": conds}},
                     subresource="status", manager=AUTOSCALER_MANAGER)


def _event(post: EventFn | None, cr: dict[str, Any], type_: str, reason: str, message: str) -> None:
    # kopf.event reads only apiVersion, kind and metadata, through Mapping.get: a plain dict serves.
    (post or kopf.event)(cast(kopf.Body, cr), type=type_, reason=reason, message=message[:1024])
