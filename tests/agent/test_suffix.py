"""Suffix decoding's proposer (kvfleet_agent.core.suffix): hand cases, the shared cache across requests and its
eviction, and random sequences against a brute-force count."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from hypothesis import given
from hypothesis import strategies as st

from kvfleet_agent.core.suffix import ContextTrie, SuffixCache, speculate


def next_token(seqs: Sequence[Sequence[int]], ctx: Sequence[int], depth: int) -> tuple[int, float, int] | None:
    """O(L²) definition: the longest suffix of ctx (up to depth) that occurs in a sequence with a token after it; the
    token most often after it, ties to the one after its latest occurrence (sequences in order); with its share and
    the suffix's length."""
    for n in range(min(depth, len(ctx)), 0, -1):
        suffix = list(ctx[len(ctx) - n:])
        after: Counter[int] = Counter()
        latest = None
        for s in seqs:
            for e in range(n, len(s)):
                if list(s[e - n:e]) == suffix:
                    after[s[e]] += 1
                    latest = s[e]
        if after:
            top = max(after.values())
            best = latest if after[latest] == top else next(t for t, c in after.items() if c == top)
            return best, top / sum(after.values()), n
    return None


def reference(seqs: Sequence[Sequence[int]], ctx: Sequence[int], depth: int, k: int, min_prob: float,
              factor: float) -> list[int]:
    first = next_token(seqs, ctx, depth)
    if first is None:
        return []
    limit, out, prob, ctx = min(k, max(1, int(factor * first[2]))), [], 1.0, list(ctx)
    while len(out) < limit:
        got = next_token(seqs, ctx, depth)
        if got is None:
            break
        prob *= got[1]
        if prob < min_prob:
            break
        out.append(got[0])
        ctx.append(got[0])
    return out


def trie(seqs: Sequence[Sequence[int]], depth: int) -> ContextTrie:
    t = ContextTrie(depth)
    for s in seqs:
        t.add(s)
    return t


def test_the_most_frequent_continuation_wins_over_the_latest() -> None:
    # After [7] came 1 twice, then 2 once (most recently): 1 is proposed, with probability 2/3.
    seq = [7, 1, 5, 7, 1, 5, 7, 2, 5, 7]
    got = speculate(trie([seq], 1), seq, 1, 0.0, 1.0, shared=False)
    assert got.tokens == [1] and abs(got.score - 2 / 3) < 1e-9 and got.matched == 1


def test_a_longer_context_decides_over_a_shorter_one() -> None:
    # [3, 7] was followed by 2; [7] alone more often by 1.
    seq = [7, 1, 7, 1, 3, 7, 2, 9, 3, 7]
    assert speculate(trie([seq], 2), seq, 1, 0.0, 1.0, shared=False).tokens == [2]
    assert speculate(trie([seq], 1), seq, 1, 0.0, 1.0, shared=False).tokens == [1]


def test_the_chain_stops_under_min_token_prob_and_at_factor_times_the_match() -> None:
    seq = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2]  # after [1, 2] comes 3 for sure, then 4 or 5 (1/2 each)
    t = trie([seq], 2)
    assert speculate(t, seq, 4, 0.6, 4.0, shared=False).tokens == [3]  # 1 * 1/2 < 0.6: stops after the sure token
    # At 0.4 the tie goes to the latest (5), whose context then continues for sure: 3, 5, 1, 2.
    assert speculate(t, seq, 4, 0.4, 4.0, shared=False).tokens == [3, 5, 1, 2]
    assert speculate(t, seq, 4, 0.0, 0.5, shared=False).tokens == [3]  # a 2-token match may propose 1 token


def test_a_finished_request_s_output_is_proposed_to_a_later_one_and_its_prompt_is_not() -> None:
    cache = SuffixCache(depth=4, max_cached_requests=10, max_cached_tokens=1000)
    prompt, output = [50, 51, 52], [10, 11, 12, 13, 14]
    cache.sync("a", prompt + output, len(prompt))
    cache.finish("a", prompt + output, len(prompt))
    cache.flush(100)
    got = cache.propose("b", [99, 10, 11], 2, k=3, min_prob=0.0, factor=4.0)
    assert got.tokens == [12, 13, 14] and got.shared
    assert cache.propose("c", [98, 50, 51], 2, k=3, min_prob=0.0, factor=4.0).tokens == []  # prompts stay private


