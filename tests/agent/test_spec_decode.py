"""Speculative decoding (n-gram prompt lookup, suffix decoding) through the offline API: greedy outputs
token-for-token those of plain decoding for every architecture, under preemption, prefix-cache hits and chunked
prefill; stop strings, stop ids and max_tokens landing inside a speculated run; seeded sampling reproducible; the
adaptive policy turning a useless speculation off; the counters and the agent's /metrics."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hf_reference import hf_greedy
from llm_helpers import ENGINE_OPTIONS
from server_process import running_agent
from spec_helpers import drafted, run, same

from kvfleet_agent.core.request import Request
from kvfleet_agent.core.speculator import Speculator
from kvfleet_agent.llm import LLM
from kvfleet_agent.models.train_tiny import FAST, train_pair
from kvfleet_agent.outputs import CompletionOutput
from kvfleet_agent.sampling_params import SamplingParams

# Forced speculation (adaptive off): every eligible decode step verifies drafts, so exactness is tested on every
# path; k=3 with lookup from a single token, so random checkpoints get proposals too.
NGRAM: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                         "prompt_lookup_max": 3, "adaptive": False}
# Suffix decoding forced likewise, proposing from any match however unlikely.
SUFFIX: dict[str, Any] = {"method": "suffix", "num_speculative_tokens": 3, "suffix_decoding_min_token_prob": 0.0,
                          "suffix_decoding_max_spec_factor": 4.0, "adaptive": False}
REPETITIVE = ["a b c a b c a b c a b", "one two one two one two", "x = x + 1\nx = x + 1\nx = x + 1\n",
              "the cat the cat the cat the", "hello world"]


@pytest.mark.parametrize("method", ["ngram", "suffix"])
@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2", "mistral"])
def test_greedy_outputs_equal_plain_decoding_for_every_architecture(tiny_checkpoint: Callable[..., str],
                                                                   arch: str, method: str) -> None:
    ckpt = tiny_checkpoint(arch)
    # Random weights seldom continue an n-gram: 100 tokens a prompt give a few accepted drafts (deterministic: the
    # checkpoints are seeded), so both the accepting and the rejecting paths run.
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    plain, _ = run(ckpt, REPETITIVE, params, None)
    spec, llm = run(ckpt, REPETITIVE, params, NGRAM if method == "ngram" else SUFFIX)
    same(plain, spec)
    proposed, accepted = drafted(llm)
    assert proposed > 100 and accepted > 0, (proposed, accepted)


def test_exact_under_preemption_prefix_hits_and_chunked_prefill(tiny_checkpoint: Callable[..., str],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = tiny_checkpoint("llama")
    shared = "the same long system prompt " * 6
    prompts = [shared + p for p in REPETITIVE] * 3
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    # A pool of 40 blocks of 4 for 15 requests of up to ~100 tokens: preemption; 24 tokens a step: chunked prefill.
    tight = _tight_pool(ckpt, {"block_size": 4, "max_num_batched_tokens": 24, "max_model_len": 128})
    plain, base = run(ckpt, prompts, params, None, **tight)
    oracle(monkeypatch, plain[:len(REPETITIVE)], prompts[:len(REPETITIVE)], ckpt)  # drafts mostly accepted
    spec, llm = run(ckpt, prompts, params, NGRAM, **tight)
    same(plain, spec)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and base.engine.stats().num_preemptions > 0
    assert stats.prefix_cache_hits > 0 and llm.engine.scheduler.num_partial_prefills > 0
    proposed, accepted = drafted(llm)
    assert accepted > proposed / 2, (proposed, accepted)


def test_suffix_decoding_is_exact_under_preemption_and_proposes_from_earlier_requests(
        tiny_checkpoint: Callable[..., str]) -> None:
    """The same prompts again, after the first ones finished: the shared cache holds their outputs, so the repeats'
    drafts are mostly accepted; meanwhile a tight pool preempts and chunks, and every output stays plain decoding's."""
    ckpt = tiny_checkpoint("llama")
    prompts = [f"{i} unrelated words here {i}" for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    tight = _tight_pool(ckpt, {"block_size": 4, "max_num_batched_tokens": 24, "max_model_len": 128})
    plain, _ = run(ckpt, prompts * 3, params, None, **tight)
    llm = LLM(model=ckpt, **{**ENGINE_OPTIONS, **tight}, speculative_config=SUFFIX)
    first = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    before = drafted(llm)
    again = [o.outputs[0] for o in llm.generate(prompts * 2, params, use_tqdm=False)]
    same(plain, first + again)
    proposed, accepted = (a - b for a, b in zip(drafted(llm), before, strict=True))
    assert llm.engine.stats().num_preemptions > 0
    assert accepted > 0.8 * proposed and proposed > 5 * 40, (proposed, accepted)


def test_suffix_decoding_on_a_transformers_checkpoint_gives_transformers_own_greedy_tokens(tmp_path: Path) -> None:
    """The fast trained target, written by transformers' save_pretrained, served with suffix decoding: every token is
    the one transformers' own greedy decoding picks, also for the repeats that draft from the shared outputs."""
    train_pair(str(tmp_path / "pair"), FAST)  # from the user's cache after its first training
    target = str(tmp_path / "pair" / "target")
    llm = LLM(model=target, dtype="float32", speculative_config=SUFFIX)
    prompts = [llm.engine.tokenize(p) for p in ("def main(argv):\n    ", "import os\nimport sys\n\n",
                                               "class Foo(object):\n    def __init__(self")]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for _ in range(2):  # the second time, the first answers are among the shared outputs
        before = drafted(llm)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for prompt, out in zip(prompts, outs, strict=True):
            assert out.outputs[0].token_ids == hf_greedy(target, prompt, 32)
    proposed, accepted = (a - b for a, b in zip(drafted(llm), before, strict=True))
    assert accepted > 0.8 * proposed > 0, (proposed, accepted)


def _tight_pool(ckpt: str, options: dict[str, Any]) -> dict[str, Any]:
    """Options with a KV pool of 40 blocks (its bytes from the engine's own bytes per block)."""
    probe = LLM(model=ckpt, **{**ENGINE_OPTIONS, **options})
    per_block = probe.engine.runner.bytes_per_block()
    probe.engine.shutdown()
    return {**options, "kv_cache_memory_bytes": 40 * per_block}


def oracle(monkeypatch: pytest.MonkeyPatch, llm_ref: list[CompletionOutput], prompts: list[str], ckpt: str) -> None:
    """Replace the n-gram guess by the reference greedy continuation, with every third guess's last token wrong: a
    proposer that is mostly right, so verified runs are accepted in full or in part and the tokens that end a
    request land inside them. Everything else (scheduling, verification, bookkeeping) runs for real."""
    probe = LLM(model=ckpt, **ENGINE_OPTIONS)
    refs = {tuple(probe.engine.tokenize(p)): o.token_ids for p, o in zip(prompts, llm_ref, strict=True)}
    probe.engine.shutdown()
    calls = [0]

    def guess(self: Speculator, req: Request, room: int) -> tuple[list[int], int]:
        ref = refs[tuple(req.prompt_token_ids)]
        done = req.num_output_tokens
        out = list(ref[done:done + room])
        calls[0] += 1
        if out and calls[0] % 3 == 0:
            out[-1] = (out[-1] + 1) % 100
        return out, 0

    monkeypatch.setattr(Speculator, "_guess", guess)


def test_stops_and_lengths_inside_a_speculated_run_end_it_there(tiny_checkpoint: Callable[..., str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = tiny_checkpoint("llama")
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ref, _ = run(ckpt, REPETITIVE, long, None)
    cases = []
    for out in ref:
        mid = out.token_ids[len(out.token_ids) // 2]
        text = out.text[len(out.text) // 2:len(out.text) // 2 + 2]
        cases += [SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[mid], ignore_eos=True),
                  SamplingParams(temperature=0.0, max_tokens=40, stop=[text] if text.strip() else [],
                                 ignore_eos=True),
                  SamplingParams(temperature=0.0, max_tokens=len(out.token_ids) // 2 + 1, ignore_eos=True)]
    prompts = [p for p in REPETITIVE for _ in range(3)]
    plain, _ = run(ckpt, prompts, cases, None)
    oracle(monkeypatch, ref, REPETITIVE, ckpt)
    spec, llm = run(ckpt, prompts, cases, NGRAM)
    same(plain, spec)
    assert any(o.finish_reason == "stop" for o in spec) and any(o.finish_reason == "length" for o in spec)
    proposed, accepted = drafted(llm)
    assert accepted > proposed / 2, (proposed, accepted)  # mostly accepted: the ends fall inside verified runs


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_seeded_sampling_with_speculation_is_reproducible(tiny_checkpoint: Callable[..., str], method: str) -> None:
    ckpt = tiny_checkpoint("llama")
    params = [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=32, seed=s, ignore_eos=True) for s in (1, 1, 2)]
    prompts = [REPETITIVE[0]] * 3
    config = NGRAM if method == "ngram" else SUFFIX
    first, llm = run(ckpt, prompts, params, config)
    again, _ = run(ckpt, prompts, params, config)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert first[0].token_ids != first[2].token_ids
    if method == "ngram":  # drafts from the request alone: a seed fixes its output whatever runs beside it
        assert first[0].token_ids == first[1].token_ids
    assert drafted(llm)[0] > 0


def test_adaptive_speculation_stops_drafting_when_nothing_is_accepted(tiny_checkpoint: Callable[..., str]) -> None:
    """A random checkpoint rarely continues a prompt's n-grams: the adaptive policy learns it and stops."""
    ckpt = tiny_checkpoint("llama", seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    prompts = [f"{i} unrelated words here {i}" for i in range(4)]
    fixed, fixed_llm = run(ckpt, prompts, params, NGRAM)
    adaptive, llm = run(ckpt, prompts, params, {**NGRAM, "adaptive": True})
    same(fixed, adaptive)
    fixed_drafts, fixed_accepted = drafted(fixed_llm)
    drafts, _ = drafted(llm)
    assert fixed_accepted / fixed_drafts < 0.3, (fixed_accepted, fixed_drafts)  # the premise
    assert drafts < fixed_drafts / 2, (drafts, fixed_drafts)


def test_the_agent_exports_speculation_counters(tiny_checkpoint: Callable[..., str]) -> None:
    import json
    import urllib.request

    with running_agent(tiny_checkpoint("llama"), "--speculative-config", json.dumps(NGRAM),
                       "--metrics-compat", "vllm", "--served-model-name", "tiny") as agent:
        body = json.dumps({"model": "tiny", "prompt": REPETITIVE[0], "max_tokens": 24, "temperature": 0,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(f"{agent.url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert resp.status == 200
        text = urllib.request.urlopen(f"{agent.url}/metrics", timeout=10).read().decode()
    lines = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
             if line.startswith(("kvfleet_spec_decode", "vllm:spec_decode"))}
    drafts = next(v for k, v in lines.items() if k.startswith("kvfleet_spec_decode_num_draft_tokens_total"))
    assert drafts > 0 and 'method="ngram"' in next(k for k in lines if k.startswith("kvfleet_spec_decode_num_drafts"))
    assert any(k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total") and 'position="0"' in k
               for k in lines)


def test_a_bad_speculative_config_is_refused_naming_the_key(tiny_checkpoint: Callable[..., str]) -> None:
    for spec, says in (({"method": "eagle", "num_speculative_tokens": 3}, "method='eagle' is not implemented yet"),
                       ({"method": "ngram"}, "num_speculative_tokens=None must be an integer"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "speculative_config.typo"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
                         "prompt_lookup_max": 2}, "prompt_lookup_min=4 is above prompt_lookup_max=2"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "suffix_decoding_max_tree_depth": 4},
                        "suffix_decoding_max_tree_depth applies to method 'suffix' only"),
                       ({"method": "suffix", "num_speculative_tokens": 2, "suffix_decoding_min_token_prob": 2},
                        "suffix_decoding_min_token_prob=2 must be a number from 0.0 to 1.0"),
                       ({"method": "suffix", "num_speculative_tokens": 2, "model": "/d"},
                        "method is 'suffix', which uses no model"),
                       ({"method": "suffix"}, "num_speculative_tokens=None must be an integer")):
        with pytest.raises(ValueError, match=says.replace("(", r"\(").replace("[", r"\[")):
            LLM(model=tiny_checkpoint("llama"), **ENGINE_OPTIONS, speculative_config=spec)
