"""Grammar masks in the engine: constrained and free rows in one batch, every constrained output valid, free
rows exactly what they would be alone."""

from __future__ import annotations

import json
from collections.abc import Callable

import jsonschema
import pytest

from kvfleet_agent import LLM, SamplingParams
from kvfleet_agent.structured_outputs import StructuredOutputs

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "items", "meta"], "properties": {
    "id": {"type": "integer", "minimum": -5, "maximum": 99},
    "items": {"type": "array", "maxItems": 3, "items": {"type": "object", "required": ["k"], "properties": {
        "k": {"enum": ["a", "b"]}, "v": {"type": "boolean"}}, "additionalProperties": False}},
    "meta": {"anyOf": [{"type": "null"}, {"type": "string", "pattern": "^[a-z]{2,4}$"}]}}}


@pytest.fixture(scope="module")
def offline(tiny_checkpoint: Callable[..., str]) -> LLM:
    return LLM(model=tiny_checkpoint("llama"), block_size=16)


def test_mixed_batch_constrained_rows_validate_free_rows_unchanged(offline: LLM) -> None:
    spec = StructuredOutputs(json=SCHEMA)
    free = [SamplingParams(max_tokens=20, seed=100 + i, ignore_eos=True) for i in range(4)]
    constrained = [SamplingParams(max_tokens=300, seed=s, structured_outputs=spec) for s in range(24)]
    alone = [o.outputs[0].token_ids for o in offline.generate(["x"] * 4, free)]
    outs = offline.generate(["x"] * 28, [*free, *constrained])
    assert [o.outputs[0].token_ids for o in outs[:4]] == alone  # seeded free rows: untouched by their neighbours
    for o in outs[4:]:
        assert o.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)


def test_choice_regex_and_a_bad_constraint(offline: LLM) -> None:
    outs = offline.generate(["x"] * 6, [SamplingParams(max_tokens=50, seed=s, structured_outputs=StructuredOutputs(
        choice=["red", "green", "blue"])) for s in range(6)])
    assert {o.outputs[0].text for o in outs} <= {"red", "green", "blue"}
    with pytest.raises(ValueError, match=r"lookahead|look-around|unsupported|support"):
        offline.generate("x", SamplingParams(structured_outputs=StructuredOutputs(regex="(?=a)b")))
