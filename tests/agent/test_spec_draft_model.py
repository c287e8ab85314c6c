"""Speculative decoding with a draft model through the offline API: greedy outputs token-for-token those of plain
decoding for every architecture (a draft of other weights, and the target as its own draft, which is then always
right), under preemption, prefix-cache hits and chunked prefill, with tensor parallelism; stops and max_tokens inside a
speculated run; seeded sampling reproducible, and verified against the draft's own distribution; the refusals; the
KV pool counting the draft; a trained draft beating a random one."""

from __future__ import annotations

import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from llm_helpers import ENGINE_OPTIONS
from safetensors.torch import load_file, save_file
from spec_helpers import drafted, run, same

from kvfleet_agent.core.kv_cache import KVCacheManager
from kvfleet_agent.core.request import Request
from kvfleet_agent.core.scheduler import Scheduler
from kvfleet_agent.core.speculator import Speculator
from kvfleet_agent.llm import LLM
from kvfleet_agent.models.train_tiny import FAST, train_pair
from kvfleet_agent.sampling_params import SamplingParams
from kvfleet_agent.spec_config import SpeculativeConfig
from kvfleet_agent.worker import draft_model

PROMPTS = ["The quick brown fox", "hello world", "one two three four five", "a b c a b c a b", "x = x + 1\nx ="]


def draft(path: str, k: int = 3) -> dict[str, Any]:
    """Forced speculation (adaptive off): every eligible decode step verifies k drafts, so every path runs."""
    return {"method": "draft_model", "model": path, "num_speculative_tokens": k, "adaptive": False}


@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2", "mistral"])
def test_greedy_outputs_equal_plain_decoding_for_every_architecture(tiny_checkpoint: Callable[..., str],
                                                                   arch: str) -> None:
    target, other = tiny_checkpoint(arch), tiny_checkpoint(arch, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain, _ = run(target, PROMPTS, params, None)
    for path in (target, other):
        spec, llm = run(target, PROMPTS, params, draft(path))
        same(plain, spec)
        proposed, accepted = drafted(llm)
        assert proposed > 100, proposed
        if path == target:  # the target as its own draft guesses every token (up to float rounding)
            assert accepted >= 0.95 * proposed, (proposed, accepted)
        else:
            assert accepted < proposed, (proposed, accepted)


@pytest.mark.parametrize("which", ["self", "other"])
def test_exact_under_preemption_prefix_hits_and_chunked_prefill(tiny_checkpoint: Callable[..., str],
                                                                which: str) -> None:
    target = tiny_checkpoint("llama")
    path = target if which == "self" else tiny_checkpoint("llama", seed=1)
    rng = random.Random(0)
    shared = [rng.randrange(4, 512) for _ in range(40)]  # two and a half blocks every request has in common
    prompts = [{"prompt_token_ids": shared + [rng.randrange(4, 512) for _ in range(rng.randint(1, 30))]}
               for _ in range(12)]
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True) for _ in prompts]
    params[3] = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)  # these two never
    params[7] = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, repetition_penalty=1.3)  # speculate
    # A pool of 16 blocks with the draft (its K/V doubles a block's bytes): far fewer than 12 requests of ~6 blocks.
    options = {"kv_cache_memory_bytes": 16 * 16384, "max_num_batched_tokens": 32}
    plain, _ = run(target, prompts, params, None, **options)
    spec, llm = run(target, prompts, params, draft(path), **options)
    same(plain, spec)
    engine = llm.engine
    assert engine.runner.num_blocks == 16
    assert engine.scheduler.num_preemptions > 0 and engine.kv.prefix_hits > 0 and engine.scheduler.num_partial_prefills
    proposed, accepted = drafted(llm)
    # The target as its own draft is right every time only if the draft's K/V is the target's everywhere: after
    # recomputation, in prefix-cache hits, across prefill chunks.
    assert proposed > 50 and (accepted >= 0.95 * proposed if which == "self" else accepted < proposed)
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks  # the lookahead blocks went back too
    assert not engine.runner.draft.proposed  # type: ignore[union-attr]


