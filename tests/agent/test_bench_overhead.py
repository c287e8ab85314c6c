"""The step-overhead bench: every decode step timed whole and in parts, against the forward alone."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from kvfleet_agent.bench import overhead


def test_each_decode_step_is_split_into_phases_that_sum_to_it(tiny_checkpoint: Callable[..., str], tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "overhead.json"
    assert overhead.main(["--model", tiny_checkpoint("llama"), "--batch", "1", "3", "--prompt-len", "20",
                          "--new-tokens", "12", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["batch"] for r in report["rows"]] == [1, 3]
    for row in report["rows"]:
        assert row["steps"] == 11  # the first token comes from the prefill step, which is not timed
        for phase in ("model", "logits", "sample", "inputs", "plan", "schedule"):
            assert row[f"{phase}_ms"] > 0, phase  # every timer saw its part of every step
        assert row["forward_ms"] > 0 and row["overhead"] == pytest.approx(row["step_ms"] / row["forward_ms"] - 1)
    printed = capsys.readouterr().out
    assert "overhead" in printed and len(printed.strip().splitlines()) == 3


def test_nested_timers_split_by_difference() -> None:
    timers = overhead.Timers()
    timers.current.update(schedule=0.001, executor=0.010, runner=0.009, model=0.006, sample=0.001)
    timers.close(0.013)
    step = timers.steps[0]
    assert step["plan"] == pytest.approx(0.001) and step["glue"] == pytest.approx(0.002)
    assert step["update"] == pytest.approx(0.002) and step["total"] == 0.013 and not timers.current
    assert sum(step[ph] for ph in overhead.PHASES) == pytest.approx(step["total"])
