"""N-gram prompt lookup (kvfleet_agent.core.ngram): hand cases, and random sequences against a brute-force search."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfleet_agent.core.ngram import NgramIndex


def reference(tokens: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """O(L²) definition: longest n first, then the latest earlier occurrence that has a token after it; the proposal
    continues the sequence as the occurrence's continuation did, token by token, reading its own guesses once it
    passes the end (t[end + j] = t[e + j] for the extended t)."""
    t = list(tokens)
    end = len(t)
    if k <= 0:
        return []
    for n in range(min(max_n, end - 1), min_n - 1, -1):
        suffix = t[end - n:]
        for e in range(end - 1, n - 1, -1):  # occurrence t[e-n:e], continuation from t[e], e <= end-1
            if t[e - n:e] == suffix:
                for j in range(k):
                    t.append(t[e + j])
                return t[end:]
    return []


def built(tokens: Sequence[int], min_n: int = 1, max_n: int = 4) -> NgramIndex:
    idx = NgramIndex(min_n, max_n)
    idx.extend(tokens)
    return idx


# ---------------------------------------------------------------------------------------------
# hand cases


def test_repeated_code_line_proposes_its_continuation() -> None:
    # "for i in range ( n ) :" NEWLINE ... then the same line starts again.
    line = [10, 11, 12, 13, 14, 15, 16, 17]
    tokens = [1, 2, *line, 99, 3, 4, *line[:4]]
    assert built(tokens, 2, 4).propose(4) == [14, 15, 16, 17]
    assert built(tokens, 2, 4).propose(10) == [14, 15, 16, 17, 99, 3, 4, 10, 11, 12]


def test_longest_n_is_preferred_over_a_more_recent_shorter_match() -> None:
    # Suffix [5, 6, 7]: the 3-gram occurs once (followed by 100); the 1-gram [7] also recurs later (followed by 200).
    tokens = [5, 6, 7, 100, 8, 7, 200, 5, 6, 7]
    assert built(tokens, 1, 3).propose(1) == [100]
    assert built(tokens, 1, 1).propose(1) == [200]  # only 1-grams allowed: the most recent [7]


def test_most_recent_occurrence_is_chosen() -> None:
    tokens = [1, 2, 30, 9, 1, 2, 40, 9, 1, 2]
    assert built(tokens, 2, 2).propose(2) == [40, 9]


def test_no_match_gives_nothing() -> None:
    assert built([1, 2, 3, 4, 5]).propose(3) == []
    assert built([]).propose(3) == []
    assert built([7]).propose(3) == []  # the suffix itself is not an earlier occurrence


def test_k_caps_the_proposal_and_a_continuation_past_the_end_repeats_the_period() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    idx = built(tokens, 2, 2)
    assert idx.propose(3) == [3, 4, 5]
    assert idx.propose(0) == []
    # [1, 2] recurs 6 tokens on, so the sequence repeats with period 6: past its end, the proposal reads itself.
    assert idx.propose(9) == [3, 4, 5, 6, 1, 2, 3, 4, 5]


def test_overlapping_earlier_occurrence_counts() -> None:
    # a a a a: suffix [a, a] last occurred at positions 1..2, followed by the final a, and a loop stays a loop.
    assert built([8, 8, 8, 8], 2, 2).propose(3) == [8, 8, 8]
    assert built([5, 7, 5, 7, 5], 2, 3).propose(4) == [7, 5, 7, 5]


def test_min_n_is_respected() -> None:
    tokens = [3, 50, 4, 3]  # only a 1-gram recurs
    assert built(tokens, 1, 3).propose(2) == [50, 4]
    assert built(tokens, 2, 3).propose(2) == []


def test_incremental_extend_matches_the_next_token() -> None:
    idx = NgramIndex(1, 3)
    idx.extend([1, 2, 3, 4])
    assert idx.propose(2) == []
    idx.extend([1, 2])
    assert idx.propose(2) == [3, 4]
    idx.extend([9])  # diverges: [9] never occurred before
    assert idx.propose(2) == []
    assert idx.num_tokens == 7


def test_sync_indexes_only_new_tokens_and_rebuilds_after_truncation() -> None:
    idx = NgramIndex(1, 2)
    toks = [1, 2, 3, 1, 2]
    idx.sync(toks)
    assert idx.propose(1) == [3]
    toks.append(7)
    idx.sync(toks)
    idx.sync(toks)  # repeated with nothing new: no double counting
    assert idx.num_tokens == 6
    assert idx.propose(1) == []
    # A stop truncated the output: the index forgets the cut tokens.
    idx.sync([1, 2, 3, 1])
    assert idx.num_tokens == 4
    assert idx.propose(2) == [2, 3]
    # Replaced in place at the last seen position: detected and rebuilt as well.
    idx.sync([1, 2, 3, 5, 2])
    assert idx.propose(1) == [3]


def test_bad_bounds_are_rejected() -> None:
    with pytest.raises(ValueError):
        NgramIndex(0, 2)
    with pytest.raises(ValueError):
        NgramIndex(3, 2)


# ---------------------------------------------------------------------------------------------
# against the brute-force definition

token_lists = st.lists(st.integers(0, 2), max_size=40)
bounds = st.integers(1, 3).flatmap(lambda lo: st.tuples(st.just(lo), st.integers(lo, lo + 2)))


@settings(max_examples=400, deadline=None)
@given(tokens=token_lists, nb=bounds, k=st.integers(0, 6), cuts=st.lists(st.integers(0, 40), max_size=5))
def test_extend_in_chunks_matches_reference_after_every_chunk(
        tokens: list[int], nb: tuple[int, int], k: int, cuts: list[int]) -> None:
    min_n, max_n = nb
    idx = NgramIndex(min_n, max_n)
    prev = 0
    for cut in [*sorted(c for c in cuts if c <= len(tokens)), len(tokens)]:
        idx.extend(tokens[prev:cut])
        prev = cut
        assert idx.propose(k) == reference(tokens[:cut], min_n, max_n, k)


@settings(max_examples=400, deadline=None)
@given(tokens=token_lists, nb=bounds, k=st.integers(1, 6), keep=st.integers(0, 40),
       more=st.lists(st.integers(0, 2), max_size=10))
def test_sync_after_truncation_matches_reference(
        tokens: list[int], nb: tuple[int, int], k: int, keep: int, more: list[int]) -> None:
    min_n, max_n = nb
    idx = NgramIndex(min_n, max_n)
    for i in range(len(tokens) + 1):  # a growing request's token list, synced after every token
        idx.sync(tokens[:i])
        assert idx.propose(k) == reference(tokens[:i], min_n, max_n, k)
    truncated = tokens[:keep]
    idx.sync(truncated)
    assert idx.num_tokens == len(truncated)
    assert idx.propose(k) == reference(truncated, min_n, max_n, k)
    grown = truncated + more
    idx.sync(grown)
    assert idx.propose(k) == reference(grown, min_n, max_n, k)


def test_lookup_gives_the_match_length() -> None:
    """lookup's second value is the length of the suffix it matched: the longest recurring one up to max_n."""
    idx = NgramIndex(1, 4)
    idx.extend([1, 2, 3, 4, 5, 9, 2, 3, 4])
    assert idx.lookup(2) == ([5, 9], 3)  # [2, 3, 4] recurs; [9, 2, 3, 4] does not
    idx.extend([7])
    assert idx.lookup(2) == ([], 0)
    idx.extend([1, 2, 3, 4])
    assert idx.lookup(1) == ([5], 4)
