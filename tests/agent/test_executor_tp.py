"""Tensor parallelism offline (gloo on CPU): TP=2 generates TP=1's greedy tokens, each rank holds 1/N of the model."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from conftest import Processes

from kvfleet_agent import LLM, SamplingParams

NUM_REQUESTS = 24
VOCAB = 512  # prompts draw token ids below this (every tiny checkpoint has at least 768)


def make_requests(seed: int, shared_prefix: int = 0) -> list[tuple[list[int], int]]:
    """Mixed lengths: prompts of 1-70 tokens (optionally behind a common prefix), outputs of 1-24."""
    rng = random.Random(seed)
    prefix = [rng.randrange(4, VOCAB) for _ in range(shared_prefix)]
    return [(prefix + [rng.randrange(4, VOCAB) for _ in range(rng.randint(1, 70))], rng.randint(1, 24))
            for _ in range(NUM_REQUESTS)]


def generate(llm: LLM, reqs: list[tuple[list[int], int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs],
                        [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in reqs],
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def run_both(path: str, reqs: list[tuple[list[int], int]], tp1: dict[str, Any], tp2: dict[str, Any],
             check: Callable[[LLM], None] = lambda llm: None) -> tuple[LLM, LLM]:
    """The same requests at TP=1 and TP=2: token for token the same, with `check` true of both engines."""
    one = LLM(model=path, dtype="float32", **tp1)
    want = generate(one, reqs)
    check(one)
    with LLM(model=path, dtype="float32", tensor_parallel_size=2, **tp2) as two:
        got = generate(two, reqs)
        check(two)
        for i, ((prompt, n), a, b) in enumerate(zip(reqs, want, got, strict=True)):
            assert len(a) == n and b == a, f"request {i} (prompt {len(prompt)} tokens) diverged at TP=2"
        assert two.engine.kv.pool.num_free == two.engine.kv.pool.num_blocks, "blocks leaked after the batch"
        assert two.engine.runner.num_blocks == one.engine.runner.num_blocks
    return one, two


@pytest.fixture(scope="module")
def qwen_tp2(tiny_checkpoint: Callable[..., str]) -> Iterator[tuple[str, LLM]]:
    """Qwen2 (q/k/v biases, tied embeddings) with an odd vocabulary (771 rows), which 2 ranks split 386 + 385."""
    path = tiny_checkpoint("qwen2", vocab_size=771)
    with LLM(model=path, dtype="float32", tensor_parallel_size=2, kv_cache_memory_bytes=2 << 20) as llm:
        yield path, llm


def test_tp2_greedy_tokens_equal_tp1_on_a_mixed_batch(qwen_tp2: tuple[str, LLM]) -> None:
    path, two = qwen_tp2
    reqs = make_requests(seed=1)
    want = generate(LLM(model=path, dtype="float32", kv_cache_memory_bytes=4 << 20), reqs)
    got = generate(two, reqs)
    assert [len(t) for t in got] == [n for _, n in reqs]
    assert got == want


def test_tp2_under_preemption(tiny_checkpoint: Callable[..., str], no_leftover_children: Processes) -> None:
    # 2 layers x 2 KV heads x 16 dims x 4 bytes x 2 (K and V) = 512 B a token at TP=1, 256 B on each
    # of 2 ranks (memory budgets are per rank): 12 blocks of 8 tokens either way.
    def preempted(llm: LLM) -> None:
        assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to be too small to avoid preemption"

    opts = {"block_size": 8, "max_model_len": 96}
    tp1, tp2 = {**opts, "kv_cache_memory_bytes": 512 * 8 * 12}, {**opts, "kv_cache_memory_bytes": 256 * 8 * 12}
    one, two = run_both(tiny_checkpoint("llama3"), make_requests(seed=2), tp1, tp2, preempted)
    assert two.engine.runner.num_blocks == 12
    assert two.engine.scheduler.num_preemptions == one.engine.scheduler.num_preemptions


def test_tp2_with_prefix_cache_hits(tiny_checkpoint: Callable[..., str], no_leftover_children: Processes) -> None:
    def hit(llm: LLM) -> None:
        assert llm.engine.kv.prefix_hits >= 32 * (NUM_REQUESTS - 4), llm.engine.kv.prefix_hits

    # Few sequences at a time, so later requests arrive after the shared prefix is committed; the
    # same number of blocks (half the bytes a rank), so both evict from the prefix cache alike.
    reqs = make_requests(seed=3, shared_prefix=40)
    one, two = run_both(tiny_checkpoint("llama"), reqs, {"max_num_seqs": 4, "kv_cache_memory_bytes": 2 << 20},
                        {"max_num_seqs": 4, "kv_cache_memory_bytes": 1 << 20}, hit)
    assert two.engine.kv.prefix_hits == one.engine.kv.prefix_hits > 0


def test_each_rank_holds_half_the_weights_and_half_the_kv_heads(qwen_tp2: tuple[str, LLM]) -> None:
    path, two = qwen_tp2
    one = LLM(model=path, dtype="float32", kv_cache_memory_bytes=2 << 20)
    total = one.engine.runner.param_bytes()
    cfg = one.engine.model_config
    ranks = two.engine.executor.rank_stats()
    assert [r["rank"] for r in ranks] == [0, 1]
    assert len({r["pid"] for r in ranks}) == 2, "rank 1 runs in its own process"
    # Replicated: the norms only (a row-parallel bias too, but Qwen2's o_proj has none).
    replicated = (2 * cfg.num_layers + 1) * cfg.hidden_size * 4
    for r in ranks:
        assert r["param_bytes"] == pytest.approx(total / 2, rel=0.01)
        # Each rank read only its own share from the checkpoint (safetensors slices, not whole tensors).
        assert r["loaded_bytes"] == r["param_bytes"]
    assert sum(r["param_bytes"] for r in ranks) - total <= replicated + cfg.hidden_size * 4  # + 1 padding row
    # The KV cache is sharded by KV head: 2 heads → 1 on each rank, the same number of blocks everywhere.
    blocks = two.engine.runner.num_blocks
    want = (blocks, two.engine.config.block_size, cfg.num_kv_heads // 2, cfg.head_dim)
    for r in ranks:
        assert r["num_blocks"] == blocks
        assert r["kv_shapes"] == [want] * cfg.num_layers
    assert [tuple(layer.k_cache.shape) for layer in one.engine.runner.attn_layers] == \
        [(one.engine.runner.num_blocks, *want[1:2], cfg.num_kv_heads, cfg.head_dim)] * cfg.num_layers


@pytest.mark.parametrize(("size", "overrides", "message"), [
    (3, {}, "tensor_parallel_size=3 does not divide num_attention_heads=4 of .*; use 1 or 2$"),
    (4, {}, "tensor_parallel_size=4 does not divide num_key_value_heads=2 of .*; use 1 or 2$"),
    (2, {"num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 16},
     "does not divide num_key_value_heads=3 of .*; use 1$"),
    (2, {"intermediate_size": 175}, "does not divide intermediate_size=175 of .*; use 1$"),
])
def test_indivisible_sizes_are_refused_before_any_worker_starts(
        tiny_checkpoint: Callable[..., str], no_leftover_children: Processes, size: int, overrides: dict[str, int],
        message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(model=tiny_checkpoint("llama", **overrides), tensor_parallel_size=size)


def test_tensor_parallel_size_must_be_a_positive_integer(tiny_checkpoint: Callable[..., str]) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        LLM(model=tiny_checkpoint("llama"), tensor_parallel_size=0)


def test_seeded_sampling_and_logprobs_match_tp1(qwen_tp2: tuple[str, LLM]) -> None:
    """Rank 0 samples from the gathered logits with the same generators as a single rank would."""
    path, two = qwen_tp2
    prompts: list[Any] = [{"prompt_token_ids": [5 + i, 60, 7]} for i in range(6)]
    params = [SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, top_k=50, seed=i, logprobs=2,
                             ignore_eos=True) for i in range(6)]
    want = LLM(model=path, dtype="float32", kv_cache_memory_bytes=4 << 20).generate(prompts, params, use_tqdm=False)
    got = two.generate(prompts, params, use_tqdm=False)
    for a, b in zip(want, got, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or [], strict=True):
            assert lb.token_id == la.token_id and lb.top.keys() == la.top.keys()
            assert lb.logprob == pytest.approx(la.logprob, abs=1e-4)
