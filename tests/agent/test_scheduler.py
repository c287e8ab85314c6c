"""Unit tests of the iteration-level scheduler (kvfleet_agent.core.scheduler): a real KVCacheManager, no model."""

from __future__ import annotations

from bookkeeping_helpers import add, chunk_of, make, req, run_to_completion, status, step, toks

from kvfleet_agent.core.request import RequestStatus
from kvfleet_agent.core.scheduler import Scheduler

# ---------------------------------------------------------------------------------------------
# documentation


def test_schedule_documents_its_invariant() -> None:
    doc = Scheduler.schedule.__doc__
    assert doc is not None
    assert "Invariant" in doc
    assert "num_computed_tokens" in doc


# ---------------------------------------------------------------------------------------------
# budget, chunking and ordering


def test_long_prompt_is_split_into_budget_sized_chunks() -> None:
    kv, sched = make(num_blocks=32, block_size=4, max_num_seqs=4, budget=16)
    r = req("a", toks(50, 7), max_tokens=3)
    sched.add(r)
    outs = run_to_completion(sched)
    got = [chunk_of(o, "a") for o in outs]
    assert got == [[(0, 16, False)], [(16, 16, False)], [(32, 16, False)], [(48, 2, True)],
                   [(50, 1, True)], [(51, 1, True)]]
    for o in outs:
        assert o.num_batched_tokens == sum(len(c.token_ids) for c in o.chunks) <= 16
    # Each chunk carried exactly the tokens at its positions.
    assert outs[1].chunks[0].token_ids == r.token_ids[16:32]
    assert r.num_output_tokens == 3
    assert r.status is RequestStatus.FINISHED_LENGTH
    assert kv.pool.num_free == 32


def test_decodes_are_scheduled_before_prefill_chunks() -> None:
    _, sched = make(num_blocks=64, block_size=4, max_num_seqs=4, budget=8)
    a, b = req("a", toks(4), max_tokens=5), req("b", toks(30, 100), max_tokens=2)
    add(sched, a, b)
    first = step(sched)
    assert [(c.request_id, c.start_pos, len(c.token_ids)) for c in first.chunks] == [("a", 0, 4), ("b", 0, 4)]
    # a now decodes, b is mid-prompt. Put the prefilling request first in the running list (as if it were
    # older): the decode must still come first and get its token, the prefill takes what is left.
    sched.running.sort(key=lambda r: r.request_id != "b")
    assert [r.request_id for r in sched.running] == ["b", "a"]
    out = step(sched)
    assert [(c.request_id, c.start_pos, len(c.token_ids), c.sample) for c in out.chunks] == [
        ("a", 4, 1, True), ("b", 4, 7, False)]
    assert out.num_batched_tokens == 8


def test_decode_is_not_starved_by_an_older_long_prefill() -> None:
    # Budget 8: if prefills went first, b's remaining 26 prompt tokens would take the whole budget.
    _, sched = make(num_blocks=64, block_size=4, max_num_seqs=4, budget=8)
    a, b = req("a", toks(4), max_tokens=4), req("b", toks(30, 100), max_tokens=1)
    add(sched, a, b)
    step(sched)
    sched.running.reverse()
    for _ in range(3):
        out = step(sched)
        assert out.chunks[0].request_id == "a"
        assert len(out.chunks[0].token_ids) == 1
    assert a.is_finished and a.num_output_tokens == 4


def test_without_chunked_prefill_a_prompt_over_the_budget_is_never_split() -> None:
    kv, sched = make(num_blocks=32, block_size=4, max_num_seqs=4, budget=16, chunked=False)
    sched.add(req("big", toks(20), max_tokens=2))
    for _ in range(3):
        out = step(sched)
        assert out.chunks == []
        assert out.num_batched_tokens == 0
    assert "big" not in kv.allocations
    assert kv.pool.num_free == 32
    assert [r.request_id for r in sched.waiting] == ["big"]


def test_without_chunked_prefill_a_prompt_waits_until_it_fits_whole() -> None:
    _, sched = make(num_blocks=32, block_size=4, max_num_seqs=4, budget=16, chunked=False)
    a, b = req("a", toks(4), max_tokens=3), req("b", toks(16, 100), max_tokens=2)
    sched.add(a)
    out = step(sched)
    assert chunk_of(out, "a") == [(0, 4, True)]
    sched.add(b)
    # a's decode takes 1 of the 16 tokens, so b's 16-token prompt does not fit and must not be split.
    while not a.is_finished:
        out = step(sched)
        assert chunk_of(out, "b") == []
        assert b.status is RequestStatus.WAITING
    out = step(sched)
    assert chunk_of(out, "b") == [(0, 16, True)]
    run_to_completion(sched)
    assert b.num_output_tokens == 2


