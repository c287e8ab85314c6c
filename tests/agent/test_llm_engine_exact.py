"""Greedy tokens equal transformers' token for token, while preemption, prefix hits and chunking really happen."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from hf_reference import hf_greedy

from kvfleet_agent import LLM, SamplingParams

NUM_REQUESTS = 32
ARCHS = ["llama", "llama3", "qwen2", "mistral"]


def make_requests(vocab: int, seed: int, shared_prefix: int = 0) -> list[tuple[list[int], int]]:
    """Mixed lengths: prompts of 1-70 tokens (optionally behind a common prefix), outputs of 1-24."""
    rng = random.Random(seed)
    prefix = [rng.randrange(4, vocab) for _ in range(shared_prefix)]
    reqs = []
    for _ in range(NUM_REQUESTS):
        prompt = prefix + [rng.randrange(4, vocab) for _ in range(rng.randint(1, 70))]
        reqs.append((prompt, rng.randint(1, 24)))
    return reqs


def run_and_compare(path: str, reqs: list[tuple[list[int], int]], **engine: object) -> LLM:
    """Generate all requests in one call and assert every token matches transformers."""
    llm = LLM(model=path, dtype="float32", **engine)
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs],
                        [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in reqs],
                        use_tqdm=False)
    assert len(outs) == len(reqs)
    for i, ((prompt, n), out) in enumerate(zip(reqs, outs, strict=True)):
        got = out.outputs[0].token_ids
        assert len(got) == n
        assert got == hf_greedy(path, prompt, n), f"request {i} (prompt {len(prompt)} tokens) diverged"
    assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_blocks, "blocks leaked after the batch"
    return llm


@pytest.mark.parametrize("arch", ARCHS)
def test_everything_fits(arch: str, tiny_checkpoint: Callable[..., str]) -> None:
    path = tiny_checkpoint(arch)
    llm = run_and_compare(path, make_requests(512, seed=1))
    assert llm.engine.scheduler.num_preemptions == 0


@pytest.mark.parametrize("arch", ["llama3", "qwen2"])
def test_preemption_under_a_tiny_kv_pool(arch: str, tiny_checkpoint: Callable[..., str]) -> None:
    path = tiny_checkpoint(arch)
    # 2 layers x 2 KV heads x 16 dims x 4 bytes x 2 (K and V) = 512 B a token; 12 blocks of 8 tokens.
    llm = run_and_compare(path, make_requests(512, seed=2), block_size=8, kv_cache_memory_bytes=512 * 8 * 12,
                          max_model_len=96)
    assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to be too small to avoid preemption"


@pytest.mark.parametrize("arch", ["llama3", "qwen2"])
def test_prefix_cache_hits(arch: str, tiny_checkpoint: Callable[..., str]) -> None:
    path = tiny_checkpoint(arch)
    # Few sequences at a time, so later requests arrive after the shared prefix is committed.
    llm = run_and_compare(path, make_requests(512, seed=3, shared_prefix=40), max_num_seqs=4)
    kv = llm.engine.kv
    assert kv.prefix_hits >= 32 * (NUM_REQUESTS - 4), f"only {kv.prefix_hits} prompt tokens hit the prefix cache"
    assert kv.prefix_queries >= kv.prefix_hits


@pytest.mark.parametrize("arch", ["llama3", "qwen2"])
def test_prefill_chunks_smaller_than_prompts(arch: str, tiny_checkpoint: Callable[..., str]) -> None:
    path = tiny_checkpoint(arch)
    llm = run_and_compare(path, make_requests(512, seed=4), max_num_batched_tokens=16, max_num_seqs=8)
    assert llm.engine.scheduler.num_partial_prefills > NUM_REQUESTS // 2


def test_all_pressures_at_once(tiny_checkpoint: Callable[..., str]) -> None:
    """Preemption, prefix hits and chunking in one run: the interactions are where bugs hide."""
    path = tiny_checkpoint("llama3")
    llm = run_and_compare(path, make_requests(512, seed=5, shared_prefix=24), block_size=8,
                          kv_cache_memory_bytes=512 * 8 * 14, max_model_len=112, max_num_batched_tokens=24)
    sched, kv = llm.engine.scheduler, llm.engine.kv
    assert sched.num_preemptions > 0 and kv.prefix_hits > 0 and sched.num_partial_prefills > 0
