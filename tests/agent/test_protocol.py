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


def test_unknown_fields_are_refused_by_name_and_no_op_values_of_unimplemented_ones_accepted() -> None:
    with pytest.raises(APIError) as info:
        parse({"prompt": "x", "top_kk": 3}, "m", chat=False, max_model_len=100)
    assert info.value.param == "top_kk" and "spelling" in info.value.message
    with pytest.raises(APIError) as info:
        parse({"prompt": "x", "stream_options": {"include_usage": True, "extra": 1}}, "m", chat=False,
              max_model_len=100)
    assert info.value.param == "stream_options.extra"
    chat = [{"role": "user", "content": "x"}]
    req, _ = parse({"messages": chat, "response_format": {"type": "text"}, "tool_choice": "none", "tools": [],
                    "parallel_tool_calls": False, "store": False, "user": "me"}, "m", chat=True, max_model_len=100)
    assert req.params.max_tokens == 100
    for field, value in (("guided_decoding_backend", "xgrammar"), ("tool_choice", "auto"),
                         ("functions", [{"name": "f"}]), ("use_beam_search", True), ("truncate_prompt_tokens", 1)):
        with pytest.raises(APIError) as info:
            parse({"messages": chat, field: value}, "m", chat=True, max_model_len=100)
        assert info.value.param == field and f"'{field}'" in info.value.message


def test_sampling_fields_reach_sampling_params() -> None:
    req, _ = parse({"prompt": "x", "presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.3,
                    "min_p": 0.1, "logit_bias": {"7": -100, "9": 2.5}, "min_tokens": 3, "stop_token_ids": [4]},
                   "m", chat=False, max_model_len=100, vocab_size=10)
    p = req.params
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p, p.min_tokens) == \
        (0.5, -1, 1.3, 0.1, 3)
    assert p.logit_bias == {7: -100.0, 9: 2.5} and p.stop_token_ids == [4] and p.processes_logits
    with pytest.raises(APIError, match="below 10"):
        parse({"prompt": "x", "logit_bias": {"10": 1}}, "m", chat=False, max_model_len=100, vocab_size=10)


def test_n_and_best_of_give_each_sample_its_seed() -> None:
    req, _ = parse({"prompt": "x", "n": 2, "best_of": 3, "seed": 2**64 - 1}, "m", chat=False, max_model_len=100)
    assert (req.n, req.best_of) == (2, 3)
    assert [req.sample_params(i).seed for i in range(3)] == [2**64 - 1, 0, 1]  # seed + i, wrapped into range
    assert req.params.logprobs == 0 and not req.logprobs_asked  # computed to rank the samples, not returned
    unseeded, _ = parse({"prompt": "x", "n": 2}, "m", chat=False, max_model_len=100)
    assert unseeded.sample_params(1).seed is None


def test_echo_scores_the_prompt_with_max_tokens_zero() -> None:
    req, _ = parse({"prompt": "x", "echo": True, "max_tokens": 0, "logprobs": 1}, "m", chat=False, max_model_len=100)
    assert req.echo and req.prompt_only and req.params.max_tokens == 1 and req.params.prompt_logprobs == 1
    with pytest.raises(APIError) as info:
        parse({"prompt": "x", "logprobs": 6}, "m", chat=False, max_model_len=100, max_logprobs=5)
    assert info.value.param == "logprobs" and "--max-logprobs" in info.value.message