def test_max_num_seqs_limits_admission() -> None:
    _, sched = make(num_blocks=64, block_size=4, max_num_seqs=2, budget=64)
    reqs = [req(f"r{i}", toks(3, 10 * i), max_tokens=3) for i in range(5)]
    add(sched, *reqs)
    out = step(sched)
    assert [c.request_id for c in out.chunks] == ["r0", "r1"]
    assert len(sched.running) == 2
    for o in run_to_completion(sched):
        assert len(o.chunks) <= 2
    assert all(r.num_output_tokens == 3 for r in reqs)


# ---------------------------------------------------------------------------------------------
# admission


def test_admission_counts_the_whole_prompt_not_the_first_chunk() -> None:
    bs = 4
    kv, sched = make(num_blocks=10, block_size=bs, max_num_seqs=4, budget=8)
    a = req("a", toks(12), max_tokens=6)
    sched.add(a)
    step(sched)  # a's 12-token prompt in 8 + 4 tokens
    step(sched)
    assert a.num_computed_tokens == 12
    big = req("big", toks(32, 100), max_tokens=1)
    sched.add(big)
    free = kv.pool.num_free
    # The first chunk (8 tokens, 2 blocks) would fit beside the watermark, the whole prompt (8 blocks) would not.
    assert kv.blocks_for(8) <= free - sched.watermark_blocks
    assert kv.blocks_for(big.num_tokens) > free
    while not a.is_finished:
        out = step(sched)
        assert chunk_of(out, "big") == []
        assert "big" not in kv.allocations
        assert big.status is RequestStatus.WAITING
    outs = run_to_completion(sched)
    assert chunk_of(outs[0], "big") == [(0, 8, False)]
    assert big.num_output_tokens == 1
    assert kv.pool.num_free == 10


def test_prefix_cache_hit_at_admission_skips_the_cached_tokens() -> None:
    bs = 4
    kv, sched = make(num_blocks=32, block_size=bs, max_num_seqs=4, budget=64)
    shared = toks(10, 200)
    sched.add(req("a", shared, max_tokens=2))
    run_to_completion(sched)
    assert kv.prefix_hits == 0
    queries = kv.prefix_queries
    b = req("b", [*shared[:9], 999, 998, 997], max_tokens=2)  # two full blocks (8 tokens) in common
    sched.add(b)
    out = step(sched)
    assert chunk_of(out, "b") == [(8, 4, True)]
    assert out.chunks[0].token_ids == b.prompt_token_ids[8:]
    assert kv.prefix_hits == 8
    assert kv.prefix_queries == queries + 12
    assert b.num_cached_tokens == 8
    # A prompt that is entirely cached still computes its last token (the logits come from it).
    c = req("c", shared[:8], max_tokens=1)
    sched.add(c)
    out = step(sched)
    assert chunk_of(out, "c") == [(4, 4, True)]
    assert kv.prefix_hits == 8 + 4
    run_to_completion(sched)
    assert kv.pool.num_free == 32


def test_no_prefix_hit_when_prefix_caching_is_disabled() -> None:
    kv, sched = make(num_blocks=32, block_size=4, max_num_seqs=4, budget=64, prefix_caching=False)
    shared = toks(10, 200)
    sched.add(req("a", shared, max_tokens=2))
    run_to_completion(sched)
    sched.add(req("b", shared, max_tokens=2))
    out = step(sched)
    assert chunk_of(out, "b") == [(0, 10, True)]
    assert kv.prefix_hits == 0


# ---------------------------------------------------------------------------------------------
# preemption


def test_preemption_takes_the_newest_and_requeues_it_first() -> None:
    bs = 4
    kv, sched = make(num_blocks=6, block_size=bs, max_num_seqs=4, budget=32)
    a = req("a", toks(8, 0), max_tokens=6)
    b = req("b", toks(8, 100), max_tokens=10)
    c = req("c", toks(8, 200), max_tokens=2)  # arrives after both; its 2 blocks do not fit beside them
    add(sched, a, b, c)
    out = step(sched)
    assert [ch.request_id for ch in out.chunks] == ["a", "b"]
    assert [r.request_id for r in sched.waiting] == ["c"]
    preempt_step = None
    for i in range(10):
        out = step(sched)
        if out.preempted:
            preempt_step = i
            break
    assert preempt_step is not None, "the pool of 6 blocks cannot hold a and b past 12 tokens each"
    # a (older) needed a 4th block for position 12: the newest running request, b, made room.
    assert out.preempted == ["b"]
    assert chunk_of(out, "b") == []
    assert chunk_of(out, "a") == [(12, 1, True)]
    assert sched.num_preemptions == 1
    assert b.num_preemptions == 1
    assert b.status is RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0
    assert b.num_output_tokens == 5  # its generated tokens are kept; only their KV is recomputed
    assert "b" not in kv.allocations
    assert [r.request_id for r in sched.waiting] == ["b", "c"]  # ahead of the later arrival
    assert a.is_finished  # that was a's last token, so b comes back while its prefix is still cached
    assert sched.running == []
    hits_before = kv.prefix_hits

    out = step(sched)
    # Re-admission found b's first two full blocks (the third was taken by a's growth).
    assert chunk_of(out, "b") == [(8, 5, True)]
    assert out.chunks[0].token_ids == b.token_ids[8:13]
    assert kv.prefix_hits == hits_before  # recompute of a preempted request is not a new prompt lookup
    assert b.num_cached_tokens == 0
    assert status(b) is RequestStatus.RUNNING
    run_to_completion(sched)
    for r, n in ((a, 6), (b, 10), (c, 2)):
        assert r.status is RequestStatus.FINISHED_LENGTH
        assert r.num_output_tokens == n
    assert kv.pool.num_free == 6
    assert not kv.allocations


