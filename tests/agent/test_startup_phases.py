"""StartupPhases: phases timed (in parts too), skipped with a reason rather than a zero, logged, and summarised."""

from __future__ import annotations

import logging
import time

import pytest

from kvfleet_agent.worker.startup_phases import StartupPhases, process_age_s

IMPORTED = time.monotonic()


class Ticks:
    """A clock that advances only when told: the durations are then exact, with no sleeping."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_phase_is_timed_and_logged_once_when_its_last_part_ends(caplog: pytest.LogCaptureFixture) -> None:
    clock = Ticks()
    phases = StartupPhases(clock=clock)
    caplog.set_level(logging.INFO, logger="kvfleet_agent.worker.startup_phases")
    with phases.phase("weights_read"):
        clock.now += 1.5
    with phases.phase("kv_profile", last=False):  # sizing the pool
        clock.now += 0.25
    assert [r.getMessage() for r in caplog.records] == ["start-up phase weights_read: 1.500 s"]
    with phases.phase("kv_profile"):  # allocating it
        clock.now += 0.5
    assert phases.seconds == {"weights_read": 1.5, "kv_profile": 0.75}
    assert caplog.records[-1].getMessage() == "start-up phase kv_profile: 0.750 s"


def test_a_failed_phase_records_nothing() -> None:
    clock = Ticks()
    phases = StartupPhases(clock=clock)
    with pytest.raises(RuntimeError), phases.phase("warmup"):
        clock.now += 2.0
        raise RuntimeError("out of memory")
    assert phases.seconds == {}


def test_a_skipped_phase_has_a_reason_and_no_seconds(caplog: pytest.LogCaptureFixture) -> None:
    phases = StartupPhases(label="rank 1")
    caplog.set_level(logging.INFO, logger="kvfleet_agent.worker.startup_phases")
    phases.skip("graph_capture", "decode runs eagerly on cpu")
    assert "graph_capture" not in phases.seconds and phases.skipped == {"graph_capture": "decode runs eagerly on cpu"}
    assert caplog.records[-1].getMessage() == ("rank 1: start-up phase graph_capture: skipped "
                                               "(decode runs eagerly on cpu)")


def test_the_summary_names_every_phase_and_the_time_no_phase_covers() -> None:
    phases = StartupPhases()
    phases.record("weights_read", 1.0)
    phases.record("warmup", 0.5)
    phases.skip("graph_capture", "--enforce-eager")
    phases.record("first_ready", 4.0)
    assert phases.summary("first_ready") == ("start-up: first_ready after 4.000 s (weights_read 1.000 s, "
                                             "warmup 0.500 s, graph_capture skipped (--enforce-eager), "
                                             "other 2.500 s)")


def test_a_negative_measurement_counts_as_zero() -> None:
    phases = StartupPhases()
    phases.record("weights_to_device", -1e-9)  # a difference of two clocks can dip below zero by rounding
    assert phases.seconds["weights_to_device"] == 0.0


def test_the_process_age_counts_from_the_process_start_and_grows() -> None:
    first = process_age_s()
    assert process_age_s() >= first > 0.0
    # The process began before this module was imported, so it is at least as old as the module (less the
    # 10 ms resolution of /proc's clock ticks).
    assert first >= time.monotonic() - IMPORTED - 0.02
