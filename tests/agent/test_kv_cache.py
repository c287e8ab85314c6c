"""Tests of the paged KV-cache bookkeeping (kvfleet_agent.engine.kv_cache).

Unit tests of each documented behaviour; test_kv_cache_machine.py runs random interleavings.
"""

from __future__ import annotations

import pytest

from kvfleet_agent.engine.kv_cache import BlockPool, KVCacheManager, hash_block

BS = 4  # block size used by the unit tests


def toks(n: int, start: int = 0) -> list[int]:
    """n distinct-ish token ids starting at `start`."""
    return list(range(start, start + n))


def admit(kv: KVCacheManager, req_id: str, tokens: list[int]) -> tuple[list[int], int]:
    """The scheduler's admission path: look up the prefix, then allocate the whole prompt."""
    hits, n = kv.find_cached_prefix(req_id, tokens)
    assert kv.allocate(req_id, len(tokens), hits)
    kv.record_lookup(len(tokens), n)
    return hits, n


def run_prompt(kv: KVCacheManager, req_id: str, tokens: list[int]) -> tuple[list[int], int]:
    """Admit and fully compute a prompt (so its full blocks are registered)."""
    hits, n = admit(kv, req_id, tokens)
    kv.commit(req_id, tokens, len(tokens))
    return hits, n


def free_order(kv: KVCacheManager) -> list[int]:
    return list(kv.pool._free)


# ---------------------------------------------------------------------------------------------
# construction


@pytest.mark.parametrize("bs", [0, -1, -2, 3, 5, 6, 12, 100])
def test_block_size_must_be_power_of_two(bs: int) -> None:
    with pytest.raises(ValueError, match="power of two"):
        KVCacheManager(num_blocks=8, block_size=bs)


@pytest.mark.parametrize("bs", [1, 2, 4, 16, 256])
def test_power_of_two_block_sizes_accepted(bs: int) -> None:
    kv = KVCacheManager(num_blocks=8, block_size=bs)
    assert kv.block_size == bs
    assert kv.pool.num_free == 8


@pytest.mark.parametrize("n", [0, -3])
def test_pool_needs_a_block(n: int) -> None:
    with pytest.raises(ValueError):
        BlockPool(n)


def test_blocks_for_rounds_up() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    assert [kv.blocks_for(n) for n in (0, 1, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2, 3]


# ---------------------------------------------------------------------------------------------
# allocation order and LRU eviction


def test_fresh_pool_allocates_in_id_order() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    assert kv.allocate("a", 9)
    assert kv.block_table("a") == [0, 1, 2]
    assert kv.allocate("b", 4)
    assert kv.block_table("b") == [3]
    assert kv.pool.num_free == 4
    assert kv.pool.usage() == pytest.approx(0.5)
    assert [kv.pool.blocks[i].ref_cnt for i in range(8)] == [1, 1, 1, 1, 0, 0, 0, 0]


def test_allocate_refuses_when_short_and_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=BS)
    assert not kv.can_allocate(9)
    assert not kv.allocate("a", 9)
    assert "a" not in kv.allocations
    assert kv.pool.num_free == 2
    assert free_order(kv) == [0, 1]
    with pytest.raises(RuntimeError):
        kv.pool.allocate(3)


def test_oldest_freed_blocks_are_reused_first() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    assert kv.allocate("a", 8)  # blocks 0, 1
    assert kv.allocate("b", 8)  # blocks 2, 3
    kv.free("b")
    kv.free("a")
    # never-used 4, 5 were freed "earliest" (at construction); then b's, then a's.
    assert free_order(kv) == [4, 5, 3, 2, 1, 0]
    assert kv.allocate("c", 16)
    assert kv.block_table("c") == [4, 5, 3, 2]


