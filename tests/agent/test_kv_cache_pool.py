"""Tests of the KV block pool and its allocation: construction, LRU reuse and eviction, can_allocate, grow, free."""

from __future__ import annotations

import pytest
from bookkeeping_helpers import BS, admit, free_order, run_prompt, toks

from kvfleet_agent.core.kv_cache import BlockPool, KVCacheManager

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
# free


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
