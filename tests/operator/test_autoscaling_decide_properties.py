"""decide() properties over random policies, observations and carried state (hypothesis), scale to zero and the
capacity model (flows, learned lines, latency ceilings) included."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from kvfleet_operator.autoscaling.decide import (
    AutoscalerState,
    AutoscalingPolicy,
    Behavior,
    LatencyTarget,
    Observation,
    Recommendation,
    ScaleEvent,
    ScalingPolicy,
    ScalingRules,
    decide,
)
from kvfleet_operator.autoscaling.decision import Capacity, Flow, Line

NOW = 10_000.0
TARGETS = (LatencyTarget("ttft", 95, 0.5), LatencyTarget("itl", 99, 0.05))


@st.composite
def rules(draw: st.DrawFn) -> ScalingRules:
    policies = draw(st.lists(st.builds(ScalingPolicy, st.sampled_from(["Pods", "Percent"]),
                                       st.integers(1, 300), st.integers(1, 120)), min_size=1, max_size=3))
    return ScalingRules(draw(st.integers(0, 600)), tuple(policies), draw(st.sampled_from(["Max", "Min", "Disabled"])))


@st.composite
def policies(draw: st.DrawFn) -> AutoscalingPolicy:
    lo = draw(st.integers(0, 5))
    queue = draw(st.none() | st.floats(0.5, 200))
    latency = tuple(draw(st.lists(st.sampled_from(TARGETS), unique=True, max_size=2)))
    return AutoscalingPolicy(min_replicas=lo, max_replicas=draw(st.integers(max(lo, 1), 40)),
                             tolerance=draw(st.floats(0, 0.5)), queue_depth_per_replica=queue,
                             latency_targets=latency, behavior=Behavior(draw(rules()), draw(rules())),
                             startup_grace_seconds=draw(st.none() | st.floats(0, 1000)),
                             startup_budget_seconds=draw(st.floats(0, 4000)),
                             unschedulable_budget=draw(st.integers(0, 6)),
                             scale_to_zero_after_seconds=draw(st.floats(10, 900)))


@st.composite
def flows(draw: st.DrawFn, pods: int, always: bool = False) -> Flow | None:
    """A flow through `pods` pods, or (unless `always`) none: agents without the counters, a first scrape.
    Arrivals near the completions half the time, so that the model takes samples and corrects on latency."""
    if pods == 0 or (not always and draw(st.booleans())):
        return None
    # Whole requests over a window of at most an hour: none, or at least 1/3600 per second.
    some = st.floats(1 / 3600, 200)
    completed = draw(some if always else st.just(0.0) | some)
    arrived = completed * draw(st.floats(0.92, 1.08)) if draw(st.booleans()) else draw(st.floats(0, 200))
    return Flow(completed, arrived, draw(st.floats(0, 50_000)), draw(st.floats(0, 20_000)), pods)


@st.composite
def observations(draw: st.DrawFn, modelled: bool = False) -> Observation:
    """Any observation; `modelled`: one the capacity model decides (every ready pod reporting, with a flow)."""
    current = draw(st.integers(1 if modelled else 0, 50))
    ready = draw(st.integers(1 if modelled else 0, current))
    starting = current - ready
    latency = {t.source: draw(st.none() | st.floats(0, 100)) for t in TARGETS}
    quiet = draw(st.booleans())  # half the draws idle-looking, so the rules at zero's door get exercised
    none_or_zero = st.just(0.0) if quiet else st.none() | st.just(0.0) | st.floats(0, 10_000)
    reporting = ready if modelled or draw(st.booleans()) else draw(st.integers(0, ready))  # complete half the time
    return Observation(now=NOW, current_replicas=current, ready_replicas=ready, starting_replicas=starting,
                       reporting_replicas=reporting,
                       unschedulable_replicas=draw(st.integers(0, starting)),
                       queue_depth=draw(none_or_zero), latency=latency,
                       new_startup_durations=tuple(draw(st.lists(st.floats(1, 900), max_size=3))),
                       starting_ages=tuple(draw(st.lists(st.floats(0, 2000), min_size=starting, max_size=starting))),
                       held_requests=draw(st.just(0.0) if quiet else st.sampled_from([0.0, 1.0]) | st.floats(0, 500)),
                       routers_reporting=draw(st.integers(0, 3)), routers_failing=draw(st.integers(0, 1)),
                       requests_arrived=draw(none_or_zero), flow=draw(flows(reporting, modelled)),
                       flow_last=draw(flows(reporting)), queue_time_p95=draw(st.none() | st.floats(0, 30)))


@st.composite
def states(draw: st.DrawFn, modelled: bool = False) -> AutoscalerState:
    """Any carried state; `modelled`: one whose capacity model has a line already."""
    times = st.floats(NOW - 900, NOW)
    recs = draw(st.lists(st.builds(Recommendation, times, st.integers(0, 80)), max_size=20))
    events = draw(st.lists(st.builds(ScaleEvent, times, st.integers(-20, 20).filter(bool)), max_size=6))
    durations = draw(st.lists(st.floats(1, 900), max_size=12))
    samples = draw(st.lists(st.tuples(st.floats(NOW - 2000, NOW), st.floats(1, 5000), st.floats(0.01, 64)),
                            max_size=12))
    lines = st.builds(Line, st.floats(1e-4, 0.1), st.floats(10, 10_000), st.booleans())
    line = draw(lines if modelled else st.none() | lines)
    ceiling = draw(st.none() | st.tuples(st.floats(NOW - 2000, NOW), st.floats(1, 5000)))
    rates = draw(st.lists(st.tuples(st.floats(NOW - 700, NOW - 1), st.floats(0, 10_000)), max_size=30))
    return AutoscalerState(tuple(recs), tuple(events), tuple(durations), tuple(sorted(rates)),
                           draw(st.none() | times), Capacity(tuple(samples), line, ceiling))


@settings(max_examples=200, deadline=None)
@given(policies(), observations(), states())
def test_desired_is_always_within_min_and_max(policy: AutoscalingPolicy, obs: Observation,
                                              state: AutoscalerState) -> None:
    d = decide(policy, obs, state)
    assert policy.min_replicas <= d.desired_replicas <= policy.max_replicas


@settings(max_examples=200, deadline=None)
@given(policies(), observations(), states())
def test_never_scales_down_on_partial_metrics_nor_up_past_the_pending_budget(
        policy: AutoscalingPolicy, obs: Observation, state: AutoscalerState) -> None:
    d = decide(policy, obs, state)
    if not policy.min_replicas <= obs.current_replicas <= policy.max_replicas:
        return  # the bounds are the user's explicit word and win over both guards
    if obs.reporting_replicas < obs.ready_replicas:
        assert d.desired_replicas >= obs.current_replicas
    if obs.unschedulable_replicas > 0:
        room = max(policy.unschedulable_budget - obs.unschedulable_replicas, 0)
        assert d.desired_replicas <= obs.current_replicas + room


@settings(max_examples=200, deadline=None)
@given(policies(), observations(), states())
def test_a_metrics_dropout_never_scales_up(policy: AutoscalingPolicy, obs: Observation,
                                           state: AutoscalerState) -> None:
    # No ready pod reporting and nothing held at a router: whatever stale latency, flow or state is carried,
    # nothing may vote up (the issue: 6 → 11 with 0 of 6 pods reporting).
    d = decide(policy, replace(obs, reporting_replicas=0, held_requests=0.0), state)
    if policy.min_replicas <= obs.current_replicas <= policy.max_replicas and obs.current_replicas > 0:
        assert d.desired_replicas <= obs.current_replicas


@settings(max_examples=300, deadline=None)
@given(policies(), observations(modelled=True), states(modelled=True))
def test_a_capacity_scale_down_never_leaves_less_than_the_demand_needs(policy: AutoscalingPolicy, obs: Observation,
                                                                       state: AutoscalerState) -> None:
    d = decide(policy, obs, state)
    model = next((p for p in d.proposals if p.source == "capacity"), None)
    if model is None or d.desired_replicas >= obs.current_replicas or d.limited_by == "maxReplicas":
        return  # the user's bound wins over the model
    if d.desired_replicas == 0:
        return  # zero.py's step, after a whole idle window read from the counters
    # Demand (tokens/s) over what one replica serves within the targets: the replicas it needs now. A trend or
    # the noise margin may size above it, the stabilization window hold above it; nothing goes below.
    assert d.desired_replicas * model.target >= model.observed * (1 - 1e-9)


@settings(max_examples=200, deadline=None)
@given(policies(), observations(), states())
def test_decision_is_deterministic_and_state_stays_bounded(policy: AutoscalingPolicy, obs: Observation,
                                                           state: AutoscalerState) -> None:
    first, second = decide(policy, obs, state), decide(policy, obs, state)
    assert first == second
    assert len(first.state.startup_durations) <= 10
    horizon = max(policy.behavior.scale_up.stabilization_window_seconds,
                  policy.behavior.scale_down.stabilization_window_seconds)
    assert all(r.time > NOW - horizon or r.time == NOW for r in first.state.recommendations)
    assert (first.desired_replicas != obs.current_replicas) == (first.state.scale_events[-1:] ==
                                                               (ScaleEvent(NOW, first.desired_replicas
                                                                           - obs.current_replicas),))


def demand(obs: Observation) -> bool:
    return obs.held_requests > 0 or (obs.queue_depth or 0) > 0


@settings(max_examples=300, deadline=None)
@given(policies(), observations(), states())
def test_never_to_zero_while_anything_is_held_waiting_running_or_unknown(policy: AutoscalingPolicy, obs: Observation,
                                                                          state: AutoscalerState) -> None:
    d = decide(policy, obs, state)
    if d.desired_replicas == 0:
        assert policy.min_replicas == 0 and not demand(obs)
        if obs.current_replicas > 0:  # the step to zero itself: a whole idle window, with a router to come back
            assert obs.queue_depth == 0 and obs.requests_arrived == 0 and obs.routers_failing == 0
            assert obs.reporting_replicas == obs.ready_replicas > 0 and obs.routers_reporting > 0
            assert state.idle_since is not None and NOW - state.idle_since >= policy.scale_to_zero_after_seconds
    if d.state.idle_since is not None:  # an idle stretch is never carried across demand
        assert not demand(obs) and d.state.idle_since in (NOW, state.idle_since)


@settings(max_examples=300, deadline=None)
@given(policies(), observations(), states(), st.floats(0.5, 500))
def test_a_held_request_always_leaves_zero(policy: AutoscalingPolicy, obs: Observation, state: AutoscalerState,
                                           held: float) -> None:
    at_zero = replace(obs, current_replicas=0, ready_replicas=0, starting_replicas=0, reporting_replicas=0,
                      unschedulable_replicas=0, starting_ages=(), held_requests=held)
    d = decide(policy, at_zero, state)
    assert 1 <= d.desired_replicas <= policy.max_replicas and d.state.scale_events[-1].change == d.desired_replicas