def test_its_own_tokens_win_when_they_score_higher() -> None:
    cache = SuffixCache(depth=4, max_cached_requests=10, max_cached_tokens=1000)
    # It never proposed, and is shared all the same: after [1, 2] came 8 once and 9 once.
    cache.finish("a", [0, 1, 2, 8, 1, 2, 9], 1)
    cache.flush(100)
    own = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2]  # its own prompt: after [1, 2] always 3
    got = cache.propose("b", own, len(own), k=1, min_prob=0.0, factor=4.0)
    assert got.tokens == [3] and not got.shared


def test_an_ended_output_is_shared_a_bounded_number_of_tokens_per_flush() -> None:
    cache = SuffixCache(depth=2, max_cached_requests=10, max_cached_tokens=1000)
    cache.sync("a", [0], 1)  # running: its prompt, no output yet
    cache.finish("a", [0, *range(10, 20)], 1)  # ended with 10 output tokens, none shared yet
    assert cache.shared.root.children == {}
    assert cache.pending_tokens == 9  # the output's positions with a context in it
    cache.flush(4)  # the contexts of output positions 1-4
    assert _shape(cache.shared.root) == _shape(trie([list(range(10, 15))], 2).root) and cache.cached_tokens == 0
    assert cache.pending_tokens == 5
    cache.flush(100)
    assert _shape(cache.shared.root) == _shape(trie([list(range(10, 20))], 2).root) and cache.cached_tokens == 10
    assert cache.pending_tokens == 0
    got = cache.propose("b", [5, 13, 14], 1, k=3, min_prob=0.0, factor=4.0)
    assert got.tokens == [15, 16, 17] and got.shared


def test_eviction_undoes_exactly_what_the_evicted_output_added() -> None:
    cache = SuffixCache(depth=3, max_cached_requests=1, max_cached_tokens=1000)
    for rid, toks in (("a", [0, 1, 2, 3, 1, 2, 4]), ("b", [0, 5, 6, 7, 5, 6])):
        cache.sync(rid, toks, 1)
        cache.finish(rid, toks, 1)
        cache.flush(100)
    # Only b's output is left, and the trie is the one b's output alone builds.
    assert _shape(cache.shared.root) == _shape(trie([[5, 6, 7, 5, 6]], 3).root)
    assert cache.propose("c", [0, 1, 2], 1, k=1, min_prob=0.0, factor=1.0).tokens == []


def test_the_token_bound_evicts_the_oldest_outputs_until_the_rest_fit() -> None:
    cache = SuffixCache(depth=3, max_cached_requests=100, max_cached_tokens=7)
    for rid, toks in (("a", [0, 1, 2, 3]), ("b", [0, 4, 5, 6]), ("c", [0, 7, 8, 9, 10])):
        cache.sync(rid, toks, 1)
        cache.finish(rid, toks, 1)
        cache.flush(100)
    # Outputs of 3, 3 and 4 tokens: c's brings the total to 10 > 7, which evicts a (the oldest) and leaves 7.
    assert cache.cached_tokens == 7
    assert _shape(cache.shared.root) == _shape(trie([[4, 5, 6], [7, 8, 9, 10]], 3).root)


def test_an_evicted_output_leaves_a_bounded_number_of_tokens_per_flush() -> None:
    cache = SuffixCache(depth=2, max_cached_requests=1, max_cached_tokens=1000)
    cache.finish("a", [0, *range(10, 30)], 1)
    cache.flush(100)
    cache.finish("b", [0, 40, 41], 1)
    cache.flush(2)  # b's 1 position, then 1 of the 19 of a's leaving
    left = trie([list(range(10, 30))], 2)
    left.remove(list(range(10, 30)), 1, 2)
    assert _shape(cache.shared.root) == _shape(_merged(left, [40, 41]))
    cache.flush(100)
    assert _shape(cache.shared.root) == _shape(trie([[40, 41]], 2).root)


def _merged(t: ContextTrie, seq: list[int]) -> object:
    t.add(seq)
    return t.root


