"""InferenceDeployment status (pydantic) and the pure rule that derives it from the owned Deployment."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel
from pydantic.config import JsonDict

# Condition types: the reconcile owns the first four, the builtin autoscaler the rest.
READY, AVAILABLE, PROGRESSING, DEGRADED = "Ready", "Available", "Progressing", "Degraded"
SCALING_ACTIVE, SCALING_LIMITED, CAPACITY_BLOCKED, METRICS_AVAILABLE = (
    "ScalingActive", "ScalingLimited", "CapacityBlocked", "MetricsAvailable")
RECONCILE_CONDITIONS = (READY, AVAILABLE, PROGRESSING, DEGRADED)
AUTOSCALER_CONDITIONS = (SCALING_ACTIVE, SCALING_LIMITED, CAPACITY_BLOCKED, METRICS_AVAILABLE)
# Status fields the reconcile writes (besides its conditions); the autoscaler writes `autoscaling`.
RECONCILE_FIELDS = ("observedGeneration", "replicas", "readyReplicas", "updatedReplicas", "desiredReplicas",
                    "selector")

_DATE_TIME: JsonDict = {"format": "date-time"}


class _Status(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid",
                              use_attribute_docstrings=True)


class Condition(_Status):
    """One aspect of the resource's state (metav1.Condition shape)."""

    type: str = Field(max_length=64)
    """Ready, Available, Progressing, Degraded, ScalingActive, ScalingLimited, CapacityBlocked or
    MetricsAvailable."""
    status: Literal["True", "False", "Unknown"]
    """Whether the condition holds."""
    reason: str = Field(max_length=128)
    """A CamelCase reason code."""
    message: str = Field(default="", max_length=32768)
    """A sentence for humans."""
    last_transition_time: str = Field(json_schema_extra=_DATE_TIME)
    """When status last changed."""
    observed_generation: int | None = None
    """The metadata.generation this condition was computed from."""


class ScalingProposal(_Status):
    """What one signal asks for."""

    source: str = Field(max_length=64)
    """The signal, e.g. queue or ttft_p95."""
    observed: float | None = None
    """Its value over the window (null when no replica reported it)."""
    target: float
    """Its target from spec.autoscaling.targets."""
    replicas: int
    """Replicas this signal alone would want."""


class ScalingDecision(_Status):
    """One builtin-autoscaler decision, with its inputs and why."""

    time: str = Field(json_schema_extra=_DATE_TIME)
    """When the decision was taken."""
    current_replicas: int
    """Replicas of the Deployment before the decision."""
    ready_replicas: int
    """Replicas that were ready and serving."""
    starting_replicas: int
    """Replicas still starting (counted as capacity on the way)."""
    desired_replicas: int
    """Replicas decided."""
    proposals: list[ScalingProposal] = Field(default_factory=list, max_length=16)
    """One proposal per target; the largest wins before limits."""
    limited_by: str = Field(default="none", max_length=64)
    """What held the decision back: tolerance, scaleUpStabilization, scaleUpRate, scaleDownStabilization,
    scaleDownRate, recentScaleDown, minReplicas, maxReplicas, partialMetrics, capacityBlocked, noMetrics,
    scaleToZeroWindow (not idle for the whole scale-to-zero window yet), noRouter (no kvfleet-router answered,
    so zero would be a one-way trip) or none."""
    reason: str = Field(default="", max_length=1024)
    """The decision in a sentence."""


