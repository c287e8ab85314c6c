"""bench spec's summary: each configuration against `off` as the median of per-round paired ratios."""

from __future__ import annotations

import pytest

from kvfleet_agent.bench.spec import summarize, table


def test_the_ratio_to_off_pairs_rounds_so_drift_between_rounds_cancels() -> None:
    # The machine ran round 2 at 1.5x round 1's speed and round 3 twice as fast: a ratio of medians reads 0.75x,
    # while the configuration was 0.95x of `off` in two rounds of three.
    samples = {("edit", 4, "off"): [(100.0, [0.01], 0, 0), (300.0, [0.01], 0, 0), (200.0, [0.01], 0, 0)],
               ("edit", 4, "ngram"): [(95.0, [0.02], 10, 20), (150.0, [0.02], 10, 0), (190.0, [0.02], 10, 10)]}
    cells = {c.config: c for c in summarize(samples)}
    assert cells["ngram"].decode_tps == 150.0 and cells["ngram"].vs_off == pytest.approx(0.95)
    assert cells["off"].vs_off == 1.0 and cells["off"].mean_accepted_length is None
    assert cells["ngram"].mean_accepted_length == pytest.approx(1 + 30 / 30)
    assert "0.95x" in table(list(cells.values()))


def test_without_off_there_is_no_ratio() -> None:
    cells = summarize({("code", 1, "draft"): [(50.0, [0.02], 4, 2)]})
    assert cells[0].vs_off is None and "nan" in table(cells)
