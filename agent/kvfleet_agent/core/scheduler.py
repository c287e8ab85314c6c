"""Iteration-level scheduler: each step mixes decodes and prefill chunks under a token budget."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence

from kvfleet_agent.core.kv_cache import KVCacheManager
from kvfleet_agent.core.request import Request, RequestStatus
from kvfleet_agent.core.scheduler_output import ScheduledChunk, SchedulerOutput, TokenHistory
from kvfleet_agent.core.speculator import Speculator, eligible


class Scheduler:
    """Owns the waiting queue and the running set; asks the KV cache for blocks."""

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True, speculator: Speculator | None = None) -> None:
        self.kv = kv
        self.speculator = speculator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: oldest first, preemption takes the newest
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_partial_prefills = 0  # prefill chunks that stopped short of the prompt's end
        self._finished: list[str] = []
        # Free blocks kept back at admission so running requests can grow a little before anyone is
        # preempted; admitting into the last block guarantees a preemption a few steps later.
        self.watermark_blocks = max(1, kv.pool.num_blocks // 100)

    def add(self, req: Request) -> None:
        """Queue a new request behind everything already waiting."""
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_work(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Plan one step.

        Invariant: there are no prefill and decode phases, only requests whose KV lags their tokens.
        Each step moves num_computed_tokens towards num_tokens for as many requests as the token
        budget, max_num_seqs and the KV pool allow: running decodes first (one token each, so
        inter-token latency does not wait behind long prompts), then running prefills, then waiting
        requests in order (preempted ones first). A request is admitted only if blocks for all its
        known tokens are free; if a running request cannot grow, the newest running request is
        preempted (recompute later, its full blocks kept in the prefix cache).
        """
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []

        scheduled: set[str] = set()
        drafts = self._drafts(budget)
        # Decodes not yet passed this step (each may need a block of its own): what a draft must leave free.
        decodes_left = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1) if drafts else 0
        for decodes_pass in (True, False):
            i = 0
            while i < len(self.running) and budget > 0:
                req = self.running[i]
                i += 1
                remaining = req.num_tokens - req.num_computed_tokens
                if (remaining == 1) != decodes_pass or req.request_id in scheduled:
                    continue
                n = min(remaining, budget)
                if decodes_pass:
                    decodes_left -= 1
                draft = drafts.get(req.request_id, [])[:budget - 1]
                if not decodes_pass:
                    # Prefills hold blocks for all their known tokens since admission, so they never
                    # grow here, and so never preempt a request this step has already scheduled.
                    assert len(self.kv.block_table(req.request_id)) >= self.kv.blocks_for(req.num_tokens)
                elif draft and self._draft_fits(req, len(draft), decodes_left) and \
                        self.kv.grow(req.request_id, req.num_computed_tokens + 1 + len(draft)):
                    n += len(draft)
                elif not self._grow_or_preempt(req, req.num_computed_tokens + n, preempted):
                    break  # req itself was the newest and went back to the queue
                else:
                    draft = []
                chunks.append(self._chunk(req, n, draft))
                scheduled.add(req.request_id)
                budget -= n

        if not preempted:  # under memory pressure, let the running requests drain first
            budget = self._admit(budget, chunks)
        self._lookahead(chunks)

        finished, self._finished = self._finished, []
        draft_k = -1 if self.speculator is None else self.speculator.draft_k
        return SchedulerOutput(chunks, self.max_num_batched_tokens - budget, preempted, finished, draft_k)

    def _drafts(self, budget: int) -> dict[str, list[int]]:
        """This step's speculation: draft tokens for running decodes (none without a speculator)."""
        if self.speculator is None:
            return {}
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefilling = sum(r.num_tokens - r.num_computed_tokens for r in self.running) - len(decodes)
        return self.speculator.propose(decodes, min(prefilling, budget), max(0, budget - len(decodes)))

    def _draft_fits(self, req: Request, num_draft: int, spare: int) -> bool:
        """Whether a request's drafts may take blocks: only free ones beyond `spare`, one for each decode still to
        grow this step (what its own token may need), so speculation never makes anyone preempted."""
        need = self.kv.blocks_for(req.num_computed_tokens + 1 + num_draft) - len(self.kv.block_table(req.request_id))
        return need <= self.kv.pool.num_free - spare

    def _lookahead(self, chunks: list[ScheduledChunk]) -> None:
        """A draft model's lookahead slots (vLLM's): after the step, the draft runs the request's newest token and its
        own proposals at the k positions from the chunk's end on, writing their K/V into the request's blocks, so
        the blocks must already cover them. Taken after every chunk and admission, from free blocks beyond one per
        running request (what their next step's own growth may need): speculation never preempts, and never takes
        what a plain decode would need; a request whose lookahead does not fit gets fewer or no proposals."""
        spec = self.speculator
        if spec is None or spec.config.method != "draft_model" or spec.draft_k == 0:
            return  # no draft model, or it does not run after this step (speculation off): no slots to reserve
        k = spec.config.num_speculative_tokens
        for c in chunks:
            req = self.requests[c.request_id]
            if not c.sample or req.status is not RequestStatus.RUNNING or not eligible(req):
                continue
            table = self.kv.block_table(req.request_id)
            need = self.kv.blocks_for(min(c.start_pos + len(c.token_ids) + k, req.max_model_len)) - len(table)
            if 0 < need <= self.kv.pool.num_free - len(self.running):
                self.kv.grow(req.request_id, (len(table) + need) * self.kv.block_size)

    def _admit(self, budget: int, chunks: list[ScheduledChunk]) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            # Prompt logprobs need logits at every prompt position: a cached prefix would skip them.
            hits, num_cached = self.kv.find_cached_prefix(req.request_id, req.token_ids) \
                if req.sampling_params.prompt_logprobs is None else ([], 0)
            n = min(req.num_tokens - num_cached, budget)
            if n < req.num_tokens - num_cached and not self.enable_chunked_prefill:
                break
            # Admission counts the whole known footprint (prompt + any output before a preemption),
            # so a long prompt is never admitted on its first chunk and then thrashed.
            need = self.kv.blocks_for(req.num_tokens) - len(hits)
            if need > self.kv.pool.num_free - self.watermark_blocks and self.running:
                break
            if not self.kv.allocate(req.request_id, req.num_tokens, hits):
                break
            self.waiting.popleft()
            if req.status is RequestStatus.WAITING:
                self.kv.record_lookup(req.num_tokens, num_cached)
                req.num_cached_tokens = num_cached
            req.num_computed_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            chunks.append(self._chunk(req, n))
            budget -= n
        return budget

    def _grow_or_preempt(self, req: Request, num_tokens: int, preempted: list[str]) -> bool:
        while not self.kv.grow(req.request_id, num_tokens):
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        self.kv.free(req.request_id)  # full blocks stay hashed: re-admission hits them if still there
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)  # ahead of newer arrivals

    def _chunk(self, req: Request, n: int, draft: list[int] | None = None) -> ScheduledChunk:
        start = req.num_computed_tokens
        if draft:  # a verification: the last known token, then the drafts (eligible requests keep no history)
            return ScheduledChunk(req.request_id, [req.token_ids[start], *draft], start,
                                  self.kv.block_table(req.request_id), True, req.sampling_params, draft=draft)
        if start + n < req.num_tokens:
            self.num_partial_prefills += 1
        sample = start + n == req.num_tokens
        history = TokenHistory(req.token_ids, req.num_prompt_tokens, req.eos_token_ids) \
            if sample and req.sampling_params.needs_history else None
        prompt_ids = req.prompt_token_ids if req.sampling_params.prompt_logprobs is not None and \
            start < req.num_prompt_tokens - 1 else None
        return ScheduledChunk(req.request_id, req.token_ids[start:start + n], start,
                              self.kv.block_table(req.request_id), sample, req.sampling_params, history, prompt_ids)

    def update(self, out: SchedulerOutput, sampled: Mapping[str, Sequence[int]]) -> list[Request]:
        """Apply a step's results: advance computed tokens, append sampled ones, retire finished requests.

        A verified speculation emits 1 to len(draft) + 1 tokens: the accepted drafts, whose K/V the step computed
        (they equal the drafts it ran), then one more. Only those positions count as computed: the rejected drafts'
        slots are rewritten by the next step, and their blocks never enter the prefix cache (commit hashes computed
        tokens only). Tokens after one that ends the request (EOS, a stop id, max_tokens) are dropped, as if it had
        been generated alone. Returns the requests that got new tokens this step (finished ones included), each
        with num_new_tokens set.
        """
        advanced = []
        for chunk in out.chunks:
            req = self.requests[chunk.request_id]
            if not chunk.sample:
                req.num_computed_tokens += len(chunk.token_ids)
            else:
                tokens = sampled[chunk.request_id]
                accepted = len(tokens) - 1
                assert 0 <= accepted <= len(chunk.draft) and tokens[:accepted] == chunk.draft[:accepted]
                req.num_computed_tokens += len(chunk.token_ids) - len(chunk.draft) + accepted
                req.num_new_tokens = 0
                for token in tokens:
                    req.append_token(token)
                    req.num_new_tokens += 1
                    if req.is_finished:  # the rest is dropped, and so is the K/V of the drafts after it
                        req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
                        break
                if self.speculator is not None:
                    self.speculator.verified(req, chunk.draft, accepted)
                advanced.append(req)
            self.kv.commit(req.request_id, req.token_ids, req.num_computed_tokens)
        done = [r for r in advanced if r.is_finished]
        if done:
            self.running = [r for r in self.running if not r.is_finished]
            for req in done:
                self._retire(req)
        return advanced

    def abort(self, request_ids: Iterable[str]) -> list[Request]:
        """End requests early wherever they are; their blocks go back to the pool."""
        aborted = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            if req.status is RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            req.status = RequestStatus.FINISHED_ABORTED
            self._retire(req)
            aborted.append(req)
        return aborted

    def stop(self, req: Request) -> None:
        """End a running request that a stop string matched after its token was appended."""
        self.running.remove(req)
        req.status = RequestStatus.FINISHED_STOPPED
        self._retire(req)

    def _retire(self, req: Request) -> None:
        if self.speculator is not None:
            self.speculator.finish(req)
        del self.requests[req.request_id]
        self.kv.free(req.request_id)
        self._finished.append(req.request_id)