def test_tail_blocks_are_evicted_before_prefix_blocks() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    prompt = toks(3 * BS)
    run_prompt(kv, "a", prompt)  # blocks 0, 1, 2, all full and registered
    assert kv.pool.num_cached == 3
    kv.free("a")
    assert free_order(kv) == [3, 2, 1, 0]
    # Two new blocks: the never-used block 3 then a's tail block 2.
    assert kv.allocate("x", 2 * BS)
    assert kv.block_table("x") == [3, 2]
    assert kv.pool.blocks[2].block_hash is None
    assert kv.pool.num_cached == 2
    hits, n = kv.find_cached_prefix("b", [*prompt, 99])
    assert hits == [0, 1]
    assert n == 2 * BS
    # One more block: the prefix's deeper block goes before its root.
    assert kv.allocate("y", 1)
    assert kv.block_table("y") == [1]
    assert kv.find_cached_prefix("b", [*prompt, 99]) == ([0], BS)


def test_eviction_forgets_the_hash() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=BS)
    prompt = toks(2 * BS)
    run_prompt(kv, "a", prompt)
    kv.free("a")
    assert kv.pool.num_cached == 2
    assert kv.allocate("x", 2 * BS)
    assert kv.pool.num_cached == 0
    assert kv.find_cached_prefix("b", [*prompt, 1]) == ([], 0)
    for b in kv.pool.blocks:
        assert b.block_hash is None


def test_hit_blocks_are_not_evicted_by_their_own_allocation() -> None:
    # The only free blocks besides the hits are too few unless the hits are touched first.
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    prompt = toks(2 * BS)
    run_prompt(kv, "a", prompt)
    kv.free("a")
    assert free_order(kv) == [2, 1, 0]
    hits, _ = admit(kv, "b", [*prompt, 7])
    assert hits == [0, 1]
    assert kv.block_table("b") == [0, 1, 2]


def test_a_hit_on_an_idle_cached_block_takes_it_out_of_the_free_queue() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    prompt = toks(2 * BS)
    run_prompt(kv, "a", prompt)
    kv.free("a")
    assert free_order(kv) == [2, 3, 4, 5, 1, 0]
    hits, _ = admit(kv, "b", [*prompt, 7])
    assert hits == [0, 1]
    assert free_order(kv) == [3, 4, 5]
    assert kv.pool.num_free == 3
    assert [kv.pool.blocks[b].ref_cnt for b in range(3)] == [1, 1, 1]
    kv.free("b")
    assert free_order(kv) == [3, 4, 5, 2, 1, 0]


# ---------------------------------------------------------------------------------------------
# prefix hits


def test_prefix_hit_after_free_returns_the_same_blocks() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = toks(2 * BS + 2)
    hits, n = run_prompt(kv, "a", prompt)
    assert (hits, n) == ([], 0)
    table_a = list(kv.block_table("a"))
    kv.free("a")
    hits, n = run_prompt(kv, "b", prompt)
    assert hits == table_a[:2]
    assert n == 2 * BS
    assert kv.block_table("b")[:2] == table_a[:2]
    # Counted in tokens: two lookups of 10 tokens, 8 found.
    assert kv.prefix_queries == 2 * len(prompt)
    assert kv.prefix_hits == 2 * BS


def test_prefix_hit_while_the_owner_is_still_running_shares_blocks() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = toks(2 * BS + 1)
    run_prompt(kv, "a", prompt)
    free_before = kv.pool.num_free
    hits, n = admit(kv, "b", prompt)
    assert hits == kv.block_table("a")[:2]
    assert n == 2 * BS
    assert [kv.pool.blocks[b].ref_cnt for b in hits] == [2, 2]
    assert kv.pool.num_free == free_before - 1  # only b's own tail block
    kv.free("a")
    assert [kv.pool.blocks[b].ref_cnt for b in hits] == [1, 1]
    kv.free("b")
    assert kv.pool.num_free == 8


def test_partial_prefix_hit_stops_at_first_difference() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = toks(3 * BS + 1)
    run_prompt(kv, "a", prompt)
    kv.free("a")
    other = list(prompt)
    other[BS + 1] = 999  # second block differs
    hits, n = kv.find_cached_prefix("b", other)
    assert hits == [kv.pool.lookup(hash_block(None, prompt[:BS]))]
    assert n == BS