def test_stops_and_lengths_inside_a_speculated_run_end_it_there(tiny_checkpoint: Callable[..., str]) -> None:
    ckpt = tiny_checkpoint("llama")
    ref, _ = run(ckpt, PROMPTS, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), None)
    cases = []
    for out in ref:
        mid = out.token_ids[len(out.token_ids) // 2 + 1]
        text = out.text[len(out.text) // 2:len(out.text) // 2 + 2]
        cases += [SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[mid], ignore_eos=True),
                  SamplingParams(temperature=0.0, max_tokens=40, stop=[text] if text.strip() else None,
                                 ignore_eos=True),
                  SamplingParams(temperature=0.0, max_tokens=len(out.token_ids) // 2 + 2, ignore_eos=True)]
    prompts = [p for p in PROMPTS for _ in range(3)]
    plain, _ = run(ckpt, prompts, cases, None)
    spec, llm = run(ckpt, prompts, cases, draft(ckpt, k=4))  # always accepted: stops land inside long runs
    same(plain, spec)
    assert any(o.finish_reason == "stop" for o in spec) and any(o.finish_reason == "length" for o in spec)
    assert drafted(llm)[1] > 50


def test_sampling_is_seeded_and_verified_against_the_drafts_distribution(tiny_checkpoint: Callable[..., str]) -> None:
    ckpt, other = tiny_checkpoint("llama"), tiny_checkpoint("llama", seed=1)
    params = [SamplingParams(temperature=1.0, max_tokens=30, seed=i, ignore_eos=True) for i in range(4)] + \
        [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=30, seed=9, ignore_eos=True),
         SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    first, llm = run(ckpt, prompts, params, draft(ckpt))
    again, _ = run(ckpt, prompts, params, draft(ckpt))
    same(first, again)
    # With q = p (the target drafting for itself) a sampled draft is accepted with probability min(1, p/q) = 1: only
    # if verification divides by the draft's real distribution (with q one-hot it would be about p(d)).
    proposed, accepted = drafted(llm)
    assert proposed > 100 and accepted >= 0.95 * proposed, (proposed, accepted)
    first, llm = run(ckpt, prompts, params, draft(other))
    again, _ = run(ckpt, prompts, params, draft(other))
    same(first, again)
    proposed, accepted = drafted(llm)
    assert proposed > 100 and accepted < proposed, (proposed, accepted)
    unseeded = [SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)] * 3
    outs, _ = run(ckpt, PROMPTS[:3], unseeded, draft(other))
    assert [len(o.token_ids) for o in outs] == [30, 30, 30]


def test_a_draft_that_cannot_serve_the_target_is_refused(tiny_checkpoint: Callable[..., str]) -> None:
    target = tiny_checkpoint("llama")
    with pytest.raises(ValueError, match=r"speculative_config\.model=.* has vocab_size 800 .* share the target's"):
        LLM(model=target, **ENGINE_OPTIONS, speculative_config=draft(tiny_checkpoint("llama", vocab_size=800)))
    short = tiny_checkpoint("llama", seed=1, max_position_embeddings=64)
    with pytest.raises(ValueError, match=r"speculative_config\.model=.* holds 64 positions.*max_model_len=128"):
        LLM(model=target, **ENGINE_OPTIONS, speculative_config=draft(short))


def test_the_scheduler_takes_k_lookahead_slots_from_spare_free_blocks_only() -> None:
    def step(num_blocks: int, requests: int) -> list[int]:
        """Blocks each request holds after its first step: a 6-token prompt, k = 3, blocks of 4 tokens."""
        kv = KVCacheManager(num_blocks, 4)
        spec = Speculator(SpeculativeConfig.parse(draft("unused")))
        sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, speculator=spec)
        for i in range(requests):
            sched.add(Request(f"r{i}", [5 + i] * 6, SamplingParams(max_tokens=20), max_model_len=64))
        out = sched.schedule()
        return [len(c.block_table) for c in out.chunks]

    # 6 + 3 positions: 3 blocks, not the prompt's 2. Nothing more without a spare block per running request.
    assert step(num_blocks=16, requests=2) == [3, 3]
    assert step(num_blocks=7, requests=2) == [3, 2]  # 2 + 2 taken, 3 free: r0's lookahead leaves 2, none to spare
    assert step(num_blocks=6, requests=2) == [2, 2]


def test_no_lookahead_slots_are_taken_for_a_step_after_which_the_draft_does_not_run() -> None:
    kv = KVCacheManager(16, 4)
    spec = Speculator(SpeculativeConfig.parse(draft("unused")))
    spec.draft_k = 0  # the switch turned speculation off: the draft runs nothing after this step
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, speculator=spec)
    for i in range(2):
        sched.add(Request(f"r{i}", [5 + i] * 6, SamplingParams(max_tokens=20), max_model_len=64))
    assert [len(c.block_table) for c in sched.schedule().chunks] == [2, 2]  # the prompts' blocks only


