"""Tests of the load generator's requests and arrivals: Poisson schedule, lengths, synthetic and file prompts."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest

from kvfleet_agent.bench.workload import (
    WORDS,
    LengthDist,
    RequestSpec,
    arrival_schedule,
    file_requests,
    load_prompt_file,
    poisson_arrivals,
    synthetic_requests,
)


def test_poisson_schedule_has_the_mean_rate_and_is_deterministic() -> None:
    rate, n = 8.0, 20000
    times = arrival_schedule(n, rate, seed=7)
    assert times == arrival_schedule(n, rate, seed=7)
    assert times != arrival_schedule(n, rate, seed=8)
    gaps = np.diff([0.0, *times])
    assert (gaps > 0).all()
    assert n / times[-1] == pytest.approx(rate, rel=0.03)
    # Exponential gaps: the standard deviation equals the mean.
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)
    # The lazy generator and the list agree, across its internal blocks of draws.
    assert list(itertools.islice(poisson_arrivals(rate, 7), 3000)) == times[:3000]


def test_infinite_rate_sends_everything_at_zero_and_bad_rates_are_refused() -> None:
    assert arrival_schedule(5, math.inf, seed=0) == [0.0] * 5
    with pytest.raises(ValueError):
        arrival_schedule(1, 0.0, seed=0)


def test_length_distribution_mean_and_bounds() -> None:
    rng = np.random.default_rng(0)
    for mean, lo, hi in ((50, 10, 90), (20, 10, 90), (85, 10, 90)):
        d = LengthDist(mean, lo, hi)
        xs = [d.sample(rng) for _ in range(20000)]
        assert min(xs) >= lo and max(xs) <= hi
        assert np.mean(xs) == pytest.approx(mean, rel=0.02)
    assert {LengthDist(7, 7, 7).sample(rng) for _ in range(10)} == {7}
    assert LengthDist.build(None, [4, 8], 128) == LengthDist(6, 4, 8)
    assert LengthDist.build(None, None, 128) == LengthDist(128, 128, 128)
    with pytest.raises(ValueError):
        LengthDist(3, 4, 8)


def test_synthetic_prompts_are_deterministic_words_of_the_drawn_length() -> None:
    def first(seed: int) -> list[RequestSpec]:
        return list(itertools.islice(synthetic_requests(seed, LengthDist(20, 5, 35), LengthDist(16, 8, 24)), 50))

    a = first(3)
    assert a == first(3)
    assert a != first(4)
    assert [r.index for r in a] == list(range(50))
    for r in a:
        words = r.prompt.split(" ")
        assert len(words) == r.prompt_words and 5 <= len(words) <= 35
        assert set(words) <= set(WORDS)
        assert 8 <= r.max_tokens <= 24
    assert len(set(WORDS)) == len(WORDS) > 200


def test_prompt_file_is_cycled_and_validated(tmp_path: Path) -> None:
    good = tmp_path / "p.jsonl"
    good.write_text('{"prompt": "a b", "max_tokens": 3}\n\n{"prompt": "c"}\n', encoding="utf-8")
    entries = load_prompt_file(str(good))
    assert entries == [("a b", 3), ("c", None)]
    specs = list(itertools.islice(file_requests(entries, 0, LengthDist(9, 9, 9)), 5))
    assert [(s.prompt, s.max_tokens) for s in specs] == [("a b", 3), ("c", 9), ("a b", 3), ("c", 9), ("a b", 3)]
    for text in ('{"prompt": 1}\n', 'not json\n', '{"prompt": "x", "max_tokens": 0}\n', "\n"):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(text, encoding="utf-8")
        with pytest.raises(ValueError):
            load_prompt_file(str(bad))
