"""Speculative decoding in the scheduler's state machine, torch-free.

Random workloads with drafts run under the invariants of test_scheduler_properties.py, adapted to speculation: a
KV slot counts as holding a sequence's own K/V only below its num_computed_tokens, so the slots that rejected
drafts wrote must be rewritten before any chunk reads them, and the prefix cache may only ever hash blocks whose
recorded contents are the hashed tokens. A greedy "model" (the next token a function of the prefix, drafts
accepted iff they equal it) then makes runs with and without speculation comparable token for token: every
request's output and finish reason must match an independent oracle, with EOS, stop ids, stop sequences (the
engine's stop strings, emulated on token ids), max_tokens, max_model_len and aborts landing inside speculated
runs, under KV pressure that preempts.
"""

from __future__ import annotations

import copy
import random
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from kvfleet_agent.core.kv_cache import BlockHash, KVCacheManager, hash_block
from kvfleet_agent.core.request import Request, RequestStatus
from kvfleet_agent.core.scheduler import Scheduler
from kvfleet_agent.core.scheduler_output import ScheduledChunk
from kvfleet_agent.core.speculator import Speculator
from kvfleet_agent.sampling_params import SamplingParams
from kvfleet_agent.spec_config import SpeculativeConfig

V = 6  # vocabulary: small, so sequences repeat and the n-gram proposer finds continuations
EOS = V - 1
BASE = [(3 * i * i + i) % V for i in range(40)]  # shared prompt prefix: prefix-cache hits and shared blocks

Pick = Callable[[int, int], int]  # an integer in [lo, hi]: hypothesis' draw or a seeded random.Random
Reason = int | str | None
Ending = tuple[RequestStatus, Reason]
Outcome = tuple[list[int], RequestStatus, Reason]
Model = Callable[[Request, ScheduledChunk], list[int]]  # the tokens a sampling chunk yields
Proposer = Callable[[Scheduler], dict[str, list[int]]]  # a draft model's proposals for the next step


# ---------------------------------------------------------------------------------------------
# workloads


@dataclass(frozen=True)
class ReqSpec:
    arrival: int  # scheduler tick at which it is added
    prompt: tuple[int, ...]
    max_tokens: int
    use_eos: bool  # EOS ends it (otherwise ignore_eos)
    stop_token_ids: tuple[int, ...]
    stop_seqs: tuple[tuple[int, ...], ...]  # stop strings, as token sequences the output may end with
    min_tokens: int
    max_model_len: int | None
    abort_after: int | None  # aborted between steps once it has at least this many output tokens


@dataclass(frozen=True)
class Workload:
    block_size: int
    num_blocks: int
    max_num_seqs: int
    budget: int
    chunked: bool
    prefix_caching: bool
    requests: tuple[ReqSpec, ...]


@dataclass(frozen=True)
class Greedy:
    """The target model: the next token is a function of the prefix (mostly of its last two tokens, so outputs
    fall into cycles the n-gram proposer predicts; now and then of its length, so drafts get rejected)."""

    a: int
    b: int
    c: int
    salt: int
    noise: int  # out of 13 positions, how many break the pattern

    def __call__(self, prefix: Sequence[int]) -> int:
        p1 = prefix[-1]
        p2 = prefix[-2] if len(prefix) > 1 else V
        if (len(prefix) * 7 + self.salt) % 13 < self.noise:
            return (p1 + p2 + 1) % V
        return (self.a * p1 + self.b * p2 + self.c) % V


@dataclass(frozen=True)
class Case:
    w: Workload
    f: Greedy
    k: int  # num_speculative_tokens
    method: str  # "ngram" (the real proposer) or "draft_model" (proposals handed in each step)
    lookup: tuple[int, int]  # prompt_lookup_min, prompt_lookup_max
    adaptive: bool  # the policy may hold drafts back (no step times are fed: acceptance alone decides)
    seed: int  # drafts' corruption (draft_model) and the random model's choices


