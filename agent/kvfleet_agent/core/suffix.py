"""Suffix decoding's proposer: continue a sequence's recent tokens the way they went on before, counted over the
request itself and over other requests' outputs (vLLM's "suffix", after SuffixDecoding, Oliaro et al. 2024)."""

from __future__ import annotations

from collections import OrderedDict
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

    def add(self, tokens: Sequence[int], start: int = 0, floor: int = 0) -> None:
        """Count, for each position e > floor from `start` on, tokens[e] after the contexts ending at e that begin at
        `floor` or later (a request's output alone, with its prompt before `floor`)."""
        for end in range(max(start, floor + 1), len(tokens)):
            self._walk(tokens, end, 1, floor)

    def remove(self, tokens: Sequence[int]) -> None:
        """Undo add(tokens) (from 0): the counts drop back and contexts no longer seen are pruned."""
        for end in range(1, len(tokens)):
            self._walk(tokens, end, -1, 0)

    def _walk(self, tokens: Sequence[int], end: int, sign: int, floor: int) -> None:
        node, nxt = self.root, tokens[end]
        for i in range(end - 1, max(end - self.depth, floor) - 1, -1):
            child = node.children.get(tokens[i])
            if child is None:
                if sign < 0:
                    return
                child = node.children[tokens[i]] = _Node()
            count = child.next.get(nxt, 0) + sign
            child.total += sign
            if count > 0:
                child.next[nxt] = count
            else:
                child.next.pop(nxt, None)
            if sign > 0:
                child.last = nxt
            if child.total <= 0:
                del node.children[tokens[i]]  # its descendants counted only occurrences of it: all gone too
                return
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


class SuffixCache:
    """Every running request's own trie (its prompt and output) and one trie shared by all requests' outputs, the
    finished ones' kept up to max_cached_requests (first in, first out; 0 keeps none)."""

    def __init__(self, depth: int, max_cached_requests: int) -> None:
        self.depth = depth
        self.max_cached = max_cached_requests
        self.shared = ContextTrie(depth)
        self._own: dict[str, ContextTrie] = {}
        self._seen: dict[str, list[int]] = {}  # each running request's tokens as indexed, and where its output starts
        self._prompt_len: dict[str, int] = {}
        self._finished: OrderedDict[str, list[int]] = OrderedDict()

    def sync(self, request_id: str, token_ids: Sequence[int], prompt_len: int) -> list[int]:
        """Index what is new in a running request's tokens (its own trie: all; the shared one: the output)."""
        seen = self._seen.get(request_id)
        if seen is None or len(token_ids) < len(seen) or (seen and token_ids[len(seen) - 1] != seen[-1]):
            self.drop(request_id)  # a truncated or replaced list: start over
            seen = self._seen[request_id] = []
            self._own[request_id] = ContextTrie(self.depth)
            self._prompt_len[request_id] = prompt_len
        start = len(seen)
        seen.extend(token_ids[start:])
        self._own[request_id].add(seen, start)
        out_start = self._prompt_len[request_id]
        if self.max_cached > 0:
            self.shared.add(seen, start, floor=out_start)
        return seen

    def propose(self, request_id: str, token_ids: Sequence[int], prompt_len: int, k: int, min_prob: float,
                factor: float) -> Guess:
        """The better-scored of the request's own continuation and the shared one."""
        seen = self.sync(request_id, token_ids, prompt_len)
        own = speculate(self._own[request_id], seen, k, min_prob, factor, shared=False)
        if self.max_cached <= 0:
            return own
        other = speculate(self.shared, seen, k, min_prob, factor, shared=True)
        return other if other.score > own.score else own

    def finish(self, request_id: str) -> None:
        """A request ended: its own trie goes, its output stays shared (the oldest finished one evicted past the
        bound)."""
        seen = self._seen.pop(request_id, None)
        self._own.pop(request_id, None)
        start = self._prompt_len.pop(request_id, 0)
        if seen is None or self.max_cached <= 0:
            return
        self._finished[request_id] = seen[start:]
        while len(self._finished) > self.max_cached:
            _, old = self._finished.popitem(last=False)
            self.shared.remove(old)

    def drop(self, request_id: str) -> None:
        """Forget a running request entirely, its shared counts included (its list was replaced)."""
        seen = self._seen.pop(request_id, None)
        self._own.pop(request_id, None)
        start = self._prompt_len.pop(request_id, 0)
        if seen is not None and self.max_cached > 0 and len(seen) > start + 1:
            self.shared.remove(seen[start:])
