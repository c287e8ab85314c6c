"""The quality measure: ROUGE-L F1 over words, its bounds and cap, and reading answers out of JSON and streams."""

from __future__ import annotations

import json
import random
import time
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfleet_router.agreement import MAX_WORDS, _lcs, agreement, answer_text, words

JSON = "application/json"
SSE = "text/event-stream"


def reference_lcs(a: list[str], b: list[str]) -> int:
    """The textbook table, cell by cell."""
    table = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i, x in enumerate(a):
        for j, y in enumerate(b):
            table[i + 1][j + 1] = table[i][j] + 1 if x == y else max(table[i][j + 1], table[i + 1][j])
    return table[-1][-1]


# --- words and agreement ----------------------------------------------------------------------------------------

def test_words_are_lowercased_word_runs_and_single_punctuation() -> None:
    assert words("Hello, World!  It's 42.") == ["hello", ",", "world", "!", "it", "'", "s", "42", "."]
    assert words("  \n\t") == []


def test_identical_answers_agree_fully_and_disjoint_ones_not_at_all() -> None:
    text = "The capital of France is Paris."
    assert agreement(text, text) == 1.0
    assert agreement(text, text.upper()) == 1.0  # compared as lowercased words
    assert agreement("alpha beta gamma", "one two three four") == 0.0


def test_a_known_rouge_l_value() -> None:
    # LCS of "the cat sat on the mat" (6 words) and "the cat is on the mat today" (7): the cat on the mat, 5.
    # Precision 5/6, recall 5/7: F1 = 2 * (5/6) * (5/7) / (5/6 + 5/7) = 10/13.
    assert agreement("the cat sat on the mat", "the cat is on the mat today") == pytest.approx(10 / 13)
    # Order counts: the same words reversed share only one word in order.
    assert agreement("a b c d", "d c b a") == pytest.approx(2 * 1 / 8)


def test_empty_answers() -> None:
    assert agreement("", "") == 1.0
    assert agreement("  ", "\n") == 1.0  # no words either side
    assert agreement("", "something") == 0.0
    assert agreement("something", "") == 0.0


def test_a_small_edit_costs_only_the_word_it_changes() -> None:
    ref = " ".join(f"w{i}" for i in range(100))
    edited = ref.replace("w50", "changed")
    assert agreement(edited, ref) == pytest.approx(99 / 100)


@given(st.lists(st.sampled_from("abcde"), max_size=40), st.lists(st.sampled_from("abcde"), max_size=40))
def test_the_bit_parallel_lcs_equals_the_textbook_table(a: list[str], b: list[str]) -> None:
    assert _lcs(a, b) == reference_lcs(a, b)


@given(st.text(alphabet="ab c.", max_size=60), st.text(alphabet="ab c.", max_size=60))
def test_agreement_is_a_symmetric_score_in_the_unit_interval(c: str, r: str) -> None:
    score = agreement(c, r)
    assert 0.0 <= score <= 1.0
    assert score == agreement(r, c)
    wc, wr = words(c), words(r)
    if wc and wr:
        assert score == pytest.approx(2 * reference_lcs(wc, wr) / (len(wc) + len(wr)))


def test_the_word_cap_bounds_time_and_judges_the_beginnings() -> None:
    rng = random.Random(7)
    vocab = [f"v{i}" for i in range(300)]
    a = " ".join(rng.choice(vocab) for _ in range(100_000))
    b = " ".join(rng.choice(vocab) for _ in range(100_000))
    start = time.perf_counter()
    score = agreement(a, b)
    elapsed = time.perf_counter() - start
    # Uncapped, the table would hold 10^10 cells; capped it is 2048 × 2048 and takes milliseconds.
    assert elapsed < 1.0
    head_a, head_b = " ".join(a.split()[:MAX_WORDS]), " ".join(b.split()[:MAX_WORDS])
    assert score == agreement(head_a, head_b)
    same_start = head_a + " " + " ".join(["tail"] * 5000)
    assert agreement(same_start, head_a + " different ending") == 1.0  # beyond the cap nothing counts


# --- reading answers --------------------------------------------------------------------------------------------

def completion(text: str, index: int = 0) -> dict[str, Any]:
    return {"id": "cmpl-1", "object": "text_completion", "model": "m",
            "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": "stop"}]}


def sse(*chunks: Any, done: bool = True) -> bytes:
    lines = [f"data: {json.dumps(c)}\n\n" for c in chunks]
    return ("".join(lines) + ("data: [DONE]\n\n" if done else "")).encode()