def test_the_warm_up_runs_the_drafts_forward_and_proposals(tiny_checkpoint: Callable[..., str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    proposals: list[dict[str, list[int]]] = []
    real = draft_model.DraftModel.step

    def spy(self: draft_model.DraftModel, *args: Any) -> dict[str, list[int]]:
        proposals.append(real(self, *args))
        return proposals[-1]

    monkeypatch.setattr(draft_model.DraftModel, "step", spy)
    ckpt = tiny_checkpoint("llama")
    LLM(model=ckpt, **ENGINE_OPTIONS, speculative_config=draft(ckpt))
    assert len(proposals) == 2 and all(len(p) == 1 and len(*p.values()) == 3 for p in proposals)


def test_the_kv_pool_counts_the_drafts_bytes_per_block(tiny_checkpoint: Callable[..., str]) -> None:
    target = tiny_checkpoint("llama")
    small = tiny_checkpoint("llama", seed=3, num_hidden_layers=1, num_key_value_heads=1)
    plain = LLM(model=target, **ENGINE_OPTIONS)
    spec = LLM(model=target, **ENGINE_OPTIONS, speculative_config=draft(small))
    dm = spec.engine.runner.draft
    assert dm is not None and plain.engine.runner.draft is None
    assert dm.bytes_per_block() == plain.engine.runner.bytes_per_block() // 4  # half the layers, half the heads
    assert spec.engine.runner.bytes_per_block() == plain.engine.runner.bytes_per_block() + dm.bytes_per_block()
    assert spec.engine.runner.num_blocks == ENGINE_OPTIONS["kv_cache_memory_bytes"] // \
        spec.engine.runner.bytes_per_block()
    assert tuple(dm.attn_layers[0].k_cache.shape[:2]) == (spec.engine.runner.num_blocks, ENGINE_OPTIONS["block_size"])


def test_tensor_parallel_target_with_a_draft_on_rank_0(tiny_checkpoint: Callable[..., str]) -> None:
    target, other = tiny_checkpoint("llama"), tiny_checkpoint("llama", seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain, _ = run(target, PROMPTS, params, None, dtype="float32")
    for path in (target, other):
        with LLM(model=target, **ENGINE_OPTIONS, dtype="float32", tensor_parallel_size=2,
                 speculative_config=draft(path)) as llm:
            same(plain, [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)])
            assert llm.engine.runner.draft is not None  # on rank 0; rank 1 runs its target shard alone
            assert drafted(llm)[0] > 50


def _random_weights(src: Path, out: Path) -> str:
    """A copy of a checkpoint with every tensor redrawn at random (same shapes and scales): an untrained draft."""
    shutil.copytree(src, out)
    gen = torch.Generator().manual_seed(0)
    for f in out.glob("*.safetensors"):
        tensors = load_file(str(f))
        save_file({k: (torch.randn(v.shape, generator=gen) * v.float().std()).to(v.dtype) for k, v in tensors.items()},
                  str(f))
    return str(out)


def test_a_trained_draft_is_accepted_far_more_than_a_random_one(tmp_path: Path) -> None:
    # The fast recipe, from the user's cache after its first training (about 40 s of CPU once).
    train_pair(str(tmp_path / "pair"), FAST)
    target = str(tmp_path / "pair" / "target")
    prompts = ["def main(argv):\n    ", "import os\nimport sys\n\n", "class Foo(object):\n    def __init__(self",
               "    for i in range(len("]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    rates = []
    for path in (str(tmp_path / "pair" / "draft"), _random_weights(tmp_path / "pair" / "draft", tmp_path / "random")):
        llm = LLM(model=target, dtype="float32", kv_cache_memory_bytes=1 << 22, speculative_config=draft(path))
        llm.generate(prompts, params, use_tqdm=False)
        proposed, accepted = drafted(llm)
        rates.append(accepted / proposed)
    trained, untrained = rates
    assert trained > 0.15 and trained > untrained + 0.1, rates
