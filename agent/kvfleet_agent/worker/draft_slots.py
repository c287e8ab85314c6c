"""DraftSlots: which slots of the draft model's K/V pool hold the draft's K/V for the token the sequence has there.

The draft runs only in steps whose next step speculates (the adaptive switch may turn it off at large batch, where it
costs more than it yields), so its K/V falls behind the target's and must catch up before it proposes again. This is
the torch-free bookkeeping that says how far: per slot, the token the target last wrote there and whether the draft's
K/V at that slot is that token's, computed on the same prefix.

Rules, applied each step in this order:
  1. every slot the target writes becomes stale (a new prompt, a recomputation, a reused block);
  2. what the draft computed at its last proposal for a request (the newest token, then its own guesses) is valid again
     up to where the sequence kept it: the verification's accepted drafts, or the plain decode of that newest token;
  3. what the draft computes now becomes valid (catch-up and the newest token; its guesses wait for rule 2).
Rule 1 is deferred while the draft is off (nothing proposed, nothing to check): the steps' writes queue and are
applied in order before anything reads the flags, so a step the draft skips costs it a list append.
A request's scan for the first stale position starts at a cursor below which nothing can change while it runs (its
blocks are its own or shared and read-only), reset by any prompt chunk (a preemption's recomputation gets new blocks).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from kvfleet_agent.core.scheduler_output import ScheduledChunk

MAX_PENDING = 256  # steps of rule-1 writes queued at most (a long stretch off is settled in bounded memory)


class DraftSlots:
    """Per-slot validity of the draft's K/V over a pool of num_blocks x block_size slots (the target's layout)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.token = np.zeros(num_blocks * block_size, dtype=np.int64)  # what the target last wrote at each slot
        self.ok = np.zeros(num_blocks * block_size, dtype=bool)
        self.cursor: dict[str, int] = {}
        self.chain: dict[str, tuple[int, list[int]]] = {}  # (position, tokens) the draft computed at its last proposal
        self.pending: list[tuple[np.ndarray, np.ndarray]] = []  # rule 1's (tokens, slots) of steps not yet applied

    def slots(self, table: Sequence[int], start: int, stop: int) -> np.ndarray:
        """The slots of positions start..stop-1 under a block table."""
        pos = np.arange(start, stop, dtype=np.int64)
        return np.asarray(table, dtype=np.int64)[pos // self.block_size] * self.block_size + pos % self.block_size

    def target_wrote(self, input_ids: np.ndarray, slot_mapping: np.ndarray, samplers: Sequence[ScheduledChunk],
                     emitted: Mapping[str, Sequence[int]]) -> None:
        """Rules 1 and 2 for a step the target ran (its batch's tokens and slots, its sampling chunks and what each
        emitted: a verification accepted all but the last of its emitted tokens)."""
        self.pending.append((input_ids, slot_mapping))  # the step's arrays are its own: kept, not copied
        chain = self.chain
        if chain or len(self.pending) >= MAX_PENDING:
            self.settle()  # rule 2 marks slots valid after rule 1 marked them stale
        for c in samplers:
            if len(c.token_ids) != 1 + len(c.draft):  # a prompt (or its recomputation): scan it all again
                self.cursor[c.request_id] = 0
                chain.pop(c.request_id, None)
                continue
            if not chain:  # the draft proposed nothing last step (it was off): no guess to check
                continue
            prev = chain.pop(c.request_id, None)
            if prev is None or prev[0] != c.start_pos:
                continue
            out = emitted.get(c.request_id, ())
            kept = c.token_ids[:max(1, len(out))]  # the newest token, then the drafts it accepted
            n = 0
            while n < min(len(kept), len(prev[1])) and kept[n] == prev[1][n]:
                n += 1
            self.ok[self.slots(c.block_table, c.start_pos, c.start_pos + n)] = True

    def settle(self) -> None:
        """Apply the queued rule-1 writes, oldest first (a slot written twice keeps the later token)."""
        for input_ids, slot_mapping in self.pending:
            keep = slot_mapping >= 0
            self.token[slot_mapping[keep]] = input_ids[keep]
            self.ok[slot_mapping[keep]] = False
        self.pending.clear()

    def first_stale(self, request_id: str, table: Sequence[int], pos: int) -> int:
        """The first position below pos whose draft K/V is stale (pos if none): where the catch-up starts."""
        self.settle()
        lo = min(self.cursor.get(request_id, 0), pos)
        bad = np.flatnonzero(~self.ok[self.slots(table, lo, pos)])
        first = lo + int(bad[0]) if len(bad) else pos
        self.cursor[request_id] = first
        return first

    def tokens(self, table: Sequence[int], start: int, stop: int) -> list[int]:
        """The tokens the target wrote at positions start..stop-1 (what a catch-up computes)."""
        self.settle()
        return [int(t) for t in self.token[self.slots(table, start, stop)]]

    def computed(self, request_id: str, table: Sequence[int], start: int, stop: int) -> None:
        """Rule 3: the draft computed positions start..stop-1 of the sequence's own tokens."""
        self.settle()
        self.ok[self.slots(table, start, stop)] = True
        # Below stop - 1 the tokens are final; the newest one's slot is rewritten by the target next step (rule 2).
        self.cursor[request_id] = max(self.cursor.get(request_id, 0), stop - 1)

    def proposed(self, request_id: str, pos: int, tokens: list[int]) -> None:
        """The draft computed the newest token at pos and its own guesses after it: rule 2 checks them next step."""
        self.chain[request_id] = (pos, tokens)

    def forget(self, request_id: str) -> None:
        """Drop a finished request's cursor and chain (its slots' flags stay: they describe the pool)."""
        self.cursor.pop(request_id, None)
        self.chain.pop(request_id, None)
