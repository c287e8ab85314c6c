"""Hypothesis state machine over the KV-cache bookkeeping: random admit/compute/append/fork/free, invariants checked."""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import event as hypothesis_event
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

from kvfleet_agent.core.kv_cache import KVCacheManager, hash_block

VOCAB = st.integers(min_value=0, max_value=2)


def event(what: str) -> None:
    """Coverage statistics (pytest --hypothesis-show-statistics); silent outside a hypothesis run."""
    with contextlib.suppress(InvalidArgument):
        hypothesis_event(what)


class KVCacheMachine(RuleBasedStateMachine):
    """Random scheduler traffic against a model of what each block physically holds.

    `content[b]` is what the model says block b holds: one entry per slot, None where nothing has
    been written since the block was last handed out. Computing tokens writes them into the
    request's own blocks; a prefix hit or a fork must then find exactly the request's tokens there.
    """

    reqs = Bundle("reqs")

    def __init__(self) -> None:
        super().__init__()
        self.kv: KVCacheManager | None = None
        self.bs = 1
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.content: list[list[int | None]] = []
        self.hash_tokens: dict[bytes, tuple[int, ...]] = {}  # hash → the token prefix behind it
        self.next_id = 0
        self.prefixes: list[list[int]] = []
        self.evictable: set[int] = set()  # idle cached blocks at the last snapshot

    @initialize(
        num_blocks=st.integers(min_value=1, max_value=12) | st.integers(min_value=12, max_value=40),
        log_bs=st.integers(min_value=0, max_value=2),
        caching=st.booleans() | st.just(True),
        prefixes=st.lists(st.lists(VOCAB, min_size=2, max_size=12), min_size=1, max_size=3),
    )
    def setup(self, num_blocks: int, log_bs: int, caching: bool, prefixes: list[list[int]]) -> None:
        self.bs = 1 << log_bs
        self.kv = KVCacheManager(num_blocks, self.bs, enable_prefix_caching=caching)
        self.content = [[None] * self.bs for _ in range(num_blocks)]
        self.prefixes = prefixes

    # -- helpers ---------------------------------------------------------------------------

    @property
    def m(self) -> KVCacheManager:
        assert self.kv is not None
        return self.kv

    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def _snapshot_refs(self) -> list[int]:
        self.evictable = {b.block_id for b in self.m.pool.blocks if b.block_hash and not b.ref_cnt}
        return [b.ref_cnt for b in self.m.pool.blocks]

    def _check_fresh(self, before_refs: list[int], before_free: list[int], new: list[int]) -> None:
        """Blocks just handed out were held by no one and came from the front of the LRU queue."""
        for b in new:
            if b in self.evictable:
                event("allocation evicted a cached block")
            assert before_refs[b] == 0, f"block {b} handed out while held"
            assert self.m.pool.blocks[b].ref_cnt == 1
            assert self.m.pool.blocks[b].block_hash is None
            self.content[b] = [None] * self.bs
        assert new == before_free[: len(new)], "allocation did not take the least recently freed"

    def _check_shared_content(self, req_id: str, n_blocks: int) -> None:
        """The first n_blocks of req_id's table physically hold req_id's tokens."""
        bs = self.bs
        toks_ = self.tokens[req_id]
        for i, b in enumerate(self.m.block_table(req_id)[:n_blocks]):
            assert self.content[b] == toks_[i * bs : (i + 1) * bs], (
                f"block {b} reused for {req_id} holds {self.content[b]}, "
                f"expected {toks_[i * bs : (i + 1) * bs]}"
            )

    def _compute(self, req_id: str, upto: int) -> None:
        """Write tokens [computed, upto) into the request's blocks, then commit."""
        bs = self.bs
        table = self.m.block_table(req_id)
        toks_ = self.tokens[req_id]
        for pos in range(self.computed[req_id], upto):
            b = table[pos // bs]
            assert self.m.pool.blocks[b].ref_cnt == 1, f"writing into shared block {b}"
            assert self.m.pool.blocks[b].block_hash is None, f"writing into registered block {b}"
            self.content[b][pos % bs] = toks_[pos]
        self.computed[req_id] = upto
        self.m.commit(req_id, toks_, upto)
        for i, h in enumerate(self.m.allocations[req_id].block_hashes):
            self.hash_tokens.setdefault(h, tuple(toks_[: (i + 1) * bs]))

    # -- rules -----------------------------------------------------------------------------

    @rule(
        target=reqs,
        which=st.integers(min_value=0, max_value=3),
        suffix=st.lists(VOCAB, min_size=0, max_size=6),
        prefill=st.booleans(),
    )
    def admit(self, which: int, suffix: list[int], prefill: bool = False) -> str:
        """A new request: a shared prefix (or none) and a random suffix; optionally prefill at once."""
        which %= len(self.prefixes) + 1
        prefix = self.prefixes[which] if which < len(self.prefixes) else []
        return self._admit(self._new_id(), [*prefix, *suffix] or [0], prefill)

    @rule(target=reqs, req=consumes(reqs), prefill=st.booleans())
    def preempt_and_resume(self, req: str, prefill: bool) -> str:
        """Recompute-style preemption: free the request, then admit it again with all its tokens."""
        if req not in self.tokens:
            return req
        tokens = list(self.tokens[req])
        self.free(req)
        return self._admit(self._new_id(), tokens, prefill)

    def _admit(self, req_id: str, tokens: list[int], prefill: bool) -> str:
        hits, n = self.m.find_cached_prefix(req_id, tokens)
        assert n == len(hits) * self.bs
        assert n < len(tokens), "a prefix hit must leave a token to compute"
        if not self.m.enable_prefix_caching:
            assert hits == []
        assert len(set(hits)) == len(hits)
        ok = self.m.can_allocate(len(tokens), hits)
        refs, order = self._snapshot_refs(), list(self.m.pool._free)
        assert self.m.allocate(req_id, len(tokens), hits) == ok
        if not ok:
            assert req_id not in self.m.allocations
            assert self._snapshot_refs() == refs
            assert list(self.m.pool._free) == order
            event("admit refused")
            return req_id  # a bundle entry with no allocation; other rules skip it
        self.m.record_lookup(len(tokens), n)
        event("admit with prefix hit" if hits else "admit without hit")
        if any(refs[b] == 0 for b in hits):
            event("admit hit an idle cached block")
        if any(refs[b] > 0 for b in hits):
            event("admit hit a running request's block")
        table = self.m.block_table(req_id)
        assert table[: len(hits)] == hits
        assert len(table) == self.m.blocks_for(len(tokens))
        for b in hits:
            assert self.m.pool.blocks[b].ref_cnt == refs[b] + 1
        order_after_touch = [b for b in order if b not in set(hits)]
        self._check_fresh(refs, order_after_touch, table[len(hits) :])
        self.tokens[req_id] = tokens
        self.computed[req_id] = n
        self._check_shared_content(req_id, len(hits))
        if prefill:
            self._compute(req_id, len(tokens))
        return req_id

    @rule(req=reqs, k=st.integers(min_value=1, max_value=9))
    def compute(self, req: str, k: int) -> None:
        """Run a chunk of prefill (or catch up on decode tokens)."""
        if req not in self.tokens:
            return
        upto = min(len(self.tokens[req]), self.computed[req] + k)
        self._compute(req, upto)

    @rule(req=reqs, new=st.lists(VOCAB, min_size=1, max_size=3))
    def append(self, req: str, new: list[int]) -> None:
        """Decode: sampled tokens extend the request; its table must grow to hold them."""
        if req not in self.tokens:
            return
        want = len(self.tokens[req]) + len(new)
        refs, order = self._snapshot_refs(), list(self.m.pool._free)
        table = list(self.m.block_table(req))
        hashes = list(self.m.allocations[req].block_hashes)
        cached = dict(self.m.pool._cached)
        need = self.m.blocks_for(want) - len(table)
        if self.m.grow(req, want):
            assert need <= len(order)
            new_table = self.m.block_table(req)
            assert new_table[: len(table)] == table
            assert len(new_table) == max(len(table), self.m.blocks_for(want))
            self._check_fresh(refs, order, new_table[len(table) :])
            self.tokens[req].extend(new)
        else:
            event("grow refused")
            assert need > len(order)
            assert self.m.block_table(req) == table
            assert self.m.allocations[req].block_hashes == hashes
            assert self._snapshot_refs() == refs
            assert list(self.m.pool._free) == order
            assert self.m.pool._cached == cached

    @rule(target=reqs, parent=reqs)
    def fork(self, parent: str) -> str:
        child = self._new_id()
        if parent not in self.tokens:
            return child
        toks_ = list(self.tokens[parent])
        n_hashes = len(self.m.allocations[parent].block_hashes)
        refs = self._snapshot_refs()
        shared = self.m.fork(parent, child, toks_)
        n = shared // self.bs
        assert shared == n * self.bs
        assert shared < len(toks_)
        assert n <= n_hashes
        assert n == min(n_hashes, (len(toks_) - 1) // self.bs)
        assert self.m.block_table(child) == self.m.block_table(parent)[:n]
        for b in self.m.block_table(child):
            assert self.m.pool.blocks[b].ref_cnt == refs[b] + 1
        event("fork shared blocks" if n else "fork shared nothing")
        self.tokens[child] = toks_
        self.computed[child] = shared
        self._check_shared_content(child, n)
        refs, order = self._snapshot_refs(), list(self.m.pool._free)
        if self.m.grow(child, len(toks_)):
            self._check_fresh(refs, order, self.m.block_table(child)[n:])
        else:
            # Not enough room for the child's own tail: give up on it.
            self.m.free(child)
            del self.tokens[child], self.computed[child]
        return child

    @rule(req=consumes(reqs))
    def free(self, req: str) -> None:
        if req not in self.tokens:
            self.m.free(req)  # never admitted: a no-op
            return
        table = list(self.m.block_table(req))
        refs, order = self._snapshot_refs(), list(self.m.pool._free)
        if any(refs[b] > 1 for b in table):
            event("free of a request sharing blocks")
        self.m.free(req)
        assert req not in self.m.allocations
        del self.tokens[req], self.computed[req]
        # Blocks whose last holder left join the LRU tail, tail blocks first.
        released = [b for b in table[::-1] if refs[b] == 1]
        assert list(self.m.pool._free) == order + released

    @rule()
    def reset_prefix_cache(self) -> None:
        self.m.pool.reset_prefix_cache()
        assert self.m.pool.num_cached == 0

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def pool_is_consistent(self) -> None:
        if self.kv is None:
            return
        pool = self.m.pool
        holders: Counter[int] = Counter()
        for req_id, alloc in self.m.allocations.items():
            assert req_id in self.tokens
            assert len(set(alloc.block_ids)) == len(alloc.block_ids), "a table holds a block twice"
            holders.update(alloc.block_ids)
        for b in pool.blocks:
            assert b.ref_cnt == holders[b.block_id], (
                f"block {b.block_id}: ref_cnt {b.ref_cnt} but {holders[b.block_id]} holders"
            )
            assert (b.ref_cnt == 0) == (b.block_id in pool._free)
        in_use = sum(1 for b in pool.blocks if b.ref_cnt > 0)
        assert pool.num_free + in_use == pool.num_blocks
        assert pool.usage() == pytest.approx(in_use / pool.num_blocks)

    @invariant()
    def hashes_are_consistent(self) -> None:
        if self.kv is None:
            return
        pool, bs = self.m.pool, self.bs
        if not self.m.enable_prefix_caching:
            assert pool.num_cached == 0
        for h, block_id in pool._cached.items():
            assert pool.blocks[block_id].block_hash == h
            # A registered block physically holds the last block of the prefix behind its hash.
            assert self.content[block_id] == list(self.hash_tokens[h][-bs:])
        for block in pool.blocks:
            if block.block_hash is not None:
                assert pool._cached[block.block_hash] == block.block_id

    @invariant()
    def requests_are_consistent(self) -> None:
        if self.kv is None:
            return
        bs = self.bs
        for req_id, toks_ in self.tokens.items():
            alloc = self.m.allocations[req_id]
            done = self.computed[req_id]
            assert len(alloc.block_ids) >= self.m.blocks_for(len(toks_))
            # Every computed token sits in its slot.
            for pos in range(done):
                assert self.content[alloc.block_ids[pos // bs]][pos % bs] == toks_[pos]
            if self.m.enable_prefix_caching:
                assert len(alloc.block_hashes) == done // bs
                parent = None
                for i, h in enumerate(alloc.block_hashes):
                    parent = hash_block(parent, toks_[i * bs : (i + 1) * bs])
                    assert h == parent
            else:
                assert alloc.block_hashes == []

    def teardown(self) -> None:
        if self.kv is None:
            return
        for req_id in list(self.tokens):
            self.m.free(req_id)
        self.tokens.clear()
        assert self.m.allocations == {}
        assert self.m.pool.num_free == self.m.pool.num_blocks, "blocks leaked"
        assert all(b.ref_cnt == 0 for b in self.m.pool.blocks)
        assert self.m.pool.usage() == 0.0


KVCacheMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVCacheMachine = KVCacheMachine.TestCase


def test_state_machine_prefix_hits_happen() -> None:
    """Sanity check on the generator: a scripted run of the machine does produce prefix hits."""
    machine = KVCacheMachine()
    machine.setup(num_blocks=16, log_bs=1, caching=True, prefixes=[[0, 1, 2, 0, 1]])
    first = machine.admit(0, [2], prefill=False)
    machine.compute(first, 9)
    machine.free(first)
    machine.admit(0, [1], prefill=True)
    assert machine.m.prefix_hits == 4
    machine.pool_is_consistent()
    machine.hashes_are_consistent()
    machine.requests_are_consistent()
    machine.teardown()
