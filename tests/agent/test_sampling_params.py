"""Tests of SamplingParams validation: each bad field is named, boundaries are accepted and normalised."""

from __future__ import annotations

from typing import Any

import pytest

from kvfleet_agent.sampling_params import MAX_STOP_STRINGS, SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logprobs": True}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"logit_bias": {5: 101}}, "logit_bias"),
        ({"logit_bias": {-1: 1}}, "logit_bias"),
        ({"seed": "x"}, "seed"),
    ],
    ids=lambda v: v if isinstance(v, str) else ",".join(f"{k}={str(x)[:20]}" for k, x in v.items()),
)
def test_sampling_params_rejects_invalid_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert f"SamplingParams.{field}=" in str(info.value)


def test_sampling_params_accepts_boundaries_and_normalises() -> None:
    p = SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0, top_k=-1, logprobs=20, seed=0,
                       stop=[f"s{i}" for i in range(MAX_STOP_STRINGS)])
    assert p.top_k == 0  # -1 is vLLM's spelling of "no top-k"
    assert p.greedy
    assert len(p.stop) == MAX_STOP_STRINGS
    single = SamplingParams(stop="END", logprobs=0, temperature=100.0)  # type: ignore[arg-type]
    assert single.stop == ["END"]
    assert not single.greedy


def test_only_logits_processing_fields_leave_the_fast_path() -> None:
    assert not SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, seed=1).processes_logits
    for kwargs in ({"presence_penalty": 0.5}, {"frequency_penalty": -0.5}, {"repetition_penalty": 1.2},
                   {"logit_bias": {3: 1.0}}, {"min_tokens": 2}):
        assert SamplingParams(**kwargs).processes_logits, kwargs  # type: ignore[arg-type]
