"""Whole workloads through the scheduler: random ones under every invariant, and a fixed one under memory pressure."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from bookkeeping_helpers import add, make, req, run_to_completion, sample_all, toks
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvfleet_agent.core.request import RequestStatus


@dataclass
class Workload:
    block_size: int
    num_blocks: int
    max_num_seqs: int
    budget: int
    chunked: bool
    prefix_caching: bool
    requests: list[tuple[int, list[int], int]] = field(default_factory=list)  # (arrival step, prompt, max_tokens)


BASE = toks(48, 1000)  # shared prompt prefix, so prefix hits and shared blocks happen


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    bs = draw(st.sampled_from([1, 2, 4, 8]))
    num_blocks = draw(st.integers(1, 24))
    cap = num_blocks * bs
    chunked = draw(st.booleans())
    budget = draw(st.integers(1, 48))
    if cap < 2:
        num_blocks = -(-2 // bs)
        cap = num_blocks * bs
    if not chunked:
        budget = max(budget, 2)  # like EngineConfig: without chunking a whole sequence fits in one step
    w = Workload(bs, num_blocks, draw(st.integers(1, 5)), budget, chunked, draw(st.booleans()))
    for _ in range(draw(st.integers(1, 8))):
        # Every request fits the pool on its own (the engine checks max_model_len against the pool).
        room = cap if chunked else min(cap, budget)
        max_tokens = draw(st.integers(1, min(8, room - 1)))
        plen = draw(st.integers(1, min(40, room - max_tokens)))
        shared = draw(st.integers(0, plen))
        tail = draw(st.lists(st.integers(0, 3), min_size=plen - shared, max_size=plen - shared))
        w.requests.append((draw(st.integers(0, 8)), BASE[:shared] + tail, max_tokens))
    return w


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_respect_every_invariant(w: Workload) -> None:
    """Each step keeps the budget, the concurrency limit and decodes first; each chunk continues its request.

    A model of what every physical KV slot holds (the token prefix whose K/V was written there) catches a
    chunk that attends to a slot holding the wrong prefix: a bad prefix hit, a block overwritten while
    shared, a stale block after preemption.
    """
    kv, sched = make(w.num_blocks, w.block_size, w.max_num_seqs, w.budget, w.chunked, w.prefix_caching)
    bs = w.block_size
    reqs = [req(f"r{i}", prompt, mt) for i, (_, prompt, mt) in enumerate(w.requests)]
    arrivals = sorted(((arr, i) for i, (arr, _, _) in enumerate(w.requests)))
    sampled: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    slot_holds: dict[int, tuple[int, ...]] = {}  # physical slot -> token prefix whose K/V it holds
    reported_finished: list[str] = []
    tick = 0
    steps = 0
    while arrivals or sched.has_work():
        while arrivals and arrivals[0][0] <= tick:
            sched.add(reqs[arrivals.pop(0)[1]])
        tick += 1
        if not sched.has_work():
            continue
        before = {rid: (r.status, r.num_computed_tokens) for rid, r in sched.requests.items()}
        out = sched.schedule()
        steps += 1
        assert steps < 2000, "no progress"
        reported_finished += out.finished
        if out.preempted:
            event("preemption")

        # Budget, concurrency, progress.
        assert out.chunks, "an empty step while requests wait or run"
        assert out.num_batched_tokens == sum(len(c.token_ids) for c in out.chunks) <= w.budget
        assert len(sched.running) <= w.max_num_seqs
        ids = [c.request_id for c in out.chunks]
        assert len(ids) == len(set(ids))
        assert not set(out.preempted) & set(ids)
        running_ids = {r.request_id for r in sched.running}
        assert set(ids) <= running_ids
        # Running decodes (one token left to compute) come before anything else.
        was_running = [c for c in out.chunks if before[c.request_id][0] is RequestStatus.RUNNING]
        kinds = [len(c.token_ids) == 1 and before[c.request_id][1] == sched.requests[c.request_id].num_tokens - 1
                 for c in was_running]
        assert kinds == sorted(kinds, reverse=True)

        written: set[int] = set()
        for c in out.chunks:
            r = sched.requests[c.request_id]
            status, computed = before[c.request_id]
            n = len(c.token_ids)
            assert n >= 1
            if status is RequestStatus.RUNNING:
                assert c.start_pos == computed  # contiguous with what was computed before
            else:  # admitted this step: starts after its prefix hit, on a block boundary
                assert computed == 0
                assert c.start_pos % bs == 0
                assert c.start_pos < r.num_tokens
                if not w.prefix_caching:
                    assert c.start_pos == 0
            assert c.start_pos == r.num_computed_tokens
            assert c.start_pos + n <= r.num_tokens
            assert c.token_ids == r.token_ids[c.start_pos:c.start_pos + n]
            assert c.sample == (c.start_pos + n == r.num_tokens)
            if not w.chunked:
                assert c.sample, "without chunked prefill every chunk reaches the end"
            table = c.block_table
            assert table == kv.block_table(c.request_id)
            assert len(table) >= kv.blocks_for(c.start_pos + n)
            # Every position before the chunk holds this sequence's own K/V ...
            for p in range(c.start_pos):
                slot = table[p // bs] * bs + p % bs
                assert slot_holds.get(slot) == tuple(r.token_ids[:p + 1]), (c.request_id, p)
            # ... and the chunk writes only into blocks nobody else holds.
            for p in range(c.start_pos, c.start_pos + n):
                block = kv.pool.blocks[table[p // bs]]
                assert block.ref_cnt == 1
                assert block.block_hash is None
                slot = block.block_id * bs + p % bs
                assert slot not in written
                written.add(slot)
                slot_holds[slot] = tuple(r.token_ids[:p + 1])

        tokens = sample_all(out)
        for rid, t in tokens.items():
            sampled[rid] += t
        advanced = sched.update(out, tokens)
        assert sorted(r.request_id for r in advanced) == sorted(tokens)
        for r in advanced:
            assert r.num_computed_tokens == r.num_tokens - 1
            if r.is_finished:
                assert r.num_output_tokens == r.sampling_params.max_tokens
                assert r.request_id not in sched.requests

    reported_finished += sched.schedule().finished
    if kv.prefix_hits:
        event("prefix hit")
    for r in reqs:
        assert r.status is RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == sampled[r.request_id]
        assert len(sampled[r.request_id]) == r.sampling_params.max_tokens
    assert sorted(reported_finished) == sorted(r.request_id for r in reqs)
    assert sched.num_preemptions == sum(r.num_preemptions for r in reqs)
    assert kv.pool.num_free == w.num_blocks
    assert not kv.allocations
    assert not sched.running and not sched.waiting and not sched.requests


@pytest.mark.parametrize("chunked", [True, False])
def test_many_requests_under_memory_pressure_all_finish(chunked: bool) -> None:
    # A fixed heavy mix that is sure to preempt (the property test may or may not hit this corner).
    kv, sched = make(num_blocks=12, block_size=4, max_num_seqs=6, budget=24, chunked=chunked)
    reqs = [req(f"r{i}", toks(5 + 3 * i, 100 * i), max_tokens=12) for i in range(6)]
    add(sched, *reqs)
    outs = run_to_completion(sched)
    assert sched.num_preemptions > 0
    assert all(o.chunks for o in outs)
    assert all(o.num_batched_tokens <= 24 for o in outs)
    assert all(r.num_output_tokens == 12 for r in reqs)
    assert kv.pool.num_free == 12
