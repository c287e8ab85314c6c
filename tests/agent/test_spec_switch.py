"""SpecSwitch: speculation on or off per batch-size bucket from measured throughput, with bounded exploration."""

from __future__ import annotations

import itertools
import random

import pytest

from kvfleet_agent.core.spec_switch import (
    EXPLORE_BUDGET,
    EXPLORE_EVERY,
    EXPLORE_EVERY_FAR,
    EXPLORE_RUN,
    MARGIN,
    MIN_SAMPLES,
    PAIR,
    SpecSwitch,
    bucket,
)


def drive(switch: SpecSwitch, batch: int, rate_on: float, rate_off: float, steps: int) -> list[bool]:
    """Steps at one batch size where speculating delivers rate_on tokens/s and not speculating rate_off."""
    chosen = []
    for _ in range(steps):
        on = switch.choose(batch)
        chosen.append(on)
        switch.observe(batch, on, 100, 100 / (rate_on if on else rate_off))
    return chosen


# 700: far behind (under FAR), yet its runs lose less than EXPLORE_BUDGET at EXPLORE_EVERY_FAR (that case is below).
@pytest.mark.parametrize(("rate_on", "every"), [(700.0, EXPLORE_EVERY_FAR), (900.0, EXPLORE_EVERY)])
def test_it_learns_both_modes_then_keeps_the_faster_exploring_rarely(rate_on: float, every: int) -> None:
    switch = SpecSwitch()
    chosen = drive(switch, 64, rate_on=rate_on, rate_off=1000.0, steps=2 * MIN_SAMPLES + 3 * EXPLORE_EVERY_FAR)
    assert chosen[:MIN_SAMPLES] == [True] * MIN_SAMPLES and chosen[MIN_SAMPLES:2 * MIN_SAMPLES] == [False] * MIN_SAMPLES
    tail = chosen[2 * MIN_SAMPLES:]
    runs = [i for i in range(1, len(tail)) if tail[i] and not tail[i - 1]]
    assert sum(tail) == len(runs) * EXPLORE_RUN  # only to explore, in runs
    # A mode far behind (under FAR of the other) is explored every EXPLORE_EVERY_FAR steps, a close one more often.
    assert len(tail) // every <= len(runs) <= len(tail) // every + 1
    assert all(tail[i:i + EXPLORE_RUN] == [True] * EXPLORE_RUN for i in runs)
    # The loss bound: throughput over the tail within EXPLORE_RUN/every of the better mode's loss.
    seconds = sum(100 / (rate_on if on else 1000.0) for on in tail)
    assert len(tail) * 100 / seconds >= 1000.0 * (1 - EXPLORE_RUN / every * (1 - rate_on / 1000.0)) * 0.99


@pytest.mark.parametrize(("rate_on", "kept"), [(1000.0 * (1 + MARGIN / 2), False), (1000.0 * (1 + 2 * MARGIN), True)])
def test_speculation_must_win_by_the_margin(rate_on: float, kept: bool) -> None:
    chosen = drive(SpecSwitch(), 4, rate_on=rate_on, rate_off=1000.0, steps=2 * MIN_SAMPLES + 200)
    tail = chosen[2 * MIN_SAMPLES:]
    assert (sum(tail) > 0.9 * len(tail)) is kept and (sum(tail) < 0.1 * len(tail)) is not kept


