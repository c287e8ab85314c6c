"""Tests for kvfleet_agent.engine.detokenizer: UTF-8-safe deltas, stop strings and hold-back."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfleet_agent.engine.detokenizer import IncrementalDetokenizer
from kvfleet_agent.models.tiny import TINY_EOS_ID, init_tiny
from kvfleet_agent.models.tokenizer import Tokenizer

FFFD = "\ufffd"
_FIXTURE_OK = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    t = Tokenizer.from_dir(init_tiny(str(tmp_path_factory.mktemp("tiny_detok")), "llama"))
    assert t is not None
    return t


def _stream(detok: IncrementalDetokenizer, ids: Sequence[int], chunks: Sequence[int] = ()) -> list[str]:
    """Feed `ids` in chunks of the given sizes (1 when exhausted); returns the deltas, flush excluded."""
    deltas: list[str] = []
    i = 0
    sizes = list(chunks)
    while i < len(ids):
        n = sizes.pop(0) if sizes else 1
        deltas.append(detok.add_tokens(list(ids[i : i + n])))
        i += n
    return deltas


def _longest_stop_prefix_suffix(text: str, stops: Sequence[str]) -> int:
    """Reference hold-back: the longest suffix of `text` that is a proper prefix of a stop string."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


# --- no stop strings: deltas reproduce decode() ------------------------------------------------


@_FIXTURE_OK
@given(data=st.data())
def test_deltas_concatenate_to_decode_for_random_ids(tok: Tokenizer, data: st.DataObject) -> None:
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=40), label="ids")
    chunks = data.draw(st.lists(st.integers(1, 4), max_size=20), label="chunks")
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    prompt = tok.encode(data.draw(st.text(max_size=12), label="prompt"))
    detok = IncrementalDetokenizer(tok, prompt, [], skip_special_tokens=skip)
    deltas = _stream(detok, ids, chunks)
    # Nothing streamed before the end may stop in the middle of a character.
    assert not any(d.endswith(FFFD) for d in deltas)
    tail = detok.flush()
    expected = tok.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) + tail == expected == detok.text
    assert detok.stopped is None and detok.finished


@_FIXTURE_OK
@given(text=st.text(max_size=30))
def test_valid_text_streams_without_replacement_chars(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    # Special tokens are kept so that text containing e.g. "<s>" round-trips too.
    detok = IncrementalDetokenizer(tok, [1], [], skip_special_tokens=False)
    deltas = _stream(detok, ids)
    assert all(FFFD not in d for d in deltas) or FFFD in text
    assert "".join(deltas) + detok.flush() == text


def test_multibyte_character_split_across_tokens_is_held_back(tok: Tokenizer) -> None:
    ids = tok.encode("ok 🚀 go", add_special_tokens=False)
    rocket = [i for i in ids if FFFD in tok.decode([i])]
    assert len(rocket) >= 2, "test premise: the emoji must span several byte tokens"
    detok = IncrementalDetokenizer(tok, [1], [])
    deltas = _stream(detok, ids)
    assert "".join(deltas) == "ok 🚀 go"
    # The emoji arrives whole, in the delta of the token that completes it.
    assert sum("🚀" in d for d in deltas) == 1
    assert all(FFFD not in d for d in deltas)
    assert detok.flush() == ""


def test_flush_releases_incomplete_character(tok: Tokenizer) -> None:
    ids = tok.encode("go 🚀", add_special_tokens=False)
    cut = ids[:-1]  # generation stopped mid-emoji (e.g. max_tokens)
    detok = IncrementalDetokenizer(tok, [1], [])
    deltas = _stream(detok, cut)
    assert FFFD not in "".join(deltas) and tok.decode(cut).startswith("".join(deltas))
    tail = detok.flush()
    assert tail.endswith(FFFD)
    assert "".join(deltas) + tail == tok.decode(cut) == detok.text
    assert detok.add_tokens([ids[-1]]) == "" and detok.flush() == ""


def test_prompt_ending_mid_character_does_not_corrupt_output(tok: Tokenizer) -> None:
    ids = tok.encode("hi 🙂 there", add_special_tokens=True)
    split = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith(FFFD))
    prompt, output = ids[:split], ids[split:]
    detok = IncrementalDetokenizer(tok, prompt, [])
    text = "".join(_stream(detok, output)) + detok.flush()
    assert text == tok.decode(output)


def test_special_tokens_kept_when_not_skipped(tok: Tokenizer) -> None:
    ids = [*tok.encode("the end", add_special_tokens=False), TINY_EOS_ID]
    kept = IncrementalDetokenizer(tok, [1], [], skip_special_tokens=False)
    assert "".join(_stream(kept, ids)) + kept.flush() == "the end</s>"
    skipped = IncrementalDetokenizer(tok, [1], [])
    assert "".join(_stream(skipped, ids)) + skipped.flush() == "the end"


class _RecordingTokenizer(Tokenizer):
    """The real tokenizer, recording how many ids each decode call sees."""

    max_window = 0

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.max_window = max(self.max_window, len(ids))
        return super().decode(ids, skip_special_tokens)


def test_decode_window_stays_small(tok: Tokenizer) -> None:
    rec = _RecordingTokenizer(
        tok.backend, bos_token_id=tok.bos_token_id, eos_token_ids=tok.eos_token_ids, add_bos_token=True
    )
    text = "The model reads the cache and the engine writes a block. " * 60
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > 500
    detok = IncrementalDetokenizer(rec, tok.encode("prompt text here"), ["never-appears"])
    out = "".join(_stream(detok, ids)) + detok.flush()
    assert out == text
    # Each step decodes the previous step's tokens plus the new one, never the whole output.
    assert rec.max_window <= 8