def build(pick: Pick) -> Case:
    """A workload under KV pressure: the pool holds the longest request and at most a few blocks more."""
    bs = (1, 2, 4)[pick(0, 2)]
    chunked = pick(0, 1) == 1
    budget = pick(1, 32)
    if not chunked:
        budget = max(budget, 3)  # like EngineConfig: without chunking a whole sequence fits in one step
    limit = pick(3, 40)  # prompt + max_tokens, at most
    if not chunked:
        limit = min(limit, budget)
    reqs = []
    for _ in range(max(pick(1, 8), pick(1, 8))):  # often several: they compete for the pool
        max_tokens = pick(1, min(16, limit - 1))
        plen = pick(1, min(24, limit - max_tokens))
        shared = pick(0, plen)
        prompt = (*BASE[:shared], *(pick(0, V - 1) for _ in range(plen - shared)))
        stop_ids = (pick(0, V - 1),) if pick(0, 3) == 0 else ()
        stop_seqs = tuple(tuple(pick(0, V - 1) for _ in range(pick(1, 3))) for _ in range(pick(0, 3) // 2))
        min_tokens = pick(1, max_tokens) if pick(0, 5) == 0 else 0  # such requests never speculate
        max_model_len = pick(plen + 1, plen + max_tokens) if pick(0, 4) == 0 else None
        abort_after = pick(0, max_tokens) if pick(0, 3) == 0 else None
        reqs.append(ReqSpec(pick(0, 3), prompt, max_tokens, pick(0, 2) > 0, stop_ids, stop_seqs, min_tokens,
                            max_model_len, abort_after))
    longest = max(len(r.prompt) + r.max_tokens for r in reqs)
    num_blocks = max(2, -(-longest // bs) + pick(0, 2))  # every request fits the pool alone, not all together
    w = Workload(bs, num_blocks, pick(1, 5), budget, chunked, pick(0, 3) > 0, tuple(reqs))
    f = Greedy(pick(0, V - 1), pick(0, V - 1), pick(0, V - 1), pick(0, 12), pick(0, 4))
    lo = pick(1, 2)
    return Case(w, f, pick(1, 5), ("ngram", "draft_model")[pick(0, 1)], (lo, pick(lo, 3)), pick(0, 3) == 0,
                pick(0, 2**31))


@st.composite
def cases(draw: st.DrawFn) -> Case:
    return build(lambda lo, hi: draw(st.integers(lo, hi)))


def make_request(rid: str, s: ReqSpec) -> Request:
    params = SamplingParams(max_tokens=s.max_tokens, ignore_eos=not s.use_eos, stop_token_ids=list(s.stop_token_ids),
                            min_tokens=s.min_tokens)
    r = Request(rid, list(s.prompt), params, eos_token_ids=frozenset({EOS}))
    if s.max_model_len is not None:
        r.max_model_len = s.max_model_len
    return r


def speculator(case: Case) -> Speculator:
    raw: dict[str, object] = {"method": case.method, "num_speculative_tokens": case.k, "adaptive": case.adaptive}
    if case.method == "ngram":
        raw |= {"prompt_lookup_min": case.lookup[0], "prompt_lookup_max": case.lookup[1]}
    else:
        raw["model"] = "unused: proposals are handed in"
    return Speculator(SpeculativeConfig.parse(raw))


# ---------------------------------------------------------------------------------------------
# how a request ends: an oracle independent of Request.append_token and the engine


def ending(s: ReqSpec, out: Sequence[int]) -> Ending | None:
    """Whether the output ends right after its last token, and how (a stop sequence wins, as stop strings do)."""
    t, n = out[-1], len(out)
    active = n >= s.min_tokens  # before min_tokens nothing stops the output; lengths still do
    end: Ending | None = None
    if active and t in s.stop_token_ids:
        end = RequestStatus.FINISHED_STOPPED, t
    elif active and s.use_eos and t == EOS:
        end = RequestStatus.FINISHED_STOPPED, None
    elif n >= s.max_tokens or (s.max_model_len is not None and len(s.prompt) + n >= s.max_model_len):
        end = RequestStatus.FINISHED_LENGTH, None
    for j, seq in enumerate(s.stop_seqs):
        if active and tuple(out[-len(seq):]) == seq:
            return RequestStatus.FINISHED_STOPPED, f"seq{j}"
    return end


def oracle(s: ReqSpec, f: Greedy) -> Outcome:
    """The request run alone, one greedy token at a time, never aborted."""
    tokens, out = list(s.prompt), []
    while True:
        t = f(tokens)
        tokens.append(t)
        out.append(t)
        if (end := ending(s, out)) is not None:
            return out, *end


# ---------------------------------------------------------------------------------------------
# models and proposers


def greedy_model(f: Greedy) -> Model:
    """Greedy verification: drafts are accepted while they equal the model's token, then one more token."""
    def run(r: Request, c: ScheduledChunk) -> list[int]:
        prefix = list(r.token_ids)
        out: list[int] = []
        for d in c.draft:
            if f(prefix + out) != d:
                break
            out.append(d)
        return [*out, f(prefix + out)]
    return run


def random_model(rng: random.Random) -> Model:
    """Accepts a random number of drafts (often none or all), then a random token (EOS now and then)."""
    def run(r: Request, c: ScheduledChunk) -> list[int]:
        n = len(c.draft)
        accepted = (0, n, rng.randint(0, n))[rng.randint(0, 2)]
        return [*c.draft[:accepted], rng.randrange(V if rng.random() < 0.2 else EOS)]
    return run


def oracle_proposer(f: Greedy, rng: random.Random, k: int) -> Proposer:
    """A good draft model: the true greedy continuation (EOS and stop tokens included), sometimes corrupted."""
    def propose(sched: Scheduler) -> dict[str, list[int]]:
        out = {}
        for r in sched.running:
            tokens, draft = list(r.token_ids), []
            for _ in range(rng.randint(0, k + 1)):  # k + 1: the speculator must cut it to what fits
                t = f(tokens)
                if rng.random() < 0.15:
                    t = (t + 1) % V
                tokens.append(t)
                draft.append(t)
            out[r.request_id] = draft
        return out
    return propose


def random_proposer(rng: random.Random, k: int) -> Proposer:
    def propose(sched: Scheduler) -> dict[str, list[int]]:
        return {r.request_id: [rng.randrange(V) for _ in range(rng.randint(0, k + 2))] for r in sched.running}
    return propose


# ---------------------------------------------------------------------------------------------
# the driver: schedule, check the plan, "run" it, update, emulate the engine's stop strings and aborts, check


@dataclass
class Stats:
    steps: int = 0
    preemptions: int = 0
    verifications: int = 0
    draft_tokens: int = 0
    accepted: int = 0  # as the model reported them
    dropped: int = 0  # sampled tokens after one that ended the request inside a verification
    ended_in_run: dict[str, int] = field(default_factory=dict)  # verifications that ended the request, by how
    preempted_after_drafts: int = 0  # preemptions of requests that had verified drafts before
    aborted_after_drafts: int = 0
    prefix_hit_tokens: int = 0
    # Steps that preempted a request the same step would not have preempted without drafts: (with, without).
    spec_preemptions: list[tuple[list[str], list[str]]] = field(default_factory=list)


@dataclass
class Result:
    outcomes: dict[str, Outcome]
    emitted: dict[str, list[list[int]]]  # per request, the tokens each of its sampling chunks yielded
    stats: Stats


def slot(table: Sequence[int], p: int, bs: int) -> int:
    return table[p // bs] * bs + p % bs


def chain(tokens: Sequence[int], bs: int) -> BlockHash | None:
    h: BlockHash | None = None
    for j in range(len(tokens) // bs):
        h = hash_block(h, tokens[j * bs:(j + 1) * bs])
    return h


def check_cache(kv: KVCacheManager, slot_holds: dict[int, tuple[int, ...]]) -> None:
    """Every hash in the pool, and every hash a request committed, names what its block's slots really hold."""
    bs = kv.block_size

    def holds(block_id: int) -> tuple[int, ...]:
        base = block_id * bs
        full = slot_holds.get(base + bs - 1)
        assert full is not None and len(full) % bs == 0, f"block {block_id} hashed but never fully written"
        for i in range(bs):
            assert slot_holds.get(base + i) == full[:len(full) - bs + i + 1], f"block {block_id} slot {i}"
        return full

    for block in kv.pool.blocks:
        if block.block_hash is not None:
            assert chain(holds(block.block_id), bs) == block.block_hash, f"block {block.block_id}: wrong contents"
    for rid, alloc in kv.allocations.items():
        for i, h in enumerate(alloc.block_hashes):
            full = holds(alloc.block_ids[i])
            assert len(full) == (i + 1) * bs and chain(full, bs) == h, (rid, i)


def apply_stop_sequences(sched: Scheduler, advanced: Sequence[Request], specs: dict[str, ReqSpec]) -> None:
    """LLMEngine._detokenize on token ids: the first new token completing a stop sequence ends the request
    there, and the tokens after it are dropped."""
    for r in advanced:
        s = specs[r.request_id]
        for pos in range(r.num_tokens - r.num_new_tokens, r.num_tokens):
            out = r.token_ids[r.num_prompt_tokens:pos + 1]
            hit = next((j for j, seq in enumerate(s.stop_seqs) if tuple(out[-len(seq):]) == seq), None)
            if hit is None or len(out) < s.min_tokens:
                continue
            if after := r.num_tokens - 1 - pos:
                del r.token_ids[-after:]
                r.num_new_tokens -= after
            r.stop_reason = f"seq{hit}"
            if r.is_finished:
                r.status = RequestStatus.FINISHED_STOPPED
            else:
                sched.stop(r)
            break


def drive(w: Workload, model: Model, spec: Speculator | None = None, proposer: Proposer | None = None,
          counterfactual: bool = False) -> Result:
    kv = KVCacheManager(w.num_blocks, w.block_size, w.prefix_caching)
    sched = Scheduler(kv, w.max_num_seqs, w.budget, w.chunked, spec)
    bs = w.block_size
    specs = {f"r{i}": s for i, s in enumerate(w.requests)}
    reqs = {rid: make_request(rid, s) for rid, s in specs.items()}
    arrivals = sorted((s.arrival, rid) for rid, s in specs.items())
    emitted: dict[str, list[list[int]]] = {rid: [] for rid in reqs}
    slot_holds: dict[int, tuple[int, ...]] = {}  # physical slot -> the token prefix whose K/V was written there
    drafted: set[str] = set()
    stats = Stats()
    reported: list[str] = []

    def abort_due() -> None:
        due = []
        for rid, r in sched.requests.items():
            n = specs[rid].abort_after
            if n is not None and r.num_output_tokens >= n:
                due.append(rid)
        assert [r.request_id for r in sched.abort(due)] == due
        stats.aborted_after_drafts += len(drafted.intersection(due))

    tick = 0
    while arrivals or sched.has_work():
        while arrivals and arrivals[0][0] <= tick:
            sched.add(reqs[arrivals.pop(0)[1]])
        abort_due()
        tick += 1
        if not sched.has_work():
            continue
        if spec is not None and proposer is not None:
            spec.set_proposals(proposer(sched))
        before = {rid: (r.status, r.num_computed_tokens, r.num_tokens) for rid, r in sched.requests.items()}
        shadow = copy.deepcopy(sched) if spec is not None and counterfactual else None
        hits_before = kv.prefix_hits
        out = sched.schedule()
        stats.steps += 1
        assert stats.steps < 3000, "no progress"
        stats.prefix_hit_tokens += kv.prefix_hits - hits_before
        reported += out.finished
        stats.preemptions += len(out.preempted)
        stats.preempted_after_drafts += len(drafted.intersection(out.preempted))

        # The plan: budget, concurrency, decodes first, each chunk continues its request.
        assert out.chunks, "an empty step while requests wait or run"
        assert out.num_batched_tokens == sum(len(c.token_ids) for c in out.chunks) <= w.budget
        assert len(sched.running) <= w.max_num_seqs
        ids = [c.request_id for c in out.chunks]
        assert len(ids) == len(set(ids)) and not set(out.preempted) & set(ids)
        assert set(ids) <= {r.request_id for r in sched.running}
        decodes = [before[c.request_id][1] == before[c.request_id][2] - 1 for c in out.chunks
                   if before[c.request_id][0] is RequestStatus.RUNNING]
        assert decodes == sorted(decodes, reverse=True)
        written: set[int] = set()
        for c in out.chunks:
            r = sched.requests[c.request_id]
            status, computed, num_tokens = before[c.request_id]
            n, start = len(c.token_ids), c.start_pos
            assert n >= 1 and start == r.num_computed_tokens
            if status is RequestStatus.RUNNING:
                assert start == computed
            else:  # admitted this step: starts after its prefix hit, on a block boundary
                assert computed == 0 and start % bs == 0 and start < r.num_tokens
                assert w.prefix_caching or start == 0
            if c.draft:  # a verification: the last known token, then the drafts, only for an eligible decode
                assert spec is not None and status is RequestStatus.RUNNING and computed == num_tokens - 1
                sp = r.sampling_params  # eligible, spelled out: sampled from the model's distribution alone
                assert not sp.needs_history and sp.logprobs is None and sp.prompt_logprobs is None
                assert c.sample and c.token_ids == [r.token_ids[-1], *c.draft]
                room = min(spec.config.num_speculative_tokens, sp.max_tokens - r.num_output_tokens - 1,
                           r.max_model_len - r.num_tokens - 1)
                assert 1 <= len(c.draft) <= room
                known = [*r.token_ids[:start], *c.token_ids]  # the prefix each position's K/V is computed from
                drafted.add(c.request_id)
                stats.verifications += 1
                stats.draft_tokens += len(c.draft)
            else:
                assert start + n <= r.num_tokens and c.token_ids == r.token_ids[start:start + n]
                assert c.sample == (start + n == r.num_tokens)
                assert w.chunked or c.sample, "without chunked prefill every chunk reaches the end"
                known = r.token_ids[:start + n]
            table = c.block_table
            assert table == kv.block_table(c.request_id) and len(table) >= kv.blocks_for(start + n)
            # Every position before the chunk holds this sequence's own K/V (not a rejected draft's) ...
            for p in range(start):
                assert slot_holds.get(slot(table, p, bs)) == tuple(r.token_ids[:p + 1]), (c.request_id, p)
            # ... and the chunk, drafts included, writes only into blocks nobody else holds and nobody hashed.
            for p in range(start, start + n):
                block = kv.pool.blocks[table[p // bs]]
                assert block.ref_cnt == 1 and block.block_hash is None, (c.request_id, p)
                where = slot(table, p, bs)
                assert where not in written
                written.add(where)
                slot_holds[where] = tuple(known[:p + 1])

        # Speculation takes free blocks only: the step preempts nothing it would not have preempted without drafts.
        if shadow is not None and any(c.draft for c in out.chunks):
            shadow.speculator = None
            without = shadow.schedule().preempted
            if set(out.preempted) - set(without):
                stats.spec_preemptions.append((out.preempted, without))

        sampled = {c.request_id: model(sched.requests[c.request_id], c) for c in out.chunks if c.sample}
        for rid, t in sampled.items():
            emitted[rid].append(list(t))
        chunks = {c.request_id: c for c in out.chunks}
        advanced = sched.update(out, sampled)
        assert sorted(r.request_id for r in advanced) == sorted(sampled)
        for r in advanced:
            tokens, c = sampled[r.request_id], chunks[r.request_id]
            stats.accepted += len(tokens) - 1
            assert 1 <= r.num_new_tokens <= len(tokens)
            assert r.token_ids[r.num_tokens - r.num_new_tokens:] == tokens[:r.num_new_tokens]
            assert r.num_computed_tokens == r.num_tokens - 1  # accepted drafts computed, the rest not
            if r.num_new_tokens < len(tokens):  # the request ended inside the run: the rest is dropped
                assert r.is_finished
                stats.dropped += len(tokens) - r.num_new_tokens
            if c.draft and r.is_finished:
                key = "eos" if r.stop_reason is None and r.status is RequestStatus.FINISHED_STOPPED else \
                    "stop id" if r.status is RequestStatus.FINISHED_STOPPED else "length"
                if r.num_new_tokens < len(tokens) or key == "length":
                    stats.ended_in_run[key] = stats.ended_in_run.get(key, 0) + 1
            assert r.is_finished == (r.request_id not in sched.requests)
        n_advanced = {r.request_id: r.num_new_tokens for r in advanced}
        apply_stop_sequences(sched, advanced, specs)
        for r in advanced:
            if isinstance(r.stop_reason, str) and chunks[r.request_id].draft:
                stats.ended_in_run["stop seq"] = stats.ended_in_run.get("stop seq", 0) + 1
                stats.dropped += n_advanced[r.request_id] - r.num_new_tokens
        abort_due()

        # After the step: running requests' computed positions hold their own K/V; the cache names real contents.
        for r in sched.running:
            assert r.num_computed_tokens <= r.num_tokens - 1
            table = kv.block_table(r.request_id)
            assert len(table) >= kv.blocks_for(r.num_computed_tokens)
            for p in range(r.num_computed_tokens):
                assert slot_holds.get(slot(table, p, bs)) == tuple(r.token_ids[:p + 1]), (r.request_id, p)
        check_cache(kv, slot_holds)

    reported += sched.schedule().finished
    assert all(r.is_finished for r in reqs.values())
    assert sorted(reported) == sorted(reqs)
    assert sched.num_preemptions == sum(r.num_preemptions for r in reqs.values()) == stats.preemptions
    assert kv.pool.num_free == w.num_blocks and not kv.allocations
    assert not sched.running and not sched.waiting and not sched.requests
    if spec is not None:  # finished requests' state is forgotten; counters saw every verification
        assert not spec.indexes and not spec.external and not spec.shadow and not spec.policy._requests
        assert spec.counters.num_drafts == stats.verifications
        assert spec.counters.num_draft_tokens == stats.draft_tokens
        assert spec.counters.num_accepted_tokens == stats.accepted
    outcomes = {rid: (r.output_token_ids, r.status, r.stop_reason) for rid, r in reqs.items()}
    return Result(outcomes, emitted, stats)


def note(stats: Stats, tag: str) -> None:
    """Hypothesis statistics: which corners an example reached."""
    if stats.verifications:
        event(f"{tag}: verified drafts")
    if stats.accepted:
        event(f"{tag}: accepted drafts")
    if stats.preemptions:
        event(f"{tag}: preemption")
    if stats.preempted_after_drafts:
        event(f"{tag}: preempted a request that had speculated")
    if stats.aborted_after_drafts:
        event(f"{tag}: aborted a request that had speculated")
    for key in stats.ended_in_run:
        event(f"{tag}: {key} inside a verification")
    if stats.prefix_hit_tokens:
        event(f"{tag}: prefix hit")


SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------------------------
# the tests


@SETTINGS
@given(cases())
def test_random_verifications_keep_every_invariant(case: Case) -> None:
    """Random drafts, random acceptance and random extra tokens: the slot model, the cache and the request
    bookkeeping hold after every step, and each output is exactly what the model yielded up to the token that
    ended it (the rest of that verification dropped, nothing sampled afterwards)."""
    rng = random.Random(case.seed)
    spec = speculator(case)
    proposer = random_proposer(rng, case.k) if case.method == "draft_model" else None
    res = drive(case.w, random_model(rng), spec, proposer)
    note(res.stats, "random")
    for i, s in enumerate(case.w.requests):
        rid = f"r{i}"
        out, status, reason = res.outcomes[rid]
        steps = res.emitted[rid]
        stream = [t for e in steps for t in e]
        end = next((j for j in range(len(stream)) if ending(s, stream[:j + 1]) is not None), None)
        if end is None:
            assert (out, status) == (stream, RequestStatus.FINISHED_ABORTED), rid
            assert s.abort_after is not None and len(out) >= s.abort_after
        else:
            assert end >= len(stream) - len(steps[-1]), f"{rid} sampled again after it ended"
            assert (out, (status, reason)) == (stream[:end + 1], ending(s, stream[:end + 1])), rid


@SETTINGS
@given(cases())
def test_speculation_changes_no_output_under_greedy_verification(case: Case) -> None:
    """The same workload without and with speculation: both match the request run alone, token for token and
    in finish reason. Only an abort (decided between steps, once N tokens are out) may find a speculating
    request up to k tokens further on the same greedy path, or already finished along it."""
    base = drive(case.w, greedy_model(case.f))
    rng = random.Random(case.seed)
    proposer = oracle_proposer(case.f, rng, case.k) if case.method == "draft_model" else None
    spec = drive(case.w, greedy_model(case.f), speculator(case), proposer)
    note(spec.stats, "greedy")
    for i, s in enumerate(case.w.requests):
        rid = f"r{i}"
        ref = oracle(s, case.f)
        full = len(ref[0])
        n = s.abort_after
        if n is None or n >= full:  # never aborted: identical, whatever happened around it
            assert base.outcomes[rid] == ref, rid
            assert spec.outcomes[rid] == ref, rid
            continue
        assert base.outcomes[rid] == (ref[0][:n], RequestStatus.FINISHED_ABORTED, None), rid
        out, status, reason = spec.outcomes[rid]
        if status is RequestStatus.FINISHED_ABORTED:
            assert n <= len(out) < full and len(out) <= n + case.k and out == ref[0][:len(out)], rid
            assert reason is None
        else:
            assert (out, status, reason) == ref and full <= n + case.k, rid


@settings(max_examples=300, deadline=None, derandomize=True, phases=[Phase.generate],
          suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_drafts_never_cause_a_preemption(case: Case) -> None:
    """Speculation takes free blocks only, and never preempts anyone: each step preempts nothing the same step
    would not have preempted with no drafts at all."""
    rng = random.Random(case.seed)
    proposer = oracle_proposer(case.f, rng, case.k) if case.method == "draft_model" else None
    res = drive(case.w, greedy_model(case.f), speculator(case), proposer, counterfactual=True)
    assert not res.stats.spec_preemptions, res.stats.spec_preemptions[:3]


def test_a_draft_does_not_take_the_block_a_later_decode_needs() -> None:
    # bs 2, 4 blocks. A = 3 prompt tokens (2 blocks), B = 2 (1 block): after one step A has 4 tokens, which fit its
    # 2 blocks, and B has 3, whose last needs a 2nd block: the last free one. A's one-token draft needs a 3rd block.
    def preempted(speculate: bool) -> list[str]:
        spec = Speculator(SpeculativeConfig.parse({"method": "draft_model", "model": "d", "num_speculative_tokens": 1,
                                                   "adaptive": False})) if speculate else None
        sched = Scheduler(KVCacheManager(4, 2), 4, 16, speculator=spec)
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        sched.add(Request("A", [1, 2, 3], params))
        sched.add(Request("B", [4, 5], params))
        sched.update(sched.schedule(), {"A": [6], "B": [7]})
        if spec is not None:
            spec.set_proposals({"A": [8]})
        return sched.schedule().preempted

    assert preempted(False) == []
    assert preempted(True) == []  # it was ["B"]: A's draft took the block B's token needed


def test_the_corners_are_reached() -> None:
    """The property tests are not vacuous: over fixed random cases (outputs checked against the oracle),
    speculation accepts drafts, ends requests by EOS, stop ids, stop sequences and lengths inside verifications,
    and requests that speculated get preempted, aborted, and hit the prefix cache."""
    total = Stats()
    for seed in range(60):
        case = build(random.Random(seed).randint)
        proposer = oracle_proposer(case.f, random.Random(seed), case.k) if case.method == "draft_model" else None
        res = drive(case.w, greedy_model(case.f), speculator(case), proposer)
        for i, s in enumerate(case.w.requests):
            if s.abort_after is None:
                assert res.outcomes[f"r{i}"] == oracle(s, case.f), (seed, i)
        got = res.stats
        total.verifications += got.verifications
        total.accepted += got.accepted
        total.dropped += got.dropped
        total.preempted_after_drafts += got.preempted_after_drafts
        total.aborted_after_drafts += got.aborted_after_drafts
        total.prefix_hit_tokens += got.prefix_hit_tokens
        for key, v in got.ended_in_run.items():
            total.ended_in_run[key] = total.ended_in_run.get(key, 0) + v
    assert total.verifications and total.accepted and total.dropped, total
    assert total.preempted_after_drafts and total.aborted_after_drafts and total.prefix_hit_tokens, total
    assert set(total.ended_in_run) == {"eos", "stop id", "stop seq", "length"}, total


def test_speculation_modules_import_no_torch() -> None:
    code = ("import sys\n"
            "import kvfleet_agent.core.scheduler, kvfleet_agent.core.speculator, kvfleet_agent.core.spec_policy\n"
            "import kvfleet_agent.core.ngram, kvfleet_agent.spec_config\n"
            "print('torch' in sys.modules)\n")
    root = Path(__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "False", "the speculative-decoding bookkeeping pulled in torch"
