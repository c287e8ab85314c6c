"""Paged KV-cache bookkeeping: a block pool with reference counts, LRU reuse and a prefix-hash cache.

Pure Python, no torch: the model runner owns the tensors, this module only decides which block
ids hold which tokens. A block is in exactly one of three states:

  in use     ref_cnt > 0; never handed out again until every holder frees it
  cached     ref_cnt == 0 but its hash is registered: reusable by a prefix hit, evictable
  free       ref_cnt == 0 and no hash

Cached and free blocks both sit in one LRU queue (oldest first); allocation pops from the front
and drops the popped block's hash, so a freed prefix survives as long as memory allows.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one full block, chained to its parent so equal blocks at different depths differ."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


@dataclass(slots=True)
class Block:
    """One block of `block_size` token slots in the pool."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    """Owns every block: allocation, sharing (touch), release, and the hash → block map."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        # ref_cnt == 0 blocks, least recently freed first; values unused (an ordered set).
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, int] = {}

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (free or evictable cached)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks whose contents are registered for prefix reuse (in use or not)."""
        return len(self._cached)

    def usage(self) -> float:
        """Fraction of blocks held by running requests (cached-but-idle blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        """Take n blocks for exclusive use; evicts the least recently freed cached blocks."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with {len(self._free)} free")  # caller checks first
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block_id)
        return out

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block holding this hash's contents, if any."""
        return self._cached.get(block_hash)

    def touch(self, block_ids: Sequence[int]) -> None:
        """Share blocks with one more holder (a prefix hit or a fork)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
            block.ref_cnt += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one holder from each block; blocks reaching zero join the LRU tail in the given order."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None

    def register(self, block_id: int, block_hash: BlockHash) -> None:
        """Record that a full block holds the tokens behind `block_hash` (first writer wins)."""
        block = self.blocks[block_id]
        if block.block_hash is None and block_hash not in self._cached:
            block.block_hash = block_hash
            self._cached[block_hash] = block_id

    def reset_prefix_cache(self) -> None:
        """Forget every registered hash (blocks stay where they are)."""
        for block_id in self._cached.values():
            self.blocks[block_id].block_hash = None
        self._cached.clear()


@dataclass(slots=True)
class KVAllocation:
    """What a request holds in the pool: its block table and the hashes of its full blocks."""

    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)


class KVCacheManager:
    """Maps requests (by id) to block tables on top of a BlockPool; the scheduler's only KV interface."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.allocations: dict[str, KVAllocation] = {}
        # Counted in tokens, like vLLM: queries = prompt tokens looked up, hits = tokens found.
        self.prefix_queries = 0
        self.prefix_hits = 0

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold num_tokens tokens."""
        return -(-num_tokens // self.block_size)

    def block_table(self, req_id: str) -> list[int]:
        """The request's block ids, in token order."""
        return self.allocations[req_id].block_ids

    def find_cached_prefix(self, req_id: str, token_ids: Sequence[int]) -> tuple[list[int], int]:
        """Blocks already holding a prefix of token_ids, and how many tokens they cover.

        At least one token is always left to compute, so the last position yields logits.
        """
        if not self.enable_prefix_caching:
            return [], 0
        hashes = self._full_block_hashes(token_ids, (len(token_ids) - 1) // self.block_size)
        hits: list[int] = []
        for h in hashes:
            block_id = self.pool.lookup(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits, len(hits) * self.block_size

    def record_lookup(self, num_queried: int, num_hit: int) -> None:
        """Count one admitted request's prefix lookup (in tokens), for the hit-rate metrics."""
        self.prefix_queries += num_queried
        self.prefix_hits += num_hit

    def can_allocate(self, num_tokens: int, cached_blocks: Sequence[int] = ()) -> bool:
        """Whether a new request could hold num_tokens tokens, reusing cached_blocks for its prefix."""
        # Cached blocks with ref_cnt 0 are counted in num_free but would be taken by touch().
        idle_hits = sum(1 for b in cached_blocks if self.pool.blocks[b].ref_cnt == 0)
        need = self.blocks_for(num_tokens) - len(cached_blocks)
        return need <= self.pool.num_free - idle_hits

    def allocate(self, req_id: str, num_tokens: int, cached_blocks: Sequence[int] = ()) -> bool:
        """Give a request blocks for its first num_tokens tokens, sharing cached_blocks as its prefix."""
        if not self.can_allocate(num_tokens, cached_blocks):
            return False
        self.pool.touch(cached_blocks)
        alloc = KVAllocation(list(cached_blocks))
        alloc.block_hashes = [h for h in (self.pool.blocks[b].block_hash for b in cached_blocks) if h]
        alloc.block_ids += self.pool.allocate(self.blocks_for(num_tokens) - len(cached_blocks))
        self.allocations[req_id] = alloc
        return True

    def grow(self, req_id: str, num_tokens: int) -> bool:
        """Extend a request's table to hold num_tokens tokens in all; False if the pool is short."""
        alloc = self.allocations[req_id]
        need = self.blocks_for(num_tokens) - len(alloc.block_ids)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        alloc.block_ids += self.pool.allocate(need)
        return True

    def fork(self, parent_id: str, child_id: str, token_ids: Sequence[int]) -> int:
        """Let child share the parent's full blocks of token_ids; returns the tokens shared."""
        parent = self.allocations[parent_id]
        n = min(len(parent.block_hashes), (len(token_ids) - 1) // self.block_size)
        shared = parent.block_ids[:n]
        self.pool.touch(shared)
        self.allocations[child_id] = KVAllocation(list(shared), list(parent.block_hashes[:n]))
        return n * self.block_size

    def commit(self, req_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """Register the hashes of blocks made full by computing the first num_computed of token_ids."""
        if not self.enable_prefix_caching:
            return
        alloc = self.allocations[req_id]
        num_full = num_computed // self.block_size
        done = len(alloc.block_hashes)
        if num_full <= done:
            return
        new = self._full_block_hashes(token_ids, num_full, start=done,
                                      parent=alloc.block_hashes[-1] if done else None)
        for i, h in enumerate(new, start=done):
            self.pool.register(alloc.block_ids[i], h)
        alloc.block_hashes += new

    def free(self, req_id: str) -> None:
        """Release a request's blocks; its full blocks stay cached for later prefix hits."""
        alloc = self.allocations.pop(req_id, None)
        if alloc is not None:
            # Tail first, so the deepest (least shareable) blocks are evicted before their prefix.
            self.pool.free(alloc.block_ids[::-1])

    def _full_block_hashes(self, token_ids: Sequence[int], num_blocks: int, start: int = 0,
                           parent: BlockHash | None = None) -> list[BlockHash]:
        bs = self.block_size
        out = []
        for i in range(start, num_blocks):
            parent = hash_block(parent, token_ids[i * bs:(i + 1) * bs])
            out.append(parent)
        return out