def chat_chunk(delta: dict[str, Any], index: int = 0, finish: str | None = None) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m",
            "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def text_chunk(text: str, index: int = 0) -> dict[str, Any]:
    return {"id": "cmpl-1", "object": "text_completion", "model": "m",
            "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": None}]}


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def test_a_json_completion() -> None:
    assert answer_text(json.dumps(completion("Paris.")).encode(), JSON) == "Paris."
    assert answer_text(json.dumps(completion("")).encode(), "application/json; charset=utf-8") == ""


def test_json_takes_choice_index_zero() -> None:
    body = {"choices": [completion("second", 1)["choices"][0], completion("first", 0)["choices"][0]]}
    assert answer_text(json.dumps(body).encode(), JSON) == "first"


def test_a_json_chat_answer_with_content_and_tool_calls() -> None:
    plain = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi there"}}]}
    assert answer_text(json.dumps(plain).encode(), JSON) == "Hi there"
    tools = {"choices": [{"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [CALL]},
                          "finish_reason": "tool_calls"}]}
    assert answer_text(json.dumps(tools).encode(), JSON) == 'get_weather({"city": "Paris"})'
    both = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Let me check.",
                                                 "tool_calls": [CALL, {**CALL, "function": {"name": "now",
                                                                                            "arguments": "{}"}}]}}]}
    assert answer_text(json.dumps(both).encode(), JSON) == 'Let me check.\nget_weather({"city": "Paris"})\nnow({})'


def test_a_streamed_completion_concatenates_choice_zero_in_order() -> None:
    usage = {"id": "cmpl-1", "object": "text_completion", "choices": [], "usage": {"prompt_tokens": 3}}
    body = sse(text_chunk("The "), text_chunk("other", 1), text_chunk("capital "), text_chunk("is Paris."), usage)
    assert answer_text(body, SSE) == "The capital is Paris."
    assert answer_text(body, "text/event-stream; charset=utf-8") == "The capital is Paris."


def test_a_streamed_chat_answer_with_content_and_tool_call_deltas() -> None:
    body = sse(chat_chunk({"role": "assistant", "content": "Let me "}), chat_chunk({"content": "check."}),
               chat_chunk({"content": "ignored"}, index=1),
               chat_chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                           "function": {"name": "get_weather", "arguments": ""}}]}),
               chat_chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
               chat_chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
               chat_chunk({"tool_calls": [{"index": 1, "id": "call_2", "type": "function",
                                           "function": {"name": "now", "arguments": "{}"}}]}),
               chat_chunk({}, finish="tool_calls"))
    streamed = answer_text(body, SSE)
    assert streamed == 'Let me check.\nget_weather({"city": "Paris"})\nnow({})'
    # The same answer whole reads the same, so streamed and whole answers score alike.
    whole = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Let me check.",
                                                  "tool_calls": [CALL, {**CALL, "function": {"name": "now",
                                                                                             "arguments": "{}"}}]}}]}
    assert answer_text(json.dumps(whole).encode(), JSON) == streamed


def test_a_streamed_chat_answer_of_plain_content() -> None:
    body = sse(chat_chunk({"role": "assistant"}), chat_chunk({"content": "Hello"}), chat_chunk({"content": "!"}),
               chat_chunk({}, finish="stop"))
    assert answer_text(body, SSE) == "Hello!"


@pytest.mark.parametrize(("body", "content_type"), [
    (json.dumps({"error": {"message": "bad request", "type": "invalid_request_error"}}).encode(), JSON),
    (b"not json at all", JSON),
    (b"\xff\xfe", JSON),
    (json.dumps({"choices": []}).encode(), JSON),
    (json.dumps({"choices": [{"index": 1, "text": "only choice one"}]}).encode(), JSON),
    (json.dumps({"choices": [{"index": 0, "message": "hi"}]}).encode(), JSON),
    (json.dumps([1, 2]).encode(), JSON),
    (json.dumps(completion("x")).encode(), SSE),  # a JSON body is no stream
    (sse(text_chunk("cut "), text_chunk("short"), done=False), SSE),
    (sse(text_chunk("part"), {"error": {"message": "the engine failed mid-stream"}}), SSE),
    (b"data: {not json\n\ndata: [DONE]\n\n", SSE),
    (b"data: [DONE]\n\n", SSE),
    (b"\xff\xfe", SSE),
])
def test_what_is_no_answer_reads_as_none(body: bytes, content_type: str) -> None:
    assert answer_text(body, content_type) is None