class AutoscalingStatus(_Status):
    """What the builtin autoscaler last decided and learned."""

    last_decision: ScalingDecision | None = None
    """The latest decision."""
    history: list[ScalingDecision] = Field(default_factory=list, max_length=10)
    """Recent decisions that changed replicas, newest first."""
    expected_startup_seconds: float | None = None
    """Learned start-up time in seconds, for machines: the median, over the last startupSamples agent pods this
    operator saw go from created to Ready, of that time (scheduling, image pull, model load and warm-up). A pod
    still starting after twice this stops counting as capacity on the way (unless spec.autoscaling
    .startupGraceSeconds is set). Where an agent's own start goes: its kvfleet_startup_phase_seconds gauges."""
    expected_startup: str | None = Field(default=None, max_length=16)
    """expectedStartupSeconds with its unit (e.g. 84.0s), for kubectl describe."""
    startup_samples: int | None = Field(default=None, ge=0)
    """Pod start-ups the learned time is the median of (at most 10, the newest; after an operator restart the
    stored expectedStartupSeconds counts as one)."""
    last_ttft_p95_seconds: float | None = None
    """ttftP95 in seconds, for machines."""
    ttft_p95: str | None = Field(default=None, max_length=16)
    """Time to first token, 95th percentile, with its unit (e.g. 172ms): over the last
    spec.autoscaling.windowSeconds, across the ready replicas (histogram_quantile(0.95, sum by (le)
    (increase(kvfleet_time_to_first_token_seconds_bucket[window]))), as Prometheus computes it). The autoscaler
    acts on the lower of this and the last interval's p95 (lastDecision.proposals), so a spike must last to
    scale up: the two figures can differ. kubectl get shows it as TTFT-P95."""
    itl_p95: str | None = Field(default=None, max_length=16)
    """Inter-token latency, 95th percentile, with its unit (e.g. 21.4ms): over the same window and replicas as
    ttftP95. kubectl get shows it as ITL-P95."""


class InferenceDeploymentStatus(_Status):
    """Observed state, written by the operator."""

    observed_generation: int | None = None
    """The metadata.generation the operator last reconciled."""
    replicas: int = 0
    """Agent pods that exist (the scale subresource's status path)."""
    ready_replicas: int = 0
    """Agent pods ready to serve."""
    updated_replicas: int = 0
    """Agent pods running the current configuration."""
    desired_replicas: int | None = None
    """Replicas the operator asks the Deployment for."""
    selector: str | None = Field(default=None, max_length=1024)
    """Label selector of the agent pods (the scale subresource's selector, for HPA/KEDA)."""
    conditions: list[Condition] = Field(
        default_factory=list, max_length=16,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]})
    """Ready (the current generation is fully rolled out and every desired replica is ready), Available (at
    least one replica serves), Progressing, Degraded, and the builtin autoscaler's ScalingActive, ScalingLimited,
    CapacityBlocked and MetricsAvailable."""
    autoscaling: AutoscalingStatus | None = None
    """Builtin autoscaling's last decision and learned figures."""


def human_seconds(seconds: float) -> str:
    """A duration the way a person reads it in a column: 0.1718 → 172ms, 0.0214 → 21.4ms, 2.5 → 2.50s."""
    if seconds < 0.01:
        return f"{seconds * 1000:.2f}ms"
    if seconds < 0.1:
        return f"{seconds * 1000:.1f}ms"
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    return f"{seconds:.2f}s" if seconds < 100 else f"{seconds:.0f}s"


def now_rfc3339() -> str:
    """The current time in the form Kubernetes writes timestamps."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(type_: str, ok: bool, reason: str, message: str, generation: int, now: str,
              previous: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One condition; `previous` (by type) keeps lastTransitionTime while the status does not flip."""
    status = "True" if ok else "False"
    old = previous.get(type_)
    # The transition time moves only when the status flips, so `kubectl wait` and alerts see real changes.
    since = old["lastTransitionTime"] if old and old.get("status") == status and old.get("lastTransitionTime") else now
    return {"type": type_, "status": status, "reason": reason, "message": message[:32768],
            "lastTransitionTime": since, "observedGeneration": generation}