def test_hash_chaining_same_block_under_different_parent_misses() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    shared_tail = [50, 51, 52, 53]
    run_prompt(kv, "a", [*toks(BS, 0), *shared_tail, 1])
    kv.free("a")
    # Same second block, different first block: nothing may hit.
    assert kv.find_cached_prefix("b", [*toks(BS, 10), *shared_tail, 1]) == ([], 0)
    # And the hash functions themselves disagree.
    p1 = hash_block(None, toks(BS, 0))
    p2 = hash_block(None, toks(BS, 10))
    assert hash_block(p1, shared_tail) != hash_block(p2, shared_tail)
    assert hash_block(None, shared_tail) != hash_block(p1, shared_tail)
    assert hash_block(p1, shared_tail) == hash_block(p1, list(shared_tail))


def test_hash_is_order_sensitive() -> None:
    assert hash_block(None, [1, 2, 3, 4]) != hash_block(None, [4, 3, 2, 1])
    assert hash_block(None, [1, 2]) != hash_block(None, [1, 2, 0])


@pytest.mark.parametrize("k", [1, 2, 3])
def test_at_least_one_token_is_left_to_compute(k: int) -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = toks(k * BS)
    run_prompt(kv, "a", [*prompt, 77])  # registers k full blocks
    kv.free("a")
    assert kv.pool.num_cached == k
    hits, n = kv.find_cached_prefix("b", prompt)  # exactly k full blocks
    assert len(hits) == k - 1
    assert n == (k - 1) * BS
    assert n < len(prompt)
    hits, n = kv.find_cached_prefix("c", [*prompt, 77])
    assert len(hits) == k
    assert n == k * BS


def test_empty_prompt_finds_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    assert kv.find_cached_prefix("a", []) == ([], 0)


def test_prefix_caching_disabled_never_hits() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    prompt = toks(2 * BS + 1)
    run_prompt(kv, "a", prompt)
    assert kv.pool.num_cached == 0
    assert kv.allocations["a"].block_hashes == []
    kv.free("a")
    assert kv.find_cached_prefix("b", prompt) == ([], 0)
    run_prompt(kv, "b", prompt)
    assert kv.prefix_hits == 0
    assert kv.pool.num_cached == 0


# ---------------------------------------------------------------------------------------------
# can_allocate


def test_can_allocate_counts_idle_cached_hits_as_taken() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    prefix = toks(2 * BS)
    run_prompt(kv, "a", [*prefix, 1])
    kv.free("a")
    assert kv.pool.num_free == 4  # idle cached blocks count as free ...
    fits = [*prefix, *toks(2 * BS, 100)]  # 4 blocks: 2 hit, 2 new
    hits, _ = kv.find_cached_prefix("b", fits)
    assert len(hits) == 2
    assert kv.can_allocate(len(fits), hits)
    too_big = [*prefix, *toks(2 * BS + 1, 100)]  # 5 blocks: 2 hit, 3 new, only 2 non-hit free
    hits, _ = kv.find_cached_prefix("b", too_big)
    assert len(hits) == 2
    assert not kv.can_allocate(len(too_big), hits)  # ... but the hits cannot be evicted for b
    assert not kv.allocate("b", len(too_big), hits)
    assert "b" not in kv.allocations
    assert kv.pool.num_free == 4
    assert [kv.pool.blocks[b].ref_cnt for b in hits] == [0, 0]


def test_can_allocate_does_not_discount_hits_held_by_a_running_request() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=BS)
    prefix = toks(2 * BS)
    run_prompt(kv, "a", [*prefix, 1])  # holds blocks 0, 1, 2; 2 free
    tokens = [*prefix, *toks(2 * BS, 100)]  # 4 blocks: 2 shared hits, 2 new
    hits, _ = kv.find_cached_prefix("b", tokens)
    assert hits == [0, 1]
    assert kv.can_allocate(len(tokens), hits)
    assert not kv.can_allocate(len(tokens) + 1, hits)
    assert kv.allocate("b", len(tokens), hits)
    assert kv.pool.num_free == 0