def test_preempted_request_recomputes_from_zero_when_its_blocks_were_evicted() -> None:
    bs = 4
    kv, sched = make(num_blocks=6, block_size=bs, max_num_seqs=4, budget=32)
    a = req("a", toks(8, 0), max_tokens=14)  # keeps growing after the preemption, to all 6 blocks
    b = req("b", toks(8, 100), max_tokens=10)
    add(sched, a, b)
    preempted_at = None
    for i in range(30):
        out = step(sched)
        if out.preempted:
            preempted_at = i
            assert out.preempted == ["b"]
        if b.status is RequestStatus.RUNNING and preempted_at is not None:
            # b came back only after a finished and a's growth reused b's freed blocks.
            assert a.is_finished
            assert chunk_of(out, "b")[0][0] == 0
            break
    assert preempted_at is not None
    run_to_completion(sched)
    assert a.num_output_tokens == 14 and b.num_output_tokens == 10
    assert kv.pool.num_free == 6


# ---------------------------------------------------------------------------------------------
# abort and stop


def test_abort_waiting_and_running_requests() -> None:
    kv, sched = make(num_blocks=16, block_size=4, max_num_seqs=1, budget=64)
    run_, wait = req("run", toks(9), max_tokens=5), req("wait", toks(5, 50), max_tokens=5)
    add(sched, run_, wait)
    step(sched)
    assert run_.status is RequestStatus.RUNNING and wait.status is RequestStatus.WAITING
    assert kv.pool.num_free == 16 - 3

    aborted = sched.abort(["wait"])
    assert aborted == [wait]
    assert status(wait) is RequestStatus.FINISHED_ABORTED
    assert "wait" not in sched.requests
    assert wait not in sched.waiting

    aborted = sched.abort(["run", "no-such-request"])
    assert aborted == [run_]
    assert status(run_) is RequestStatus.FINISHED_ABORTED
    assert run_ not in sched.running
    assert "run" not in sched.requests and "run" not in kv.allocations
    assert kv.pool.num_free == 16
    assert sched.abort(["run"]) == []  # a second abort is a no-op
    assert not sched.has_work()
    out = sched.schedule()
    assert out.chunks == []
    assert sorted(out.finished) == ["run", "wait"]
    assert sched.schedule().finished == []  # reported once


def test_abort_of_a_preempted_request_removes_it_from_the_queue() -> None:
    kv, sched = make(num_blocks=6, block_size=4, max_num_seqs=4, budget=32)
    a, b = req("a", toks(8, 0), max_tokens=12), req("b", toks(8, 100), max_tokens=10)
    add(sched, a, b)
    while b.status is not RequestStatus.PREEMPTED:
        step(sched)
    assert sched.abort(["b"]) == [b]
    assert b not in sched.waiting
    run_to_completion(sched)
    assert a.num_output_tokens == 12
    assert b.num_output_tokens < 10
    assert kv.pool.num_free == 6


def test_stop_of_a_running_request() -> None:
    kv, sched = make(num_blocks=16, block_size=4, max_num_seqs=4, budget=64)
    a, b = req("a", toks(6), max_tokens=8), req("b", toks(6, 40), max_tokens=4)
    add(sched, a, b)
    step(sched)
    step(sched)
    sched.stop(a)
    assert a.status is RequestStatus.FINISHED_STOPPED
    assert a not in sched.running and "a" not in sched.requests and "a" not in kv.allocations
    assert kv.pool.num_free == 16 - len(kv.block_table("b"))
    out = step(sched)
    assert "a" in out.finished
    assert [c.request_id for c in out.chunks] == ["b"]
    run_to_completion(sched)
    assert b.num_output_tokens == 4
    assert a.num_output_tokens == 2
    assert kv.pool.num_free == 16
