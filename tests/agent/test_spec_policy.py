"""Speculation policy (kvfleet_agent.core.spec_policy): step-time fit, acceptance estimates and the draft plan."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Mapping, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfleet_agent.core.spec_policy import SpecPolicy, StepTimeModel


def feed_line(policy: SpecPolicy, a: float, b: float, steps: int = 300, seed: int = 0) -> None:
    """Exact timings a + b*x over a wide spread of step sizes."""
    rng = random.Random(seed)
    for _ in range(steps):
        x = rng.randint(1, 600)
        policy.observe_step(x, a + b * x)


def feed_geometric(policy: SpecPolicy, rid: str, alpha: float, rng: random.Random, times: int, k: int = 4) -> None:
    """Verifications where each draft is accepted with probability alpha given the previous ones were."""
    for _ in range(times):
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        policy.observe(rid, k, accepted)


def throughput(plan: Mapping[str, int], alphas: Mapping[str, float], other: int, a: float, b: float) -> float:
    """Expected tokens per second of a step under the cost model: (1 - α^(j+1)) / (1 - α) tokens per request."""
    tokens = float(other)
    work = float(other)
    for rid, j in plan.items():
        al = alphas[rid]
        tokens += j + 1 if al == 1.0 else (1 - al ** (j + 1)) / (1 - al)
        work += j + 1
    return tokens / (a + b * work)


# ---------------------------------------------------------------------------------------------
# the plan against no speculation and fixed k, in both regimes


@pytest.mark.parametrize(("name", "a", "b", "batch", "alpha"), [
    ("memory-bound", 20e-3, 1e-6, 4, 0.9),  # b negligible: verification almost free
    ("compute-bound", 0.0, 1e-4, 256, 0.7),  # a = 0, b = t per token, large batch: the regression case
    ("in-between", 10e-3, 5e-5, 64, 0.7),  # partial drafts beat both extremes
])
def test_plan_beats_no_speculation_and_fixed_k(name: str, a: float, b: float, batch: int, alpha: float) -> None:
    k = 4
    policy = SpecPolicy(request_half_life=1e5, global_half_life=1e5)
    feed_line(policy, a, b)
    rng = random.Random(1)
    rids = [f"r{i}" for i in range(batch)]
    for rid in rids:
        feed_geometric(policy, rid, alpha, rng, times=100, k=k)
    assert abs(policy.global_acceptance() - alpha) < 0.02
    candidates = [(rid, k) for rid in rids]
    plan = policy.plan(candidates, 0)
    alphas = dict.fromkeys(rids, alpha)
    t_plan = throughput(plan, alphas, 0, a, b)
    t_none = throughput(dict.fromkeys(rids, 0), alphas, 0, a, b)
    t_fixed = throughput(dict.fromkeys(rids, k), alphas, 0, a, b)
    assert t_plan >= t_none
    assert t_plan >= t_fixed
    drafts = sum(plan.values())
    if name == "memory-bound":
        assert drafts == k * batch
    elif name == "compute-bound":
        assert drafts == 0
        assert t_none >= 1.4 * t_fixed  # what fixed k would have cost
    else:
        assert 0 < drafts < k * batch
        assert t_plan > max(t_none, t_fixed) * 1.01


@settings(max_examples=200, deadline=None)
@given(a=st.floats(0.0, 0.05), b=st.floats(1e-6, 1e-3), other=st.integers(0, 40),
       cands=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=3))
def test_plan_is_the_best_allocation_under_its_own_estimates(
        a: float, b: float, other: int, cands: list[tuple[int, int, int]]) -> None:
    policy = SpecPolicy(min_gain=0.0)
    feed_line(policy, a, b)
    candidates = []
    for i, (most, hits, misses) in enumerate(cands):
        rid = f"r{i}"
        for _ in range(hits):
            policy.observe_shadow(rid, True)
        for _ in range(misses):
            policy.observe_shadow(rid, False)
        candidates.append((rid, most))
    a_fit, b_fit = policy.step_time.coefficients()
    alphas = {rid: policy.acceptance(rid) for rid, _ in candidates}
    plan = policy.plan(candidates, other)
    assert all(0 <= plan[rid] <= most for rid, most in candidates)
    best = max(throughput(dict(zip(alphas, js, strict=True)), alphas, other, a_fit, b_fit)
               for js in itertools.product(*(range(most + 1) for _, most in candidates)))
    got = throughput(plan, alphas, other, a_fit, b_fit)
    assert got >= best * (1 - 1e-9)


def test_other_tokens_in_the_step_raise_the_bar() -> None:
    policy = SpecPolicy()
    feed_line(policy, 10e-3, 5e-5)
    for _ in range(20):
        policy.observe("r", 4, 2)
    alone = policy.plan([("r", 4)], 0)["r"]
    behind_prefill = policy.plan([("r", 4)], 2000)["r"]
    assert alone > behind_prefill == 0


# ---------------------------------------------------------------------------------------------
# turning off and back on


def drive(policy: SpecPolicy, rids: Sequence[str], hit: bool, want_on: bool, limit: int) -> int:
    """Rounds of steps until every request is (want_on) speculating or none is; each round is measured."""
    for rounds in range(limit + 1):
        plan = policy.plan([(rid, 4) for rid in rids], 0)
        if all(j > 0 for j in plan.values()) if want_on else not any(plan.values()):
            return rounds
        for rid, j in plan.items():
            if j:
                policy.observe(rid, j, j if hit else 0)
            else:
                policy.observe_shadow(rid, hit)
    raise AssertionError(f"still {'off' if want_on else 'on'} after {limit} rounds")


def test_zero_acceptance_turns_speculation_off_and_shadow_hits_turn_it_back_on() -> None:
    policy = SpecPolicy()
    a, b = 10e-3, 1e-4
    feed_line(policy, a, b)
    rids = [f"r{i}" for i in range(32)]
    for rid in rids:
        for _ in range(10):
            policy.observe(rid, 4, 4)  # a run of full acceptance: the slowest case to turn off
    assert all(j == 4 for j in policy.plan([(rid, 4) for rid in rids], 0).values())
    # The bar at this batch is N*b / (a + b*M) with N = M = 32; the documented bound is H * log2(1/bar).
    bar = 32 * b / (a + b * 32)
    off = drive(policy, rids, hit=False, want_on=False, limit=100)
    assert 1 <= off <= math.ceil(10 * math.log2(1 / bar)) + 4
    for _ in range(30):  # off, and staying off while the shadow checks keep missing
        assert not any(policy.plan([(rid, 4) for rid in rids], 0).values())
        for rid in rids:
            policy.observe_shadow(rid, False)
    on = drive(policy, rids, hit=True, want_on=True, limit=100)
    assert 1 <= on <= 10


def test_zero_acceptance_turns_off_even_under_the_free_verification_prior() -> None:
    policy = SpecPolicy()  # no steps observed: b = 0, only min_gain stands in the way
    assert policy.plan([("r", 4)], 0) == {"r": 4}
    off = drive(policy, ["r"], hit=False, want_on=False, limit=200)
    assert off <= 60
    assert policy.acceptance("r") < 0.05


def test_new_requests_start_from_the_global_estimate_and_forget_drops_them() -> None:
    policy = SpecPolicy()
    assert policy.acceptance("new") == pytest.approx(0.6)
    for _ in range(50):
        policy.observe("old", 4, 1)  # α̂ = 1 / 2
    assert policy.acceptance("new") == pytest.approx(policy.kind_acceptance(0))
    assert 0.45 < policy.global_acceptance() < 0.55 and 0.45 < policy.kind_acceptance(0) < 0.55
    assert policy.summary()["requests_tracked"] == 1.0
    policy.forget("old")
    assert policy.summary()["requests_tracked"] == 0.0
    assert policy.acceptance("old") == policy.kind_acceptance(0)
    with pytest.raises(ValueError):
        policy.observe("x", 2, 3)


def test_each_kind_of_proposal_learns_its_own_acceptance_and_drafts_by_it() -> None:
    """An n-gram proposal's kind is its match length: long matches accepted almost always, short ones rarely. One
    estimate per request drafted both alike; per kind, the same request drafts deep on a long match and not at all on
    a short one, in the same step."""
    policy = SpecPolicy(min_gain=0.3)
    for _ in range(60):
        policy.observe("r", 4, 4, kind=4)  # every draft accepted
        policy.observe("r", 4, 0, kind=1)  # the first rejected
    assert policy.acceptance("r", 4) > 0.9 > 0.1 > policy.acceptance("r", 1)
    assert policy.kind_acceptance(4) > 0.9 > 0.1 > policy.kind_acceptance(1)
    assert 0.3 < policy.global_acceptance() < 0.9  # what one estimate per request would have drafted both by
    # A new request starts from each kind's estimate, not the global one.
    assert policy.acceptance("new", 4) > 0.9 > 0.1 > policy.acceptance("new", 1)
    plan = policy.plan([("long", 4), ("short", 4)], 0, kinds={"long": 4, "short": 1})
    assert plan == {"long": 4, "short": 0}
    alike = policy.plan([("long", 4), ("short", 4)], 0)  # without kinds: the global estimate for both
    assert alike["long"] == alike["short"] > 0


# ---------------------------------------------------------------------------------------------
# fixed mode and disable_by_batch_size


def test_fixed_mode_gives_every_candidate_its_max_even_when_it_hurts() -> None:
    policy = SpecPolicy(adaptive=False)
    feed_line(policy, 0.0, 1e-4)
    for _ in range(30):
        policy.observe("a", 4, 0)
    assert policy.plan([("a", 4), ("b", 2), ("c", 0)], 100) == {"a": 4, "b": 2, "c": 0}


@pytest.mark.parametrize("adaptive", [True, False])
def test_disable_by_batch_size(adaptive: bool) -> None:
    policy = SpecPolicy(adaptive=adaptive, disable_by_batch_size=4)
    three = [(f"r{i}", 3) for i in range(3)]
    assert policy.plan(three, 0) == dict.fromkeys(["r0", "r1", "r2"], 3)
    assert not any(policy.plan([*three, ("r3", 3)], 0).values())
    assert policy.plan(three, 0, num_decodes=4) == dict.fromkeys(["r0", "r1", "r2"], 0)


# ---------------------------------------------------------------------------------------------
# the step-time fit


@settings(max_examples=50, deadline=None)
@given(a=st.floats(1e-3, 2e-2), b=st.floats(2e-5, 2e-4), seed=st.integers(0, 2**32 - 1))
def test_fit_recovers_a_and_b_from_noisy_timings(a: float, b: float, seed: int) -> None:
    rng = random.Random(seed)
    model = StepTimeModel()
    for _ in range(600):
        x = rng.randint(1, 2048)
        model.observe(x, (a + b * x) * (1 + 0.01 * rng.gauss(0.0, 1.0)))
    a_fit, b_fit = model.coefficients()
    assert model.fitted
    assert abs(b_fit - b) <= 0.1 * b
    assert abs(a_fit - a) <= 0.01 * (a + 1024 * b)


def test_fit_guards() -> None:
    assert StepTimeModel().coefficients() == (0.0, 0.0)
    flat = StepTimeModel()
    for _ in range(100):
        flat.observe(32, 0.01)  # no spread in step size: the b = 0 prior, a = the mean time
    assert not flat.fitted
    assert flat.coefficients() == pytest.approx((0.01, 0.0))
    falling = StepTimeModel()
    for x in range(1, 101):
        falling.observe(x, 0.02 - 1e-4 * x)  # a negative slope is noise: b clamps to 0
    assert falling.coefficients()[1] == 0.0
    assert falling.coefficients()[0] == pytest.approx(0.02 - 1e-4 * 50.5, rel=0.05)
    origin = StepTimeModel()
    for x in range(1, 101):
        origin.observe(x, max(1e-6, 1e-4 * x - 1e-3))  # a would be negative: refit through the origin
    a_fit, b_fit = origin.coefficients()
    assert a_fit == 0.0
    assert 0.8e-4 < b_fit < 1e-4
    ignored = StepTimeModel()
    ignored.observe(0, 1.0)
    ignored.observe(5, math.nan)
    ignored.observe(5, -1.0)
    assert ignored.steps == 0


def test_summary_is_plain_numbers() -> None:
    policy = SpecPolicy()
    feed_line(policy, 5e-3, 2e-5, steps=50)
    policy.observe("r", 4, 4)
    s = policy.summary()
    assert s["a"] == pytest.approx(5e-3)
    assert s["b"] == pytest.approx(2e-5)
    assert s["steps_observed"] == 50.0
    assert s["global_acceptance"] == pytest.approx((4 + 2 * 0.6) / (4 + 2), rel=1e-2)
    assert all(type(v) is float for v in s.values())