# ---------------------------------------------------------------------------------------------
# grow


def test_grow_adds_blocks_only_when_needed() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    assert kv.allocate("a", 3)
    assert kv.grow("a", 4)
    assert kv.block_table("a") == [0]
    assert kv.grow("a", 2)  # shrinking asks never release blocks
    assert kv.block_table("a") == [0]
    assert kv.grow("a", 5)
    assert kv.block_table("a") == [0, 1]


def test_grow_fails_cleanly_when_the_pool_is_short() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    prompt = toks(BS + 1)
    run_prompt(kv, "a", prompt)
    assert kv.allocate("b", BS)
    kv.free("b")  # a holds [0, 1]; LRU queue is [3, 2]
    table = list(kv.block_table("a"))
    hashes = list(kv.allocations["a"].block_hashes)
    order = free_order(kv)
    refs = [b.ref_cnt for b in kv.pool.blocks]
    cached = dict(kv.pool._cached)
    assert not kv.grow("a", 5 * BS)  # needs 3 more, 2 free
    assert kv.block_table("a") == table
    assert kv.allocations["a"].block_hashes == hashes
    assert free_order(kv) == order
    assert [b.ref_cnt for b in kv.pool.blocks] == refs
    assert kv.pool._cached == cached
    assert kv.pool.num_free == 2
    assert kv.grow("a", 4 * BS)  # exactly fits
    assert kv.pool.num_free == 0


# ---------------------------------------------------------------------------------------------
# commit


def test_commit_registers_only_full_blocks() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = toks(3 * BS)
    assert kv.allocate("a", len(prompt))
    kv.commit("a", prompt, BS - 1)
    assert kv.pool.num_cached == 0
    kv.commit("a", prompt, 2 * BS + 3)
    assert kv.pool.num_cached == 2
    h0 = hash_block(None, prompt[:BS])
    h1 = hash_block(h0, prompt[BS : 2 * BS])
    assert kv.allocations["a"].block_hashes == [h0, h1]
    table = kv.block_table("a")
    assert kv.pool.lookup(h0) == table[0]
    assert kv.pool.lookup(h1) == table[1]
    assert kv.pool.blocks[table[2]].block_hash is None


def test_commit_is_idempotent() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = toks(2 * BS + 1)
    assert kv.allocate("a", len(prompt))
    kv.commit("a", prompt, len(prompt))
    state = (list(kv.allocations["a"].block_hashes), dict(kv.pool._cached))
    kv.commit("a", prompt, len(prompt))
    kv.commit("a", prompt, BS)  # an older count never unregisters anything
    assert (list(kv.allocations["a"].block_hashes), dict(kv.pool._cached)) == state


def test_commit_incrementally_equals_commit_at_once() -> None:
    prompt = toks(4 * BS)
    kv1 = KVCacheManager(num_blocks=8, block_size=BS)
    assert kv1.allocate("a", len(prompt))
    for n in range(len(prompt) + 1):
        kv1.commit("a", prompt, n)
    kv2 = KVCacheManager(num_blocks=8, block_size=BS)
    assert kv2.allocate("a", len(prompt))
    kv2.commit("a", prompt, len(prompt))
    assert kv1.allocations["a"].block_hashes == kv2.allocations["a"].block_hashes
    assert kv1.pool._cached == kv2.pool._cached


def test_commit_after_a_hit_continues_the_chain() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    prefix = toks(BS)
    run_prompt(kv, "a", [*prefix, 1])
    kv.free("a")
    prompt = [*prefix, *toks(BS, 40), 3]
    hits, n = admit(kv, "b", prompt)
    assert (len(hits), n) == (1, BS)
    kv.commit("b", prompt, len(prompt))
    h0 = hash_block(None, prefix)
    assert kv.allocations["b"].block_hashes == [h0, hash_block(h0, toks(BS, 40))]
    table_b = list(kv.block_table("b"))
    kv.free("b")
    assert kv.find_cached_prefix("c", prompt) == (table_b[:2], 2 * BS)


