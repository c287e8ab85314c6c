"""OpenAI request parsing, without a server: defaults and field-named errors."""

from __future__ import annotations

import pytest

from kvfleet_agent.outputs import CompletionOutput, RequestOutput
from kvfleet_agent.server.protocol import APIError, choice, parse


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


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
])
def test_errors_name_the_field_the_client_sent(body: dict[str, object], param: str) -> None:
    with pytest.raises(APIError) as info:
        parse(body, "m", chat=True, max_model_len=100)
    assert info.value.param == param and f"'{param}'" in info.value.message


def test_the_field_that_set_max_tokens_is_remembered_for_context_errors() -> None:
    chat = [{"role": "user", "content": "x"}]
    assert parse({"messages": chat}, "m", chat=True, max_model_len=100)[0].max_tokens_field is None
    assert parse({"messages": chat, "max_tokens": 5}, "m", chat=True, max_model_len=100)[0].max_tokens_field == \
        "max_tokens"
    assert parse({"messages": chat, "max_completion_tokens": 5, "max_tokens": 9}, "m", chat=True,
                 max_model_len=100)[0].max_tokens_field == "max_completion_tokens"


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "a\ud800b"}, "prompt"),
    ({"prompt": ["fine", "\udfff"]}, "prompt"),
    ({"prompt": "x", "stop": ["\ud800"]}, "stop"),
])
def test_lone_surrogates_are_refused_by_field(body: dict[str, object], param: str) -> None:
    with pytest.raises(APIError) as info:
        parse(body, "m", chat=False, max_model_len=100)
    assert info.value.param == param and "surrogate" in info.value.message


def test_a_surrogate_in_a_chat_message_names_the_message() -> None:
    with pytest.raises(APIError) as info:
        parse({"messages": [{"role": "user", "content": "ok"}, {"role": "user", "content": "\ud800"}]}, "m",
              chat=True, max_model_len=100)
    assert info.value.param == "messages[1].content"


def test_sizes_are_refused_before_contents_are_read() -> None:
    ids = [1] * 10**6 + ["not an id"]  # refused for its length without looking at each element
    with pytest.raises(APIError, match="1000001 tokens"):
        parse({"prompt": ids}, "m", chat=False, max_model_len=100)
    with pytest.raises(APIError, match="at most 8"):
        parse({"prompt": ["x"] * 9}, "m", chat=False, max_model_len=100, max_prompts=8)
    with pytest.raises(APIError, match="at most 99"):
        parse({"messages": [{"role": "user", "content": "x"}] * 100}, "m", chat=True, max_model_len=100)
    with pytest.raises(APIError) as info:
        parse({"prompt": "x", "stop_token_ids": list(range(5000))}, "m", chat=False, max_model_len=100)
    assert info.value.param == "stop_token_ids"


def test_a_huge_model_name_is_not_echoed_whole() -> None:
    with pytest.raises(APIError) as info:
        parse({"prompt": "x", "model": "m" * 10**6}, "served", chat=False, max_model_len=100)
    assert info.value.status == 404 and len(info.value.message) < 200


def test_an_aborted_request_says_so() -> None:
    out = RequestOutput("r", None, [1], [CompletionOutput(0, "cut", [5], "abort")], finished=True)
    assert choice(0, out, chat=False, decode=str)["finish_reason"] == "abort"
    assert choice(0, out, chat=True, decode=str, text="", delta=True)["finish_reason"] == "abort"
