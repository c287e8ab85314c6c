"""Request features → class: every body shape, every limit, first match wins, the reasons, the labelling body."""

from __future__ import annotations

from typing import Any

import pytest

from kvfleet_router.classifier import Classification, Features, classify, features, label_request, parse_label
from kvfleet_router.tier_config import DEFAULT_MARKERS, UNMATCHED, Classifier, RequestClass, default_classes

MARKERS = ("```", "def ", "step by step")


def f(prompt_tokens: int = 10, max_tokens: int | None = None, turns: int = 1,
      markers: tuple[str, ...] = ()) -> Features:
    return Features(prompt_tokens, max_tokens, turns, markers)


# --- features ---------------------------------------------------------------------------------------------------

def test_a_string_prompt_is_estimated_at_four_characters_a_token_rounded_up() -> None:
    assert features({"prompt": "abcd"}, MARKERS).prompt_tokens == 1
    assert features({"prompt": "abcde"}, MARKERS).prompt_tokens == 2
    assert features({"prompt": "x" * 400}, MARKERS).prompt_tokens == 100
    assert features({"prompt": ""}, MARKERS) == Features(0, None, 1, ())


def test_a_list_of_strings_counts_every_prompt_and_finds_markers_in_any() -> None:
    got = features({"prompt": ["abc", "Think STEP BY STEP", "z"]}, MARKERS)
    assert got.prompt_tokens == 6  # 3 + 18 + 1 = 22 characters
    assert got.markers == ("step by step",)
    assert got.turns == 1


def test_token_id_prompts_count_their_ids_and_carry_no_markers() -> None:
    assert features({"prompt": [1, 2, 3, 4, 5]}, MARKERS) == Features(5, None, 1, ())
    assert features({"prompt": [[1, 2, 3], [4, 5]]}, MARKERS).prompt_tokens == 5


def test_chat_counts_every_message_text_and_user_turns() -> None:
    body = {"messages": [{"role": "system", "content": "Be brief."},  # 9
                         {"role": "user", "content": "def f(): pass"},  # 13
                         {"role": "assistant", "content": "ok"},  # 2
                         {"role": "user", "content": [{"type": "text", "text": "again"},  # 5
                                                      {"type": "image_url", "image_url": {"url": "x" * 1000}}]}]}
    got = features(body, MARKERS)
    assert got.prompt_tokens == 8  # ceil(29 / 4): the image part carries no text
    assert got.turns == 2
    assert got.markers == ("def ",)


def test_a_chat_without_user_messages_is_still_one_turn() -> None:
    assert features({"messages": [{"role": "system", "content": "hi"}]}, MARKERS).turns == 1
    assert features({"messages": []}, MARKERS) == Features(0, None, 1, ())


def test_markers_come_in_the_configured_order_and_match_case_insensitively() -> None:
    text = "Step By Step:\n```python\nDEF main(): ...```"
    assert features({"prompt": text}, MARKERS).markers == MARKERS
    assert features({"prompt": text}, tuple(reversed(MARKERS))).markers == tuple(reversed(MARKERS))
    assert features({"prompt": text}, ()).markers == ()


def test_a_marker_never_spans_two_messages() -> None:
    body = {"messages": [{"role": "user", "content": "step by"}, {"role": "user", "content": "step"}]}
    assert features(body, MARKERS).markers == ()


def test_max_tokens_prefers_max_completion_tokens_and_ignores_non_integers() -> None:
    assert features({"prompt": "x", "max_tokens": 64}, MARKERS).max_tokens == 64
    assert features({"prompt": "x", "max_tokens": 64, "max_completion_tokens": 32}, MARKERS).max_tokens == 32
    assert features({"prompt": "x", "max_tokens": 64, "max_completion_tokens": "32"}, MARKERS).max_tokens == 64
    assert features({"prompt": "x", "max_tokens": True}, MARKERS).max_tokens is None
    assert features({"prompt": "x", "max_tokens": 6.5}, MARKERS).max_tokens is None
    assert features({"prompt": "x"}, MARKERS).max_tokens is None


