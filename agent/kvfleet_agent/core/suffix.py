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

    def remove(self, tokens: Sequence[int]) -> None:
        """Undo add(tokens) (from 0): the counts drop back and contexts no longer seen are pruned."""
        for end in range(1, len(tokens)):
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
    in its own trie, which only a proposal needs (a request ending need not build it)."""

    __slots__ = ("own", "own_len", "prompt_len", "shared_len", "tokens")

    def __init__(self, prompt_len: int, depth: int) -> None:
        self.tokens: list[int] = []
        self.prompt_len = prompt_len
        self.own = ContextTrie(depth)
        self.own_len = 0
        self.shared_len = 0


class SuffixCache:
    """Every running request's own trie (its prompt and output) and one trie shared by all requests' outputs, the
    finished ones' kept up to max_cached_requests outputs and max_cached_tokens tokens (first in, first out; 0
    requests keeps none)."""

    def __init__(self, depth: int, max_cached_requests: int, max_cached_tokens: int) -> None:
        self.depth = depth
        self.max_cached = max_cached_requests
        self.max_tokens = max_cached_tokens
        self.cached_tokens = 0  # in the finished outputs kept
        self.shared = ContextTrie(depth)
        self._running: dict[str, _Running] = {}
        self._pending: deque[_Running] = deque()  # ended, their outputs' tails not yet shared
        self.pending_tokens = 0  # in those tails
        self._finished: deque[list[int]] = deque()  # kept outputs, oldest first (ids may be reused: not keyed)

    def sync(self, request_id: str, token_ids: Sequence[int], prompt_len: int) -> _Running:
        """Index what is new in a running request's output in the shared trie; a list that is shorter or whose last
        indexed token changed (truncated, replaced) starts over."""
        run = self._running.get(request_id)
        seen = run.tokens if run is not None else []
        if run is None or len(token_ids) < len(seen) or (seen and token_ids[len(seen) - 1] != seen[-1]):
            self.drop(request_id)
            run = self._running[request_id] = _Running(prompt_len, self.depth)
        run.tokens.extend(token_ids[len(run.tokens):])
        if self.max_cached > 0:
            self.shared.add(run.tokens, run.shared_len, floor=run.prompt_len)
            run.shared_len = len(run.tokens)
        return run

    def propose(self, request_id: str, token_ids: Sequence[int], prompt_len: int, k: int, min_prob: float,
                factor: float) -> Guess:
        """The better-scored of the request's own continuation and the shared one."""
        run = self.sync(request_id, token_ids, prompt_len)
        run.own.add(run.tokens, run.own_len)
        run.own_len = len(run.tokens)
        own = speculate(run.own, run.tokens, k, min_prob, factor, shared=False)
        if self.max_cached <= 0:
            return own
        other = speculate(self.shared, run.tokens, k, min_prob, factor, shared=True)
        return other if other.score > own.score else own

    def finish(self, request_id: str, token_ids: Sequence[int] | None = None) -> None:
        """A request ended (with these tokens, if given): its own trie goes, and its output joins the shared trie by
        `flush`, a bounded number of tokens a step, so a step where many requests end together is not the one that
        pays for all of them."""
        run = self._running.pop(request_id, None)
        if run is None or self.max_cached <= 0:
            return
        if token_ids is not None and len(token_ids) >= len(run.tokens) and \
                token_ids[len(run.tokens) - 1:len(run.tokens)] == run.tokens[-1:]:
            run.tokens.extend(token_ids[len(run.tokens):])
        self._pending.append(run)
        self.pending_tokens += max(0, len(run.tokens) - max(run.shared_len, run.prompt_len + 1))

    def flush(self, budget: int) -> None:
        """Share up to `budget` more tokens of ended requests' outputs, oldest first; a whole output, once shared,
        counts against the bounds (the oldest finished one evicted past them)."""
        while budget > 0 and self._pending:
            run = self._pending[0]
            begin = max(run.shared_len, run.prompt_len + 1)  # the first position with a context in the output
            stop = max(begin, min(len(run.tokens), begin + budget))
            self.shared.add(run.tokens, begin, floor=run.prompt_len, stop=stop)
            budget -= max(1, stop - begin)
            self.pending_tokens -= stop - begin
            run.shared_len = stop
            if stop < len(run.tokens):
                return
            self._pending.popleft()
            output = run.tokens[run.prompt_len:]
            self._finished.append(output)
            self.cached_tokens += len(output)
            while self._finished and (len(self._finished) > self.max_cached or self.cached_tokens > self.max_tokens):
                old = self._finished.popleft()
                self.shared.remove(old)
                self.cached_tokens -= len(old)

    def drop(self, request_id: str) -> None:
        """Forget a running request entirely, its shared counts included (its list was replaced)."""
        run = self._running.pop(request_id, None)
        if run is not None and self.max_cached > 0:
            self.shared.remove(run.tokens[run.prompt_len:run.shared_len])
