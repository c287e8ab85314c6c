"""SpecSwitch: speculation on or off per batch-size bucket from measured throughput, with bounded exploration."""

from __future__ import annotations

from kvfleet_agent.core.spec_switch import EXPLORE_EVERY, EXPLORE_RUN, MIN_SAMPLES, SpecSwitch, bucket


def drive(switch: SpecSwitch, batch: int, rate_on: float, rate_off: float, steps: int) -> list[bool]:
    """Steps at one batch size where speculating delivers rate_on tokens/s and not speculating rate_off."""
    chosen = []
    for _ in range(steps):
        on = switch.choose(batch)
        chosen.append(on)
        switch.observe(batch, on, 100, 100 / (rate_on if on else rate_off))
    return chosen


def test_it_learns_both_modes_then_keeps_the_faster_exploring_rarely() -> None:
    switch = SpecSwitch()
    chosen = drive(switch, 64, rate_on=500.0, rate_off=1000.0, steps=2 * MIN_SAMPLES + 320)
    assert chosen[:MIN_SAMPLES] == [True] * MIN_SAMPLES and chosen[MIN_SAMPLES:2 * MIN_SAMPLES] == [False] * MIN_SAMPLES
    tail = chosen[2 * MIN_SAMPLES:]
    runs = [i for i in range(1, len(tail)) if tail[i] and not tail[i - 1]]
    assert sum(tail) == len(runs) * EXPLORE_RUN and len(runs) >= len(tail) // EXPLORE_EVERY  # only to explore, in runs
    assert all(tail[i:i + EXPLORE_RUN] == [True] * EXPLORE_RUN for i in runs)
    # The loss bound: throughput over the tail within EXPLORE_RUN/EXPLORE_EVERY of the better mode's.
    seconds = sum(100 / (500.0 if on else 1000.0) for on in tail)
    assert len(tail) * 100 / seconds >= 1000.0 * (1 - EXPLORE_RUN / EXPLORE_EVERY) * 0.97


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