@pytest.mark.parametrize("body", [
    {}, {"prompt": None}, {"prompt": 42}, {"prompt": {"text": "def "}}, {"prompt": [None, {"a": 1}, 1.5, [1, "x"]]},
    {"messages": "def hello"}, {"messages": [None, 3, "user"]}, {"messages": [{"role": "user", "content": 7}]},
    {"messages": [{"role": 5, "content": [{"type": "text", "text": 3}, "def ", None]}]},
])
def test_malformed_shapes_count_as_empty_text(body: dict[str, Any]) -> None:
    got = features(body, MARKERS)
    assert got == Features(0, None, 1, ())


def test_a_user_message_without_text_is_still_a_turn() -> None:
    body = {"messages": [{"role": "user", "content": 7}, {"role": "user", "content": "hi"}]}
    assert features(body, MARKERS) == Features(1, None, 2, ())


# --- classify ---------------------------------------------------------------------------------------------------

def classifier(*classes: RequestClass) -> Classifier:
    return Classifier(classes, MARKERS)


@pytest.mark.parametrize(("limit", "ok", "bad"), [
    ({"max_prompt_tokens": 100}, f(prompt_tokens=100), f(prompt_tokens=101)),
    ({"max_output_tokens": 50}, f(max_tokens=50), f(max_tokens=51)),
    ({"max_turns": 2}, f(turns=2), f(turns=3)),
    ({"markers": False}, f(markers=()), f(markers=("def ",))),
    ({"markers": True}, f(markers=("```",)), f(markers=())),
])
def test_each_limit_holds_at_its_bound_and_fails_past_it(limit: dict[str, Any], ok: Features, bad: Features) -> None:
    c = classifier(RequestClass("small", 0, **limit))
    assert classify(ok, c, 2).name == "small"
    assert classify(bad, c, 2) == Classification(UNMATCHED, 2, classify(bad, c, 2).reason)


def test_an_unstated_output_limit_passes_a_max_output_tokens_limit() -> None:
    c = classifier(RequestClass("small", 0, max_output_tokens=1))
    got = classify(f(max_tokens=None), c, 1)
    assert got.name == "small"
    assert got.reason == "small: max_tokens unset"


def test_a_class_without_limits_takes_everything() -> None:
    got = classify(f(prompt_tokens=10**6, max_tokens=10**6, turns=99, markers=("def ",)),
                   classifier(RequestClass("all", 1)), 3)
    assert got == Classification("all", 1, "all: no limits")


def test_markers_none_accepts_requests_with_and_without_markers() -> None:
    c = classifier(RequestClass("any", 0, markers=None))
    assert classify(f(markers=("def ",)), c, 1).name == "any"
    assert classify(f(markers=()), c, 1).name == "any"


def test_the_first_matching_class_wins_in_configured_order() -> None:
    tiny = RequestClass("tiny", 0, max_prompt_tokens=10)
    small = RequestClass("small", 1, max_prompt_tokens=100)
    assert classify(f(prompt_tokens=5), classifier(tiny, small), 2).name == "tiny"
    assert classify(f(prompt_tokens=5), classifier(small, tiny), 2).name == "small"
    assert classify(f(prompt_tokens=50), classifier(tiny, small), 2).tier == 1
    assert classify(f(prompt_tokens=500), classifier(tiny, small), 2).name == UNMATCHED


def test_the_matched_reason_names_every_limit_that_held() -> None:
    got = classify(f(prompt_tokens=12, max_tokens=64, turns=1), Classifier(default_classes(), DEFAULT_MARKERS), 1)
    assert got == Classification("simple", 0, "simple: prompt ~12 tokens <= 512, max_tokens 64 <= 256, "
                                              "1 turn(s) <= 4, no marker")
    coder = classifier(RequestClass("code", 1, markers=True))
    assert classify(f(markers=("```", "def ")), coder, 2).reason == "code: marker '```'"