def test_rates_wandering_about_the_margin_do_not_flip_the_mode() -> None:
    # Speculation measured now 1.5 margins ahead, now half a margin (as verifications yield 0..k tokens): the runs'
    # evidence takes it up within a few runs, and once taken up it is kept, since it still wins; without hysteresis
    # the mode flipped every few steps.
    switch, chosen = SpecSwitch(), []
    for i in range(2 * MIN_SAMPLES + 40 * 20):
        rate_on = 1000.0 * (1 + (1.5 if i // 20 % 2 else 0.5) * MARGIN)
        chosen += drive(switch, 2, rate_on=rate_on, rate_off=1000.0, steps=1)
    taken = next(i for i in range(2 * MIN_SAMPLES, len(chosen)) if all(chosen[i:i + 2 * EXPLORE_RUN]))
    assert taken < 2 * MIN_SAMPLES + 8 * EXPLORE_EVERY
    tail = chosen[taken:]
    offs = [i for i in range(1, len(tail)) if not tail[i] and tail[i - 1]]
    assert len(offs) <= len(tail) // EXPLORE_EVERY + 1  # off only to explore
    assert sum(tail) >= len(tail) * (1 - EXPLORE_RUN / EXPLORE_EVERY) - EXPLORE_RUN


def test_speculation_is_kept_where_it_pays_and_buckets_are_separate() -> None:
    switch = SpecSwitch()
    small = drive(switch, 1, rate_on=1400.0, rate_off=700.0, steps=200)
    large = drive(switch, 48, rate_on=400.0, rate_off=900.0, steps=200)
    assert sum(small[2 * MIN_SAMPLES:]) > 0.9 * len(small[2 * MIN_SAMPLES:])
    assert sum(large[2 * MIN_SAMPLES:]) < 0.1 * len(large[2 * MIN_SAMPLES:])
    assert (bucket(1), bucket(3), bucket(4), bucket(48), bucket(64)) == (1, 2, 4, 32, 64)


def test_a_change_in_what_pays_is_followed() -> None:
    switch = SpecSwitch()
    drive(switch, 8, rate_on=400.0, rate_off=900.0, steps=300)  # off wins
    after = drive(switch, 8, rate_on=2000.0, rate_off=900.0, steps=400)  # acceptance rose: on wins now
    assert sum(after[-100:]) > 90


def test_a_costly_transition_into_speculation_spaces_the_exploring_runs() -> None:
    """A draft model's catch-up after steps off can take many steps' time: runs into speculation come no more often
    than keeps transitions within EXPLORE_BUDGET of the time."""
    switch = SpecSwitch()
    step_off = 100 / 1000.0
    chosen: list[bool] = []
    for _ in range(2 * MIN_SAMPLES + 4000):
        on = switch.choose(64)
        if on and chosen and not chosen[-1]:
            switch.observe_transition(64, 40 * step_off)  # the catch-up: 40 steps' time
        else:
            switch.observe(64, on, 100, 100 / (500.0 if on else 1000.0))
        chosen.append(on)
    tail = chosen[2 * MIN_SAMPLES:]
    runs = [i for i in range(1, len(tail)) if tail[i] and not tail[i - 1]]
    gap = 40 / EXPLORE_BUDGET
    assert 1 <= len(runs) <= len(tail) / gap + 1 and all(b - a >= gap for a, b in itertools.pairwise(runs))


def test_exploring_runs_far_behind_are_spaced_by_what_their_steps_lose() -> None:
    """No transition to pay (prompt lookup), but speculating delivers a quarter of off's rate here: each exploring
    run loses EXPLORE_RUN steps' worth of that shortfall, so runs come no more often than keeps the loss within
    EXPLORE_BUDGET of the time (more rarely than EXPLORE_EVERY_FAR would)."""
    switch = SpecSwitch()
    step_on, step_off = 0.4, 0.1  # 100 tokens a step either way: 250 tok/s on, 1000 off
    chosen: list[bool] = []
    for _ in range(2 * MIN_SAMPLES + 6000):
        on = switch.choose(16)
        switch.observe(16, on, 100, step_on if on else step_off)
        chosen.append(on)
    tail = chosen[2 * MIN_SAMPLES:]
    runs = [i for i in range(1, len(tail)) if tail[i] and not tail[i - 1]]
    gap = EXPLORE_RUN * step_on * (1 - 250 / 1000) / (EXPLORE_BUDGET * step_off)
    assert gap > EXPLORE_EVERY_FAR
    assert len(runs) >= 2 and all(b - a >= 0.99 * gap for a, b in itertools.pairwise(runs))  # rates are EWMAs


def test_steps_with_prefill_follow_the_nearest_learnt_bucket_and_teach_nothing() -> None:
    """Mixed steps are never measured: learning in their bucket would never end (a draft model would speculate, and
    catch up, in every one). They take the nearest learnt bucket's verdict, the larger on a tie, or stay off."""
    switch = SpecSwitch()
    assert switch.choose(2, measured=False) is False  # nothing learnt yet
    drive(switch, 1, rate_on=1400.0, rate_off=700.0, steps=2 * MIN_SAMPLES + 1)  # speculation pays alone
    drive(switch, 4, rate_on=400.0, rate_off=900.0, steps=2 * MIN_SAMPLES + 1)  # not at 4
    assert [switch.choose(b, measured=False) for b in (1, 2, 3, 4, 8, 64)] == [True, False, False, False, False, False]
    drive(switch, 16, rate_on=1400.0, rate_off=700.0, steps=2 * MIN_SAMPLES + 1)
    # 16 is nearer to 32, and the larger of 4 and 16 around 8.
    assert switch.choose(32, measured=False) is True and switch.choose(8, measured=False) is True
    # Nothing was counted for the mixed steps' buckets: a measured step there still learns speculation first.
    assert switch.choose(2) is True and 2 not in switch.speculating


def noisy(switch: SpecSwitch, batch: int, rate_on: float, rate_off: float, steps: int, seed: int) -> list[bool]:
    """drive() on a shared VM: the machine's speed changes every 20 steps (uniform 0.6-1.4x, the same for both
    modes) and each step jitters by +-10% more."""
    rng, chosen, speed = random.Random(seed), [], 1.0
    for i in range(steps):
        speed = rng.uniform(0.6, 1.4) if i % 20 == 0 else speed
        on = switch.choose(batch)
        chosen.append(on)
        switch.observe(batch, on, 100, 100 / (rate_on if on else rate_off) * speed * rng.uniform(0.9, 1.1))
    return chosen


@pytest.mark.parametrize("rate_on", [800.0, 1600.0])
def test_on_a_wandering_machine_a_losing_mode_costs_little_and_a_winning_one_is_kept(rate_on: float) -> None:
    """Exploring runs land in faster or slower spells than the stable mode's recent steps, so now and then
    speculation at 0.8x of off reads faster and is taken up until its steps show otherwise: over six seeds that
    costs at most 2% of off's throughput (at most a tenth of the steps at 0.8x). A real win is kept."""
    for seed in range(6):
        tail = noisy(SpecSwitch(), 8, rate_on, 1000.0, 2 * MIN_SAMPLES + 3000, seed)[2 * MIN_SAMPLES:]
        share = sum(tail) / len(tail)
        assert share > 0.95 if rate_on > 1000.0 else share < 0.1, (seed, share)


def test_while_speculating_off_is_explored_as_often_as_the_budget_allows() -> None:
    """Speculating at 1.4x of off: off's exploring runs cost no transition, only their steps' shortfall, and they are
    the only check that speculation still pays (one run in a slow spell reads off far behind). They come as often as
    keeps that shortfall within EXPLORE_BUDGET of the time, not EXPLORE_EVERY_FAR apart."""
    switch = SpecSwitch()
    chosen = drive(switch, 8, rate_on=1400.0, rate_off=1000.0, steps=2 * MIN_SAMPLES + 2000)
    tail = chosen[2 * MIN_SAMPLES:]
    starts = [i for i in range(1, len(tail)) if not tail[i] and tail[i - 1]]
    gap = EXPLORE_RUN * (100 / 1000.0) * (1 - 1000.0 / 1400.0) / (EXPLORE_BUDGET * 100 / 1400.0)
    assert gap < EXPLORE_EVERY_FAR
    assert len(starts) >= 10
    assert all(0.99 * gap <= b - a <= gap + EXPLORE_RUN + 1 for a, b in itertools.pairwise(starts))


def test_one_lucky_run_does_not_take_speculation_up() -> None:
    """Speculating delivers 0.95x of off; one exploring run lands in a fast spell and reads 1.3x. Judged alone that run
    took speculation up until off's next run; pooled with the runs before it, it moves the evidence by a fraction of
    its reading and the mode stays off. The runs that follow, at 0.95x again, keep it off."""
    switch, chosen, lucky = SpecSwitch(), [], 0
    for _ in range(2 * MIN_SAMPLES + 2000):
        on = switch.choose(4)
        if on and chosen and not chosen[-1]:
            lucky += 1
        fast = 1.3 / 0.95 if on and lucky == 3 else 1.0  # the third exploring run, all its steps
        switch.observe(4, on, 100, 100 / (950.0 * fast if on else 1000.0))
        chosen.append(on)
    tail = chosen[2 * MIN_SAMPLES:]
    assert lucky >= 5  # the lucky run and runs after it happened
    assert max(len(list(g)) for on, g in itertools.groupby(tail) if on) <= EXPLORE_RUN  # only exploring runs speculate


def test_a_run_far_from_its_neighbours_is_not_judged_against_them() -> None:
    """A bucket seen only in batches' tails meets its own steps seconds apart: a run there, with no stable steps of
    its bucket near it (other buckets' steps between), teaches nothing, however fast it reads."""
    switch = SpecSwitch()
    drive(switch, 1, rate_on=500.0, rate_off=1000.0, steps=2 * MIN_SAMPLES + 10)  # learnt: off
    before = switch.evidence[1]
    assert not switch.speculating[1]
    drive(switch, 4, rate_on=1000.0, rate_off=1000.0, steps=30)  # another bucket's steps in between
    switch.explore_at[1] = switch.decisions[1] + 1  # the next choice in bucket 1 starts an exploring run
    while not switch.choose(1):
        switch.observe(1, False, 100, 0.1)
    for _ in range(EXPLORE_RUN):
        switch.observe(1, True, 100, 0.05)  # 2000 tok/s: a lucky spell
    drive(switch, 4, rate_on=1000.0, rate_off=1000.0, steps=30)  # the bucket goes quiet: no steps after it nearby
    for _ in range(PAIR):
        switch.observe(1, False, 100, 0.1)
    assert switch.evidence[1] == before
