"""Suffix decoding's proposer: continue a sequence's recent tokens the way they went on before, counted over the
request itself and over other requests' outputs (vLLM's "suffix", after SuffixDecoding, Oliaro et al. 2024)."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass


class _Node:
    """A context read backwards from some position: children by the token one further back, and how often each token
    came next after it."""

    __slots__ = ("children", "last", "next", "total")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.next: dict[int, int] = {}
        self.total = 0
        self.last = -1  # the token that came after this context most recently: ties go to it


class ContextTrie:
    """Counts of the token that followed each context of 1..depth tokens, over every sequence added.

    The same right-to-left trie as NgramIndex, but each node counts its next tokens instead of remembering one
    position: a context seen many times proposes what usually followed it, with that share as its probability,
    which is what lets one trie hold many requests' outputs at once. Removing a sequence subtracts exactly what adding
    it added, so a bounded cache can evict.
    """

    def __init__(self, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.depth = depth
        self.root = _Node()

    def add(self, tokens: Sequence[int], start: int = 0, floor: int = 0, stop: int | None = None) -> None:
        """Count, for each position e > floor from `start` up to `stop` (default: the end), tokens[e] after the
        contexts ending at e that begin at `floor` or later (a request's output alone, its prompt before `floor`)."""
        depth, root = self.depth, self.root
        for end in range(max(start, floor + 1), len(tokens) if stop is None else stop):
            node, nxt = root, tokens[end]
            # Every output token of every request passes here: locals and no branches on a sign (hot path).
            for i in range(end - 1, max(end - depth, floor) - 1, -1):
                children = node.children
                child = children.get(tokens[i])
                if child is None:
                    child = children[tokens[i]] = _Node()
                counts = child.next
                counts[nxt] = counts.get(nxt, 0) + 1
                child.total += 1
                child.last = nxt
                node = child

    def remove(self, tokens: Sequence[int], start: int = 1, stop: int | None = None) -> None:
        """Undo add(tokens) for the positions from `start` up to `stop` (default: all of them): the counts drop back
        and contexts no longer seen are pruned; in pieces, so a long output can leave over several steps."""
        for end in range(max(start, 1), len(tokens) if stop is None else stop):
            node, nxt = self.root, tokens[end]
            for i in range(end - 1, max(end - self.depth, 0) - 1, -1):
                child = node.children.get(tokens[i])
                if child is None:
                    break
                count = child.next.get(nxt, 0) - 1
                if count > 0:
                    child.next[nxt] = count
                else:
                    child.next.pop(nxt, None)
                child.total -= 1
                if child.total <= 0:
                    del node.children[tokens[i]]  # its descendants counted only occurrences of it: all gone too
                    break
                node = child

    def deepest(self, tokens: Sequence[int]) -> tuple[_Node | None, int]:
        """The node of the longest context ending the tokens that was seen with a next token, and its length."""
        node, found, depth = self.root, None, 0
        for d, i in enumerate(range(len(tokens) - 1, max(len(tokens) - self.depth, 0) - 1, -1), start=1):
            child = node.children.get(tokens[i])
            if child is None:
                break
            node, found, depth = child, child, d
        return found, depth


@dataclass(frozen=True)
class Guess:
    """A proposal: its tokens, their summed estimated probabilities (the tokens a verification should yield beyond
    the first, the score the two tries compete on), the matched context's length, and whether it came from the
    shared cache rather than the request's own tokens."""

    tokens: list[int]
    score: float
    matched: int
    shared: bool


def speculate(trie: ContextTrie, tokens: list[int], k: int, min_prob: float, factor: float, shared: bool) -> Guess:
    """Up to k tokens continuing `tokens` by the trie's most frequent next token at the longest seen context,
    re-matched after each token; stops where the chain's estimated probability falls under min_prob, and at
    factor x the first match's length (a short match is weak evidence: it may not propose far)."""
    node, matched = trie.deepest(tokens)
    if node is None:
        return Guess([], 0.0, 0, shared)
    limit = min(k, max(1, int(factor * matched)))
    out: list[int] = []
    prob, score = 1.0, 0.0
    ctx = tokens[-trie.depth:]
    while node is not None and node.total > 0 and len(out) < limit:
        best = node.last if node.last in node.next else -1
        top = node.next.get(best, 0)
        for tok, count in node.next.items():
            if count > top:
                best, top = tok, count
        prob *= top / node.total
        if prob < min_prob:
            break
        out.append(best)
        score += prob
        ctx.append(best)
        node, _ = trie.deepest(ctx)
    return Guess(out, score, matched, shared)


class _Running:
    """A request's tokens, the first `shared_len` indexed in the shared trie (its output part) and the first `own_len`
    in its own trie, which only a proposal builds (None until the request proposes, and again once it ended)."""

    __slots__ = ("own", "own_len", "prompt_len", "shared_len", "tokens")

    def __init__(self, prompt_len: int) -> None:
        self.tokens: list[int] = []
        self.prompt_len = prompt_len
        self.own: ContextTrie | None = None
        self.own_len = 0
        self.shared_len = 0


def _replaced(seen: list[int], token_ids: Sequence[int]) -> bool:
    """Whether a request's token list is no longer `seen` plus new tokens: shorter (truncated), or its last indexed
    token changed (replaced in place; an O(1) check, as NgramIndex.sync's)."""
    return len(token_ids) < len(seen) or bool(seen and token_ids[len(seen) - 1] != seen[-1])


class SuffixCache:
    """Every running request's own trie (its prompt and output) and one trie shared by all requests' outputs, the
    ended ones' kept up to max_cached_requests outputs and max_cached_tokens tokens (first in, first out; 0
    requests keeps none). Ended outputs join, and evicted ones leave, a bounded number of tokens a step (`flush`)."""

    def __init__(self, depth: int, max_cached_requests: int, max_cached_tokens: int) -> None:
        self.depth = depth
        self.max_cached = max_cached_requests
        self.max_tokens = max_cached_tokens
        self.shared = ContextTrie(depth)
        self._running: dict[str, _Running] = {}
        self._pending: deque[_Running] = deque()  # ended, their outputs' tails not yet shared
        self.pending_tokens = 0  # in those tails
        self._finished: deque[list[int]] = deque()  # kept outputs, oldest first (ids may be reused: not keyed)
        self.cached_tokens = 0  # in the kept outputs
        self._evicting: deque[tuple[list[int], int]] = deque()  # outputs leaving, each from this position on

    def sync(self, request_id: str, token_ids: Sequence[int], prompt_len: int) -> _Running:
        """Index what is new in a running request's output in the shared trie; a list that is shorter or whose last
        indexed token changed (truncated, replaced) starts over."""
        run = self._running.get(request_id)
        if run is None or _replaced(run.tokens, token_ids):
            self.drop(request_id)
            run = self._running[request_id] = _Running(prompt_len)
        run.tokens.extend(token_ids[len(run.tokens):])
        if self.max_cached > 0:
            self.shared.add(run.tokens, run.shared_len, floor=run.prompt_len)
            run.shared_len = len(run.tokens)
        return run

    def propose(self, request_id: str, token_ids: Sequence[int], prompt_len: int, k: int, min_prob: float,
                factor: float) -> Guess:
        """The better-scored of the request's own continuation and the shared one."""
        run = self.sync(request_id, token_ids, prompt_len)
        own = run.own = run.own or ContextTrie(self.depth)
        own.add(run.tokens, run.own_len)
        run.own_len = len(run.tokens)
        mine = speculate(own, run.tokens, k, min_prob, factor, shared=False)
        if self.max_cached <= 0:
            return mine
        other = speculate(self.shared, run.tokens, k, min_prob, factor, shared=True)
        return other if other.score > mine.score else mine

    def finish(self, request_id: str, token_ids: Sequence[int], prompt_len: int) -> None:
        """A request ended with these tokens (whether or not it ever proposed: requests that never speculate, or
        end while speculation is off, are shared too): its own trie goes, its output is queued for `flush`."""
        run = self._running.get(request_id)
        if run is None or _replaced(run.tokens, token_ids):
            self.drop(request_id)  # its shared counts were of other tokens
            run = _Running(prompt_len)
        self._running.pop(request_id, None)
        if self.max_cached <= 0:
            return
        run.own = None
        run.tokens.extend(token_ids[len(run.tokens):])
        self._pending.append(run)
        self.pending_tokens += max(0, len(run.tokens) - max(run.shared_len, run.prompt_len + 1))

    def flush(self, budget: int) -> None:
        """Spend about `budget` tokens' work: first on evicted outputs leaving the shared trie, then on ended ones
        joining it, oldest first. A whole output, once shared, counts against the bounds; past them the oldest kept
        ones are evicted (an output longer than max_cached_tokens leaves again at once)."""
        while budget > 0 and (self._evicting or self._pending):
            if self._evicting:
                tokens, pos = self._evicting[0]
                stop = min(len(tokens), pos + budget)
                self.shared.remove(tokens, pos, stop)
                budget -= max(1, stop - pos)
                if stop < len(tokens):
                    self._evicting[0] = (tokens, stop)
                else:
                    self._evicting.popleft()
                continue
            run = self._pending[0]
            begin = max(run.shared_len, run.prompt_len + 1)  # the first position with a context in the output
            stop = max(begin, min(len(run.tokens), begin + budget))
            self.shared.add(run.tokens, begin, floor=run.prompt_len, stop=stop)
            budget -= max(1, stop - begin)
            self.pending_tokens -= stop - begin
            run.shared_len = stop
            if stop >= len(run.tokens):  # an empty output (begin past the end) is done at once
                self._pending.popleft()
                self._keep(run.tokens[run.prompt_len:])

    def _keep(self, output: list[int]) -> None:
        """A fully shared output joins the kept ones; the oldest leave past the bounds (queued for `flush`)."""
        if len(output) > self.max_tokens:
            self._evicting.append((output, 1))
            return
        self._finished.append(output)
        self.cached_tokens += len(output)
        while len(self._finished) > self.max_cached or self.cached_tokens > self.max_tokens:
            old = self._finished.popleft()
            self.cached_tokens -= len(old)
            self._evicting.append((old, 1))

    def drop(self, request_id: str) -> None:
        """Forget a running request entirely, its shared counts included (its list was replaced)."""
        run = self._running.pop(request_id, None)
        if run is not None and self.max_cached > 0:
            self.shared.remove(run.tokens[run.prompt_len:run.shared_len])

    def reset_shared(self) -> None:
        """Forget every output shared so far (a fresh server's cache); running requests' outputs are indexed again
        as they next propose."""
        self.shared = ContextTrie(self.depth)
        self._pending.clear()
        self._finished.clear()
        self._evicting.clear()
        self.pending_tokens = self.cached_tokens = 0
        for run in self._running.values():
            run.shared_len = 0