def test_the_unmatched_reason_names_the_first_failed_limit_of_each_class() -> None:
    got = classify(f(prompt_tokens=900), Classifier(default_classes(), DEFAULT_MARKERS), 1)
    assert got == Classification(UNMATCHED, 1, "unmatched: prompt ~900 tokens > 512 (simple)")
    two = classifier(RequestClass("short", 0, max_prompt_tokens=100, max_turns=1),
                     RequestClass("code", 1, max_turns=1, markers=True))
    got = classify(f(prompt_tokens=50, turns=3), two, 2)
    assert got.reason == "unmatched: 3 turn(s) > 1 (short), 3 turn(s) > 1 (code)"
    got = classify(f(prompt_tokens=50, max_tokens=9000), classifier(RequestClass("a", 0, max_output_tokens=10),
                                                                     RequestClass("b", 0, markers=True)), 2)
    assert got.reason == "unmatched: max_tokens 9000 > 10 (a), no marker (b)"
    got = classify(f(markers=("def ",)), classifier(RequestClass("plain", 0, markers=False)), 1)
    assert got.reason == "unmatched: marker 'def ' (plain)"


def test_a_reason_stays_short_however_many_classes_fail() -> None:
    many = classifier(*(RequestClass(f"class-{i:02d}", 0, max_prompt_tokens=i) for i in range(30)))
    got = classify(f(prompt_tokens=10**9), many, 1)
    assert got.name == UNMATCHED
    assert len(got.reason) <= 200 and got.reason.endswith("...")
    assert got.reason.startswith("unmatched: prompt ~1000000000 tokens > 0 (class-00)")


def test_features_and_classify_together_on_real_bodies() -> None:
    c = Classifier(default_classes(), DEFAULT_MARKERS)
    simple = classify(features({"prompt": "What is the capital of France?", "max_tokens": 32}, c.markers), c, 1)
    assert (simple.name, simple.tier) == ("simple", 0)
    code = classify(features({"messages": [{"role": "user", "content": "Write a Python function that sorts"}]},
                             c.markers), c, 1)
    assert (code.name, code.tier) == (UNMATCHED, 1)
    assert code.reason == "unmatched: marker 'function' (simple)"


# --- the classifier model ---------------------------------------------------------------------------------------

LABELLED = Classifier((RequestClass("easy", 0), RequestClass("hard", 1)), MARKERS, model="labeller")


def test_label_request_asks_the_model_for_one_class_name() -> None:
    body = label_request({"messages": [{"role": "user", "content": "Prove that sqrt(2) is irrational"}]}, LABELLED)
    assert body["model"] == "labeller"
    assert body["max_tokens"] == 16 and body["temperature"] == 0
    assert body["structured_outputs"] == {"choice": ["easy", "hard"]}
    assert "Prove that sqrt(2) is irrational" in body["prompt"]
    assert "easy" in body["prompt"] and "hard" in body["prompt"]


def test_label_request_shows_at_most_2000_characters_of_the_request() -> None:
    body = label_request({"prompt": "a" * 1990 + "b" * 10 + "c" * 5000}, LABELLED)
    assert "a" * 1990 + "b" * 10 in body["prompt"]
    assert "bc" not in body["prompt"] and "ccc" not in body["prompt"]
    assert len(body["prompt"]) < 2400


def test_label_request_handles_token_ids_and_malformed_bodies() -> None:
    assert "3 prompt token ids" in label_request({"prompt": [1, 2, 3]}, LABELLED)["prompt"]
    assert label_request({"messages": 5}, LABELLED)["structured_outputs"] == {"choice": ["easy", "hard"]}


def test_label_request_needs_a_model() -> None:
    with pytest.raises(ValueError, match="model"):
        label_request({"prompt": "x"}, Classifier((RequestClass("easy", 0),), MARKERS))


@pytest.mark.parametrize(("response", "label"), [
    ({"choices": [{"index": 0, "text": "hard"}]}, "hard"),
    ({"choices": [{"index": 0, "text": "  easy\n"}]}, "easy"),
    ({"choices": [{"index": 0, "text": "medium"}]}, None),
    ({"choices": [{"index": 0, "text": UNMATCHED}]}, None),
    ({"choices": [{"index": 0, "text": None}]}, None),
    ({"choices": []}, None),
    ({"choices": ["hard"]}, None),
    ({"error": {"message": "model not found"}}, None),
    ({}, None),
])
def test_parse_label_accepts_only_a_configured_class_name(response: dict[str, Any], label: str | None) -> None:
    assert parse_label(response, LABELLED) == label