# --- stop strings --------------------------------------------------------------------------------


def _ids_spanning(tok: Tokenizer, text: str, needle: str) -> list[int]:
    """Encode `text` and check that no single token contains `needle` (it is split across tokens)."""
    ids = tok.encode(text, add_special_tokens=False)
    assert all(needle not in tok.decode([i]) for i in ids), "test premise: stop must span several tokens"
    return ids


@pytest.mark.parametrize(("include", "expected"), [(False, "Hello wor"), (True, "Hello world. Th")])
def test_stop_string_split_across_tokens(tok: Tokenizer, include: bool, expected: str) -> None:
    ids = _ids_spanning(tok, "Hello world. The rest is never shown.", "ld. Th")
    detok = IncrementalDetokenizer(tok, [1], ["ld. Th"], include_stop_str_in_output=include)
    deltas = _stream(detok, ids)
    assert detok.stopped == "ld. Th"
    assert detok.text == expected
    assert "".join(deltas) == expected
    assert detok.finished and detok.flush() == "" and detok.add_tokens(ids[:2]) == ""


@pytest.mark.parametrize("include", [False, True])
def test_stop_found_when_many_tokens_arrive_at_once(tok: Tokenizer, include: bool) -> None:
    ids = tok.encode("alpha beta gamma delta", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [1], ["gamma"], include_stop_str_in_output=include)
    delta = detok.add_tokens(ids)
    assert delta == detok.text == ("alpha beta gamma" if include else "alpha beta ")


def test_earliest_stop_wins(tok: Tokenizer) -> None:
    ids = tok.encode("one two three four", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [1], ["four", "two", "three"])
    assert "".join(_stream(detok, ids, [len(ids)])) == "one "
    assert detok.stopped == "two"


@pytest.mark.parametrize(
    ("stops", "stopped", "text"),
    [
        # The stop that completes first wins, even if another one started earlier...
        (["one two three", "two"], "two", "xx one "),
        # ...and of two that complete at the same character, the longer one.
        (["two", "one two"], "one two", "xx "),
    ],
)
def test_earliest_ending_stop_wins_within_one_step(
    tok: Tokenizer, stops: list[str], stopped: str, text: str
) -> None:
    ids = tok.encode("xx one two three four", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [1], stops)
    assert detok.add_tokens(ids) == text
    assert detok.stopped == stopped


def test_possible_stop_prefix_is_held_back_then_released(tok: Tokenizer) -> None:
    stop = "the end"
    text = "We saw the enemy near the end of it"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [1], [stop])
    emitted = ""
    saw_hold = False
    for i in range(len(ids)):
        emitted += detok.add_tokens([ids[i]])
        if detok.stopped:
            break
        decoded = tok.decode(ids[: i + 1])
        hold = _longest_stop_prefix_suffix(decoded, [stop])
        saw_hold |= hold > 0
        # Exactly the text that could still turn into the stop string is withheld.
        assert emitted == decoded[: len(decoded) - hold]
    assert saw_hold, "test premise: some step must end in a prefix of the stop string"
    assert "the en" in emitted  # released once "emy" showed it was not the stop string
    assert detok.stopped == stop
    assert emitted == detok.text == "We saw the enemy near "


def test_held_back_prefix_is_flushed_when_generation_ends(tok: Tokenizer) -> None:
    ids = tok.encode("wait for it ##", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [1], ["###"])
    streamed = "".join(_stream(detok, ids))
    assert streamed == "wait for it "
    assert detok.text == "wait for it ##"
    assert detok.flush() == "##"
    assert detok.stopped is None


def test_include_stop_str_does_not_hold_back(tok: Tokenizer) -> None:
    ids = tok.encode("wait for it ##", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [1], ["###"], include_stop_str_in_output=True)
    assert "".join(_stream(detok, ids)) == "wait for it ##"


def test_stop_string_with_multibyte_characters(tok: Tokenizer) -> None:
    ids = tok.encode("ready 🚀 launch now", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [1], ["🚀 l"])
    deltas = _stream(detok, ids)
    assert "".join(deltas) == detok.text == "ready "
    assert detok.stopped == "🚀 l"


def test_empty_stop_string_rejected(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match=r"stop\[1\]"):
        IncrementalDetokenizer(tok, [1], ["ok", ""])


_ALPHABET = "ab \n"


@_FIXTURE_OK
@given(
    text=st.text(alphabet=_ALPHABET, max_size=30),
    stops=st.lists(st.text(alphabet=_ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3),
    include=st.booleans(),
    chunks=st.lists(st.integers(1, 3), max_size=10),
)
def test_stop_strings_against_reference(
    tok: Tokenizer, text: str, stops: list[str], include: bool, chunks: list[int]
) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [1], stops, include_stop_str_in_output=include)
    deltas = _stream(detok, ids, chunks)
    streamed = "".join(deltas)
    final = streamed + detok.flush()

    # Reference: the first stop to complete while reading the text left to right.
    matches = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if matches:
        end, start, _ = min(matches, key=lambda m: (m[0], m[1]))
        expected = text[:end] if include else text[:start]
        assert detok.stopped is not None and text[start:end] == detok.stopped
    else:
        expected = text
        assert detok.stopped is None
        if not include:
            # Before the flush, exactly the possible stop prefix at the end was withheld.
            assert streamed == text[: len(text) - _longest_stop_prefix_suffix(text, stops)]
    assert final == detok.text == expected
    # A streaming client never sees any part of a stop string it should not.
    if not include:
        assert not any(s in streamed for s in stops)
