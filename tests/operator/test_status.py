"""status.observe() and invalid_spec(): the reconcile's conditions from the Deployment it applied."""

from __future__ import annotations

from typing import Any

from kvfleet_operator.status import RECONCILE_FIELDS, invalid_spec, observe

NOW, LATER = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def dep(replicas: int, ready: int, updated: int, *, generation: int = 2, observed: int = 2,
        conditions: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"metadata": {"generation": generation},
            "status": {"replicas": replicas, "readyReplicas": ready, "updatedReplicas": updated,
                       "observedGeneration": observed, "conditions": conditions or []}}


def conds(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def run(deployment: dict[str, Any] | None, desired: int = 2, error: str | None = None,
        previous: list[dict[str, Any]] | None = None, now: str = NOW,
        error_reason: str = "ApplyFailed") -> dict[str, Any]:
    return observe(generation=5, desired=desired, selector="a=b", deployment=deployment, error=error,
                   previous=previous or [], now=now, error_reason=error_reason)


def test_all_ready() -> None:
    s = run(dep(2, 2, 2))
    assert conds(s) == {"Ready": ("True", "AllReplicasReady"), "Available": ("True", "ReplicasAvailable"),
                        "Progressing": ("False", "RolloutComplete"), "Degraded": ("False", "AsExpected")}
    assert (s["observedGeneration"], s["replicas"], s["readyReplicas"], s["desiredReplicas"], s["selector"]) == (
        5, 2, 2, 2, "a=b")
    assert all(c["observedGeneration"] == 5 for c in s["conditions"])


def test_starting_rolling_and_scaling() -> None:
    assert conds(run(dep(2, 0, 2)))["Ready"] == ("False", "NoReplicaReady")
    assert conds(run(dep(2, 0, 2)))["Progressing"] == ("True", "ReplicasStarting")
    assert conds(run(dep(3, 2, 1)))["Progressing"] == ("True", "RollingOut")
    assert conds(run(dep(3, 2, 1)))["Ready"] == ("False", "RollingOut")
    assert conds(run(dep(1, 1, 1), desired=3))["Progressing"] == ("True", "ScalingUp")
    assert conds(run(dep(3, 3, 3), desired=2))["Progressing"] == ("True", "ScalingDown")
    assert conds(run(dep(2, 2, 2, generation=3, observed=2)))["Progressing"] == ("True", "RollingOut")
    assert conds(run(None))["Progressing"] == ("True", "RollingOut")
    assert conds(run(dep(0, 0, 0), desired=0))["Ready"] == ("False", "ScaledToZero")


def test_ready_means_the_current_generation_is_rolled_out_and_available_means_served() -> None:
    # Mid-rollout with maxSurge 1: three pods ready, but one runs the old template. Ready said True before.
    mid = conds(run(dep(3, 3, 2)))
    assert mid["Ready"] == ("False", "RollingOut") and mid["Available"] == ("True", "ReplicasAvailable")
    # The Deployment controller has not seen the new template yet: its counts describe the old one.
    assert conds(run(dep(2, 2, 2, generation=3, observed=2)))["Ready"] == ("False", "RollingOut")
    # Scaling up on the current template: serving, not at the desired capacity yet.
    up = conds(run(dep(4, 2, 4), desired=4))
    assert up["Ready"] == ("False", "ReplicasStarting") and up["Available"] == ("True", "ReplicasAvailable")
    # Scaling down: every desired replica is ready on the current template.
    assert conds(run(dep(3, 3, 3), desired=2))["Ready"] == ("True", "AllReplicasReady")
    assert conds(run(dep(2, 0, 2)))["Available"] == ("False", "NoReplicaReady")
    # An apply that failed: the current generation is not what runs, whatever the counts say.
    failed = conds(run(dep(2, 2, 2), error="x", error_reason="ResourceExists"))
    assert failed["Ready"] == ("False", "ResourceExists") and failed["Degraded"] == ("True", "ResourceExists")
    stalled = dep(2, 2, 1, conditions=[{"type": "Progressing", "status": "False",
                                        "reason": "ProgressDeadlineExceeded", "message": "too slow"}])
    assert conds(run(stalled))["Ready"] == ("False", "ProgressDeadlineExceeded")


def test_invalid_spec_changes_only_degraded() -> None:
    good = run(dep(2, 2, 2))
    out = invalid_spec(good, generation=6, message="invalid spec: x", now=LATER)
    assert {k: out[k] for k in RECONCILE_FIELDS} == {k: good[k] for k in RECONCILE_FIELDS}  # replicas not zeroed
    assert conds(out) == {**conds(good), "Degraded": ("True", "InvalidSpec")}
    assert [c for c in out["conditions"] if c["type"] != "Degraded"] == [
        c for c in good["conditions"] if c["type"] != "Degraded"]
    assert invalid_spec({}, generation=1, message="m", now=NOW)["conditions"][0]["reason"] == "InvalidSpec"


def test_degraded_reasons() -> None:
    assert conds(run(dep(2, 2, 2), error="422 Invalid: bad"))["Degraded"] == ("True", "ApplyFailed")
    assert conds(run(dep(2, 2, 2), error="x"))["Progressing"] == ("False", "ApplyFailed")
    stalled = dep(2, 1, 2, conditions=[{"type": "Progressing", "status": "False",
                                        "reason": "ProgressDeadlineExceeded", "message": "too slow"}])
    assert conds(run(stalled))["Degraded"] == ("True", "ProgressDeadlineExceeded")
    quota = dep(1, 1, 1, conditions=[{"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate",
                                      "message": "exceeded quota"}])
    assert conds(run(quota))["Degraded"] == ("True", "FailedCreate")


def test_transition_time_moves_only_when_status_flips() -> None:
    first = run(dep(2, 0, 2))
    same = run(dep(2, 1, 2), previous=first["conditions"], now=LATER)  # Available False→True, the rest unchanged
    times = {c["type"]: c["lastTransitionTime"] for c in same["conditions"]}
    assert times == {"Ready": NOW, "Available": LATER, "Progressing": NOW, "Degraded": NOW}
