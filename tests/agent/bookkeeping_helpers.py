"""Shared by the KV-cache and scheduler tests: token lists, the admission path, and driving scheduler steps."""

from __future__ import annotations

import itertools

from kvfleet_agent.core.kv_cache import KVCacheManager
from kvfleet_agent.core.request import Request, RequestStatus
from kvfleet_agent.core.scheduler import Scheduler
from kvfleet_agent.core.scheduler_output import SchedulerOutput
from kvfleet_agent.sampling_params import SamplingParams


def toks(n: int, start: int = 0) -> list[int]:
    """n distinct-ish token ids starting at `start`."""
    return list(range(start, start + n))


# ---------------------------------------------------------------------------------------------
# KV cache

BS = 4  # block size used by the KV-cache unit tests


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
# scheduler: a step is driven the way the engine drives it, `out = sched.schedule()` then
# `sched.update(out, sampled)` with one made-up token for every chunk that samples.


def make(num_blocks: int, block_size: int, max_num_seqs: int, budget: int, chunked: bool = True,
         prefix_caching: bool = True) -> tuple[KVCacheManager, Scheduler]:
    kv = KVCacheManager(num_blocks, block_size, prefix_caching)
    return kv, Scheduler(kv, max_num_seqs, budget, chunked)


def req(rid: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def add(sched: Scheduler, *requests: Request) -> None:
    """Add the requests in order (the first arrives first)."""
    for r in requests:
        sched.add(r)


_tokens = itertools.count(50_000)


def sample_all(out: SchedulerOutput) -> dict[str, list[int]]:
    """A fresh made-up token for every chunk that samples."""
    return {c.request_id: [next(_tokens)] for c in out.chunks if c.sample}


def step(sched: Scheduler) -> SchedulerOutput:
    out = sched.schedule()
    sched.update(out, sample_all(out))
    return out


def run_to_completion(sched: Scheduler, max_steps: int = 1000) -> list[SchedulerOutput]:
    outs = []
    while sched.has_work():
        outs.append(step(sched))
        assert len(outs) < max_steps, "scheduler made no progress"
    return outs


def chunk_of(out: SchedulerOutput, rid: str) -> list[tuple[int, int, bool]]:
    return [(c.start_pos, len(c.token_ids), c.sample) for c in out.chunks if c.request_id == rid]


def status(r: Request) -> RequestStatus:
    """r.status, read through a call so that type checkers do not narrow it across scheduler calls."""
    return r.status
