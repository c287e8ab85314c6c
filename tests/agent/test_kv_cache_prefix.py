"""Tests of prefix caching in the KV cache: block hashes, prefix hits, commit and fork."""

from __future__ import annotations

import pytest
from bookkeeping_helpers import BS, admit, run_prompt, toks

from kvfleet_agent.core.kv_cache import BlockPool, KVCacheManager, hash_block

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
# fork


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