def observe(*, generation: int, desired: int, selector: str, deployment: dict[str, Any] | None,
            error: str | None, previous: list[dict[str, Any]], now: str,
            error_reason: str = "ApplyFailed", zero: str = "no replicas are requested",
            waiting_for: str = "a node with room for them") -> dict[str, Any]:
    """The status fields the reconcile owns, from the Deployment it applied (or the error that stopped it).

    Ready is what `kubectl wait --for=condition=Ready`, Flux and Argo CD health read: True only once the current
    configuration is fully rolled out (no pod of an older template left) and at least `desired` replicas are
    ready, and never while an apply failed. Available says whether the model is served at all (>= 1 ready).
    At zero desired replicas both are False with reason ScaledToZero and the message `zero`. `waiting_for` says
    what pods that are not ready may be waiting for (plan.waiting_for: GPUs, or CPU and memory).
    """
    dstat = (deployment or {}).get("status") or {}
    replicas, ready, updated = (int(dstat.get(k) or 0) for k in ("replicas", "readyReplicas", "updatedReplicas"))
    dgen = int(((deployment or {}).get("metadata") or {}).get("generation") or 0)
    seen = int(dstat.get("observedGeneration") or 0) >= dgen and deployment is not None
    dconds = {c.get("type"): c for c in dstat.get("conditions") or []}
    stalled = dconds.get("Progressing", {}).get("status") == "False"
    failure = dconds.get("ReplicaFailure", {}).get("status") == "True"
    # Every existing pod runs the current template (scaling may still be under way); with `ready >= desired`
    # on top, every desired replica of the new template is ready (old pods would make updated < replicas).
    current_template = seen and updated == replicas and updated >= desired
    settled = current_template and ready >= desired and replicas == desired
    prev = {c.get("type", ""): c for c in previous}

    def cond(type_: str, ok: bool, reason: str, message: str) -> dict[str, Any]:
        return condition(type_, ok, reason, message, generation, now, prev)

    if error is not None:
        degraded = cond(DEGRADED, True, error_reason, error)
    elif stalled:
        degraded = cond(DEGRADED, True, dconds["Progressing"].get("reason") or "ProgressDeadlineExceeded",
                        dconds["Progressing"].get("message") or "the rollout stopped making progress")
    elif failure:
        degraded = cond(DEGRADED, True, dconds["ReplicaFailure"].get("reason") or "ReplicaFailure",
                        dconds["ReplicaFailure"].get("message") or "pods could not be created")
    else:
        degraded = cond(DEGRADED, False, "AsExpected", "the Deployment, Service and PodDisruptionBudget are applied")

    counts = f"{ready}/{desired} replicas ready, {updated} of {replicas} run the current configuration"
    if error is not None:
        ready_c = cond(READY, False, error_reason, f"the desired state is not fully applied ({counts})")
    elif desired == 0:
        ready_c = cond(READY, False, "ScaledToZero", zero)
    elif stalled:
        ready_c = cond(READY, False, degraded["reason"], f"the rollout stopped making progress ({counts})")
    elif current_template and ready >= desired:
        ready_c = cond(READY, True, "AllReplicasReady", f"{ready}/{desired} replicas are ready")
    elif not current_template:
        ready_c = cond(READY, False, "RollingOut", counts)
    else:
        ready_c = cond(READY, False, "ReplicasStarting" if ready else "NoReplicaReady", counts)

    if ready > 0:
        available = cond(AVAILABLE, True, "ReplicasAvailable", f"{ready}/{desired} replicas serve the model")
    elif desired == 0:
        available = cond(AVAILABLE, False, "ScaledToZero", zero)
    else:
        available = cond(AVAILABLE, False, "NoReplicaReady",
                         f"0/{desired} replicas are ready (loading, or waiting for {waiting_for})")

    if error is not None:
        progressing = cond(PROGRESSING, False, error_reason, "the desired state could not be applied")
    elif settled:
        progressing = cond(PROGRESSING, False, "RolloutComplete", f"{desired} replicas run the current configuration")
    elif updated < replicas or not seen:  # pods of an older template remain
        progressing = cond(PROGRESSING, True, "RollingOut",
                           f"{updated}/{desired} replicas run the current configuration")
    else:
        verb = "ScalingUp" if replicas < desired else "ScalingDown" if replicas > desired else "ReplicasStarting"
        progressing = cond(PROGRESSING, True, verb, f"{replicas} replicas exist, {ready} ready, {desired} desired")

    return {"observedGeneration": generation, "replicas": replicas, "readyReplicas": ready,
            "updatedReplicas": updated, "desiredReplicas": desired, "selector": selector,
            "conditions": [ready_c, available, progressing, degraded]}


def invalid_spec(current: dict[str, Any], *, generation: int, message: str, now: str) -> dict[str, Any]:
    """The reconcile's status when the spec cannot be parsed: only Degraded changes. The counts and the other
    conditions are sent back as they are, because under server-side apply a field the manager stops sending is
    removed, and an HPA reads status.replicas through /scale: zeroing it would make it scale on a lie."""
    previous = [c for c in current.get("conditions") or [] if c.get("type") in RECONCILE_CONDITIONS]
    prev = {c.get("type", ""): c for c in previous}
    degraded = condition(DEGRADED, True, "InvalidSpec", message, generation, now, prev)
    kept = {k: current[k] for k in RECONCILE_FIELDS if current.get(k) is not None}
    return {**kept, "conditions": [*(c for c in previous if c.get("type") != DEGRADED), degraded]}