def test_first_writer_wins_on_duplicate_hashes() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = toks(2 * BS + 1)
    # Both admitted before either computed anything: no hits, separate blocks.
    admit(kv, "a", prompt)
    admit(kv, "b", prompt)
    ta, tb = list(kv.block_table("a")), list(kv.block_table("b"))
    assert not set(ta) & set(tb)
    kv.commit("a", prompt, len(prompt))
    kv.commit("b", prompt, len(prompt))
    assert kv.pool.num_cached == 2
    h0 = hash_block(None, prompt[:BS])
    assert kv.pool.lookup(h0) == ta[0]
    assert all(kv.pool.blocks[b].block_hash is None for b in tb)
    # b still knows its hashes, so its chain continues correctly.
    assert kv.allocations["b"].block_hashes == kv.allocations["a"].block_hashes
    kv.free("b")
    kv.free("a")
    assert kv.find_cached_prefix("c", prompt)[0] == ta[:2]


def test_register_never_overwrites() -> None:
    pool = BlockPool(4)
    h1, h2 = hash_block(None, [1]), hash_block(None, [2])
    pool.register(0, h1)
    pool.register(0, h2)  # block already has a hash
    pool.register(1, h1)  # hash already has a block
    assert pool.lookup(h1) == 0
    assert pool.lookup(h2) is None
    assert pool.blocks[0].block_hash == h1
    assert pool.blocks[1].block_hash is None


def test_reset_prefix_cache() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = toks(2 * BS + 1)
    run_prompt(kv, "a", prompt)
    kv.free("a")
    kv.pool.reset_prefix_cache()
    assert kv.pool.num_cached == 0
    assert all(b.block_hash is None for b in kv.pool.blocks)
    assert kv.find_cached_prefix("b", prompt) == ([], 0)
    assert kv.pool.num_free == 8


# ---------------------------------------------------------------------------------------------
# fork and free


def test_fork_shares_full_committed_blocks() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = toks(2 * BS + 2)
    run_prompt(kv, "p", prompt)
    shared = kv.fork("p", "c", prompt)
    assert shared == 2 * BS
    assert kv.block_table("c") == kv.block_table("p")[:2]
    assert kv.allocations["c"].block_hashes == kv.allocations["p"].block_hashes
    assert [kv.pool.blocks[b].ref_cnt for b in kv.block_table("p")] == [2, 2, 1]
    assert kv.grow("c", len(prompt))
    assert len(kv.block_table("c")) == 3
    assert kv.block_table("c")[2] != kv.block_table("p")[2]
    kv.free("p")
    kv.free("c")
    assert kv.pool.num_free == 8


def test_fork_leaves_a_token_to_compute() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = toks(2 * BS)
    run_prompt(kv, "p", prompt)
    assert len(kv.allocations["p"].block_hashes) == 2
    assert kv.fork("p", "c", prompt) == BS


def test_fork_shares_nothing_uncommitted() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = toks(2 * BS + 1)
    admit(kv, "p", prompt)
    kv.commit("p", prompt, BS + 1)
    assert kv.fork("p", "c", prompt) == BS
    assert kv.block_table("c") == kv.block_table("p")[:1]


def test_double_free_raises() -> None:
    pool = BlockPool(4)
    ids = pool.allocate(2)
    pool.free(ids)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(ids[:1])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([3])  # never allocated
    pool.touch([ids[0]])
    pool.touch([ids[0]])
    pool.free([ids[0]])
    pool.free([ids[0]])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([ids[0]])
    assert pool.num_free == 4


def test_manager_free_of_unknown_request_is_a_no_op() -> None:
    # Documented here because it differs from the pool: KVCacheManager.free is idempotent per
    # request id (the request's table is dropped on the first free), so it never double-frees.
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    assert kv.allocate("a", 5)
    kv.free("a")
    kv.free("a")
    kv.free("never-seen")
    assert kv.pool.num_free == 4
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
