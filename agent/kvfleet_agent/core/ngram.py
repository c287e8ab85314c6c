"""N-gram prompt lookup: propose draft tokens by finding the sequence's own suffix earlier in it (vLLM's "ngram")."""

from __future__ import annotations

from collections.abc import Sequence


class _Node:
    """A context read backwards from some position: children by the token one further back."""

    __slots__ = ("children", "last")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        # Where the continuation of this context's most recent registered occurrence starts.
        self.last = -1


class NgramIndex:
    """One request's tokens, indexed so the longest recurring suffix of length min_n..max_n is found in O(max_n).

    The index is a trie of contexts read right to left, cut at depth max_n: the node reached from the
    root by t[e-1], t[e-2], ..., t[e-n] stands for the n-gram t[e-n:e], and holds the largest such e
    registered so far. A trie rather than a dict of n-gram tuples per n: registering position e for
    every n is then one walk of max_n steps instead of building and hashing max_n tuples of up to
    max_n tokens, so extend and propose are O(max_n) per token (plus O(k) to copy a proposal).

    An occurrence ending at e is registered only when t[e] exists, i.e. when the token after it is
    appended. So the current suffix, which has no next token yet, is never its own "earlier
    occurrence", while an earlier occurrence that overlaps the suffix (t = a a a a) still counts.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self._tokens: list[int] = []
        self._root = _Node()

    @property
    def num_tokens(self) -> int:
        """How many tokens have been indexed."""
        return len(self._tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens to the sequence (the prompt first, then each generated token), indexing each."""
        for tok in tokens:
            self._register(len(self._tokens))
            self._tokens.append(tok)

    def sync(self, token_ids: Sequence[int]) -> None:
        """Catch up with a request's whole token list, indexing only what is new since the last call.

        A list shorter than what was indexed (output truncated after a stop) rebuilds the index. So does
        one whose last already-indexed token differs: an O(1) check that catches a list replaced
        in place, though not every such change (this index trusts its caller to only append or truncate).
        """
        seen = len(self._tokens)
        if len(token_ids) < seen or (seen and token_ids[seen - 1] != self._tokens[seen - 1]):
            self._tokens = []
            self._root = _Node()
            seen = 0
        self.extend(token_ids[seen:])

    def _register(self, end: int) -> None:
        """Record that t[end] follows the n-grams t[end-n:end] for n = 1..max_n (t[end] is about to be appended)."""
        node = self._root
        toks = self._tokens
        for i in range(end - 1, max(end - self.max_n, 0) - 1, -1):
            child = node.children.get(toks[i])
            if child is None:
                child = node.children[toks[i]] = _Node()
            child.last = end
            node = child

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the most recent earlier occurrence of the longest recurring suffix (lookup's
        tokens)."""
        return self.lookup(k)[0]

    def lookup(self, k: int) -> tuple[list[int], int]:
        """Up to k tokens that followed the most recent earlier occurrence of the longest recurring suffix, and that
        suffix's length n (0 with no tokens): the longer the match, the likelier its continuation is accepted.

        The suffix length n is the largest in [min_n, max_n] whose n-gram occurred before (with a token
        after it), and none come back when no suffix of length min_n or more recurred. A continuation
        that runs into the sequence's end goes on with its own proposal: the match says the sequence
        repeats with period end - start, so what the period predicts for position end + j is what it
        predicted for end + j - period (a loop a model fell into is proposed for all k, not cut short).
        """
        if k <= 0:
            return [], 0
        toks = self._tokens
        end = len(toks)
        node = self._root
        start, matched = -1, 0
        # A deeper node exists only if every shallower one does, so the walk stops at the first miss;
        # the deepest node at depth >= min_n is the longest match, and its `last` the most recent one.
        for depth, i in enumerate(range(end - 1, max(end - self.max_n, 0) - 1, -1), start=1):
            child = node.children.get(toks[i])
            if child is None:
                break
            node = child
            if depth >= self.min_n:
                start, matched = node.last, depth
        if start < 0:
            return [], 0
        out = toks[start:start + k]
        period = end - start
        while len(out) < k:
            out.append(out[len(out) - period])
        return out, matched
