"""OpenAI request parsing, without a server: defaults and field-named errors."""

from __future__ import annotations

import pytest

from kvfleet_agent.server.protocol import APIError, parse


def test_chat_max_tokens_defaults_to_the_rest_of_the_context_completions_to_16() -> None:
    chat, _ = parse({"messages": [{"role": "user", "content": "hi"}]}, "m", chat=True, max_model_len=300)
    assert chat.params.max_tokens == 300
    completion, _ = parse({"prompt": "hi"}, "m", chat=False, max_model_len=300)
    assert completion.params.max_tokens == 16
    explicit, _ = parse({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 7}, "m",
                        chat=True, max_model_len=300)
    assert explicit.params.max_tokens == 7


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x", "seed": 2**64}, "seed"),
    ({"prompt": "x", "seed": -(2**63) - 1}, "seed"),
    ({"prompt": "x", "top_k": True}, "top_k"),
    ({"prompt": ["a", ""]}, "prompt"),
])
def test_out_of_range_values_are_refused_with_the_field_named(body: dict[str, object], param: str) -> None:
    with pytest.raises(APIError) as info:
        parse(body, "m", chat=False, max_model_len=100)
    assert info.value.param == param and info.value.status == 400


def test_a_huge_top_k_is_accepted_and_means_no_cut() -> None:
    req, _ = parse({"prompt": "x", "top_k": 2**63}, "m", chat=False, max_model_len=100)
    assert req.params.top_k == 2**63  # the sampler clamps it to the vocabulary