def test_reset_forgets_every_shared_output_and_running_ones_are_indexed_again() -> None:
    cache = SuffixCache(depth=2, max_cached_requests=10, max_cached_tokens=1000)
    cache.finish("a", [0, 1, 2, 3], 1)
    cache.flush(100)
    cache.sync("b", [0, 5, 6], 1)
    cache.reset_shared()
    assert cache.shared.root.children == {} and cache.cached_tokens == cache.pending_tokens == 0
    cache.propose("b", [0, 5, 6, 7], 1, k=1, min_prob=0.0, factor=1.0)
    assert _shape(cache.shared.root) == _shape(trie([[5, 6, 7]], 2).root)


def test_a_request_ending_without_output_leaves_the_queue_at_once() -> None:
    cache = SuffixCache(depth=2, max_cached_requests=10, max_cached_tokens=1000)
    cache.finish("a", [0, 1], 2)  # aborted before its first token
    cache.finish("b", [0, 5, 6], 1)
    cache.flush(2)  # a costs a unit of work, b's one position the other
    assert _shape(cache.shared.root) == _shape(trie([[5, 6]], 2).root) and cache.pending_tokens == 0


def test_no_shared_cache_keeps_nothing_after_a_request() -> None:
    cache = SuffixCache(depth=3, max_cached_requests=0, max_cached_tokens=1000)
    cache.sync("a", [0, 1, 2, 1, 2], 1)
    cache.finish("a", [0, 1, 2, 1, 2], 1)
    cache.flush(100)
    assert cache.shared.root.children == {}


def _shape(node: object) -> object:
    from kvfleet_agent.core.suffix import _Node

    assert isinstance(node, _Node)
    return (dict(node.next), node.total, {t: _shape(c) for t, c in node.children.items()})


@given(st.lists(st.lists(st.integers(0, 3), max_size=14), min_size=1, max_size=3), st.integers(1, 4),
       st.integers(1, 5), st.sampled_from([0.0, 0.2, 0.5]), st.sampled_from([0.5, 1.0, 3.0]))
def test_random_sequences_match_the_brute_force_count(seqs: list[list[int]], depth: int, k: int, min_prob: float,
                                                       factor: float) -> None:
    *earlier, ctx = seqs
    t = trie([*earlier, ctx], depth)
    assert speculate(t, ctx, k, min_prob, factor, shared=False).tokens == \
        reference([*earlier, ctx], ctx, depth, k, min_prob, factor)


@given(st.lists(st.lists(st.integers(0, 3), max_size=12), min_size=1, max_size=4), st.integers(1, 4))
def test_removing_every_sequence_leaves_an_empty_trie(seqs: list[list[int]], depth: int) -> None:
    t = trie(seqs, depth)
    for s in reversed(seqs):
        t.remove(s)
    assert t.root.children == {}


@given(st.lists(st.tuples(st.integers(0, 1), st.sampled_from(["grow", "finish", "flush"]),
                          st.lists(st.integers(0, 3), max_size=5), st.integers(0, 6)), max_size=40),
       st.integers(1, 3), st.integers(0, 12))
def test_the_shared_trie_holds_exactly_the_running_and_the_kept_outputs(
        ops: list[tuple[int, str, list[int], int]], max_requests: int, max_tokens: int) -> None:
    cache = SuffixCache(depth=2, max_cached_requests=max_requests, max_cached_tokens=max_tokens)
    running: dict[str, list[int]] = {}
    ended: list[list[int]] = []
    for rid_n, op, toks, budget in ops:
        rid = f"r{rid_n}"
        if op == "grow":
            running[rid] = running.get(rid, [100 + rid_n]) + toks  # a 1-token prompt, then output
            cache.sync(rid, running[rid], 1)
        elif op == "finish" and rid in running:
            final = running.pop(rid) + toks  # tokens since its last sync come with the end
            cache.finish(rid, final, 1)
            ended.append(final[1:])
        else:
            cache.flush(budget)
    cache.flush(10**9)
    kept: list[list[int]] = []
    for out in ended:
        if len(out) > max_tokens:
            continue  # alone over the token bound: it leaves again, and evicts nothing older
        kept.append(out)
        while kept and (len(kept) > max_requests or sum(map(len, kept)) > max_tokens):
            kept.pop(0)
    assert cache.pending_tokens == 0 and cache.cached_tokens == sum(map(len, kept))
    assert _shape(cache.shared.root) == _shape(trie([*kept, *(t[1:] for t in running.values())], 2).root)
