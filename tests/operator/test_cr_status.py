"""status.observe(): the reconcile's conditions from the Deployment it applied."""

from __future__ import annotations

from typing import Any

from kvfleet_operator.status import observe

NOW, LATER = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def dep(replicas: int, ready: int, updated: int, *, generation: int = 2, observed: int = 2,
        conditions: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"metadata": {"generation": generation},
            "status": {"replicas": replicas, "readyReplicas": ready, "updatedReplicas": updated,
                       "observedGeneration": observed, "conditions": conditions or []}}


def conds(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def run(deployment: dict[str, Any] | None, desired: int = 2, error: str | None = None,
        previous: list[dict[str, Any]] | None = None, now: str = NOW) -> dict[str, Any]:
    return observe(generation=5, desired=desired, selector="a=b", deployment=deployment, error=error,
                   previous=previous or [], now=now)


def test_all_ready() -> None:
    s = run(dep(2, 2, 2))
    assert conds(s) == {"Ready": ("True", "AllReplicasReady"), "Progressing": ("False", "RolloutComplete"),
                        "Degraded": ("False", "AsExpected")}
    assert (s["observedGeneration"], s["replicas"], s["readyReplicas"], s["desiredReplicas"], s["selector"]) == (
        5, 2, 2, 2, "a=b")
    assert all(c["observedGeneration"] == 5 for c in s["conditions"])


def test_starting_rolling_and_scaling() -> None:
    assert conds(run(dep(2, 0, 2)))["Ready"] == ("False", "NoReplicaReady")
    assert conds(run(dep(2, 0, 2)))["Progressing"] == ("True", "ReplicasStarting")
    assert conds(run(dep(3, 2, 1)))["Progressing"] == ("True", "RollingOut")
    assert conds(run(dep(3, 2, 1)))["Ready"] == ("True", "PartiallyReady")
    assert conds(run(dep(1, 1, 1), desired=3))["Progressing"] == ("True", "ScalingUp")
    assert conds(run(dep(3, 3, 3), desired=2))["Progressing"] == ("True", "ScalingDown")
    assert conds(run(dep(2, 2, 2, generation=3, observed=2)))["Progressing"] == ("True", "RollingOut")
    assert conds(run(None))["Progressing"] == ("True", "RollingOut")
    assert conds(run(dep(0, 0, 0), desired=0))["Ready"] == ("False", "ScaledToZero")


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
    same = run(dep(2, 1, 2), previous=first["conditions"], now=LATER)  # Ready False→True, Degraded unchanged
    times = {c["type"]: c["lastTransitionTime"] for c in same["conditions"]}
    assert times == {"Ready": LATER, "Progressing": NOW, "Degraded": NOW}
