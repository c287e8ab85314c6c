"""Tests for sampling and stopping: SamplingParams validation, the Sampler, and LLM.generate end to end.

The reference for model outputs is transformers' own implementation of the same tiny checkpoint.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfleet_agent.engine.sampler import Sampler, _cut
from kvfleet_agent.llm import LLM, Prompt
from kvfleet_agent.models.tokenizer import Tokenizer
from kvfleet_agent.outputs import CompletionOutput
from kvfleet_agent.sampling_params import MAX_STOP_STRINGS, SamplingParams

transformers = pytest.importorskip("transformers")

MAX_MODEL_LEN = 128
ENGINE_OPTIONS: dict[str, Any] = {
    "kv_cache_memory_bytes": 4 << 20,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 256,
    "max_model_len": MAX_MODEL_LEN,
    "enable_prefix_caching": True,
    "block_size": 16,
}
PROMPTS = ["The quick brown fox", "hello world", "one two three four five", "café naïve Straße"]


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint: Callable[..., str]) -> Path:
    return Path(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def llm(ckpt: Path) -> LLM:
    return LLM(model=str(ckpt), **ENGINE_OPTIONS)


@pytest.fixture(scope="module")
def tokenizer(llm: LLM) -> Tokenizer:
    tok = llm.get_tokenizer()
    assert tok is not None
    return tok


@pytest.fixture(scope="module")
def hf_model(ckpt: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()


def _greedy(max_tokens: int = 16, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _one(llm: LLM, prompt: Prompt, params: SamplingParams) -> CompletionOutput:
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    return out.outputs[0]


def _tokens(llm: LLM, prompts: list[str], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


# --- SamplingParams validation -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"seed": "x"}, "seed"),
    ],
    ids=lambda v: v if isinstance(v, str) else ",".join(f"{k}={str(x)[:20]}" for k, x in v.items()),
)
def test_sampling_params_rejects_invalid_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert f"SamplingParams.{field}=" in str(info.value)


def test_sampling_params_accepts_boundaries_and_normalises() -> None:
    p = SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0, top_k=-1, logprobs=20, seed=0,
                       stop=[f"s{i}" for i in range(MAX_STOP_STRINGS)])
    assert p.top_k == 0  # -1 is vLLM's spelling of "no top-k"
    assert p.greedy
    assert len(p.stop) == MAX_STOP_STRINGS
    single = SamplingParams(stop="END", logprobs=0, temperature=100.0)  # type: ignore[arg-type]
    assert single.stop == ["END"]
    assert not single.greedy


# --- greedy and seeded sampling through the engine ------------------------------------------------


def test_greedy_is_deterministic_and_batch_independent(llm: LLM) -> None:
    first = _tokens(llm, PROMPTS, _greedy())
    second = _tokens(llm, PROMPTS, _greedy())
    assert first == second
    assert all(len(t) == 16 for t in first)
    # Alone, or batched in another order beside random requests: the same tokens.
    for i, prompt in enumerate(PROMPTS):
        assert _tokens(llm, [prompt], _greedy()) == [first[i]]
    mixed = _tokens(llm, [PROMPTS[2], PROMPTS[0], PROMPTS[1]],
                    [SamplingParams(temperature=1.0, max_tokens=30), _greedy(), SamplingParams(top_k=5)])
    assert mixed[1] == first[0]


def test_seeded_sampling_is_reproducible_and_batch_independent(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True)
    alone = _tokens(llm, [PROMPTS[1]], seeded)[0]
    assert _tokens(llm, [PROMPTS[1]], seeded)[0] == alone
    assert alone != _tokens(llm, [PROMPTS[1]], _greedy(24))[0]  # it really sampled

    others = [
        SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True),  # unseeded: uses the shared generator
        seeded,
        SamplingParams(temperature=0.7, top_k=20, max_tokens=5),
        SamplingParams(temperature=1.0, seed=1, max_tokens=30, ignore_eos=True),
        seeded,  # a second request with the same seed draws exactly the same tokens
    ]
    batch = _tokens(llm, [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[3], PROMPTS[1]], others)
    assert batch[1] == alone
    assert batch[4] == alone


def test_different_seeds_give_different_samples(llm: LLM) -> None:
    outs = {
        seed: tuple(_tokens(llm, [PROMPTS[0]], SamplingParams(seed=seed, max_tokens=16, ignore_eos=True))[0])
        for seed in (1, 2, 3)
    }
    assert len(set(outs.values())) == 3


def test_unseeded_sampling_varies(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    batch = [tuple(t) for t in _tokens(llm, [PROMPTS[0]] * 6, params)]
    assert len(set(batch)) == 6
    again = [tuple(t) for t in _tokens(llm, [PROMPTS[0]] * 6, params)]
    assert not set(batch) & set(again)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=1, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=5.0, top_k=1, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=3.0, top_k=50, top_p=1e-6, max_tokens=16, ignore_eos=True, seed=3),
    ],
    ids=["top_k=1", "top_k=1,T=5", "top_p=1e-6", "top_k=50,top_p=1e-6,T=3"],
)
def test_degenerate_cuts_equal_greedy(llm: LLM, params: SamplingParams) -> None:
    assert _tokens(llm, PROMPTS, params) == _tokens(llm, PROMPTS, _greedy())


# --- the top-k / top-p cut -----------------------------------------------------------------------


def _reference_keep(row: list[float], k: int, p: float) -> tuple[set[int], set[int]]:
    """Tokens that must be kept and tokens that must be dropped, in float64 (near-boundary tokens in neither)."""
    order = sorted(range(len(row)), key=lambda i: -row[i])
    if k > 0:
        order = order[:k]
    top = max(row[i] for i in order)
    weights = [math.exp(row[i] - top) for i in order]
    total = sum(weights)
    must: set[int] = set()
    never = set(range(len(row))) - set(order)
    above = 0.0  # probability mass of the tokens ranked above this one
    for i, w in zip(order, weights, strict=True):
        if above <= p - 1e-5 or i == order[0]:
            must.add(i)
        elif above > p + 1e-5:
            never.add(i)
        above += w / total
    return must, never


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_cut_matches_per_row_reference(data: st.DataObject) -> None:
    vocab = data.draw(st.integers(1, 40), label="vocab")
    n_rows = data.draw(st.integers(1, 4), label="rows")
    logit = st.floats(-30, 30, allow_nan=False, allow_infinity=False, width=32)
    # Distinct logits per row: with ties the top-k set is a matter of tie-breaking.
    rows = [data.draw(st.lists(logit, min_size=vocab, max_size=vocab, unique=True), label="row")
            for _ in range(n_rows)]
    top_k = data.draw(st.lists(st.integers(0, vocab + 2), min_size=n_rows, max_size=n_rows), label="top_k")
    top_p = data.draw(st.lists(st.floats(1e-6, 1.0), min_size=n_rows, max_size=n_rows), label="top_p")
    logits = torch.tensor(rows, dtype=torch.float32)

    out = _cut(logits.clone(), top_k, top_p)

    assert out.shape == logits.shape
    for r in range(n_rows):
        kept = torch.isfinite(out[r])
        assert kept.any(), "every row keeps at least one token"
        assert torch.equal(out[r][kept], logits[r][kept]), "kept logits are unchanged"
        assert bool(torch.isneginf(out[r][~kept]).all())
        must, never = _reference_keep(rows[r], top_k[r], top_p[r])
        kept_ids = set(torch.nonzero(kept).flatten().tolist())
        assert must <= kept_ids, (must - kept_ids, top_k[r], top_p[r])
        assert not (never & kept_ids), (never & kept_ids, top_k[r], top_p[r])
        if top_k[r] > 0:
            assert len(kept_ids) <= top_k[r]


def test_cut_with_top_p_one_and_no_top_k_keeps_every_token() -> None:
    # A row that disables both cuts, batched with a row that uses top-k (so _cut runs on the batch).
    row = 8.0 * torch.sin(1.7 * torch.arange(100, dtype=torch.float32))
    logits = torch.stack([row, row])
    out = _cut(logits.clone(), [0, 5], [1.0, 0.5])
    assert torch.equal(out[0], row), f"{int(torch.isinf(out[0]).sum())} tokens dropped from a top_p=1 row"


# --- the sampled distribution ----------------------------------------------------------------------

_DIST_LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -4.0])
_DRAWS = 20000


def _frequencies(params: list[SamplingParams], logits: torch.Tensor = _DIST_LOGITS) -> torch.Tensor:
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    tokens, logprobs = sampler.sample(logits.repeat(len(params), 1), [f"r{i}" for i in range(len(params))], params)
    assert logprobs == [None] * len(params)
    return torch.bincount(torch.tensor(tokens), minlength=logits.numel()).double() / len(params)


def _assert_matches(freq: torch.Tensor, expected: torch.Tensor, n: int) -> None:
    expected = expected.double()
    sigma = (expected * (1 - expected) / n).sqrt()
    err = (freq - expected).abs()
    assert bool((err <= 5 * sigma + 1e-3).all()), f"freq {freq.tolist()} vs expected {expected.tolist()}"


def test_temperature_one_matches_softmax() -> None:
    freq = _frequencies([SamplingParams(temperature=1.0)] * _DRAWS)
    _assert_matches(freq, torch.softmax(_DIST_LOGITS.double(), -1), _DRAWS)


def test_temperature_half_sharpens() -> None:
    freq = _frequencies([SamplingParams(temperature=0.5)] * _DRAWS)
    expected = torch.softmax(_DIST_LOGITS.double() / 0.5, -1)
    _assert_matches(freq, expected, _DRAWS)
    assert freq[0] > torch.softmax(_DIST_LOGITS.double(), -1)[0] + 0.1  # the top token gained mass


def test_top_k_three_samples_only_the_top_three() -> None:
    freq = _frequencies([SamplingParams(temperature=1.0, top_k=3)] * _DRAWS)
    assert bool((freq[3:] == 0).all())
    expected = torch.zeros(8, dtype=torch.float64)
    expected[:3] = torch.softmax(_DIST_LOGITS[:3].double(), -1)
    _assert_matches(freq, expected, _DRAWS)


def test_top_p_samples_the_nucleus() -> None:
    probs = torch.softmax(_DIST_LOGITS.double(), -1)  # ≈ .50 .19 .11 .07 .04 .02 .01 .00
    top_p = float(probs[:2].sum()) + 0.01  # the mass above token 2 is below top_p, above token 3 it is not
    freq = _frequencies([SamplingParams(temperature=1.0, top_p=top_p)] * _DRAWS)
    assert bool((freq[3:] == 0).all())
    _assert_matches(freq, torch.cat([probs[:3] / probs[:3].sum(), torch.zeros(5, dtype=torch.float64)]), _DRAWS)


def test_seeded_rows_draw_from_their_own_generators() -> None:
    n = 4000
    # The same seed in every row: every request draws the same noise, so the same token.
    same = _frequencies([SamplingParams(seed=5)] * n)
    assert float(same.max()) == 1.0
    # One seed per request: still distributed as softmax across requests.
    freq = _frequencies([SamplingParams(seed=s) for s in range(n)])
    _assert_matches(freq, torch.softmax(_DIST_LOGITS.double(), -1), n)


# --- logprobs against transformers ---------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        _greedy(12, logprobs=5),
        SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=1.5, top_k=40, seed=12, max_tokens=12, ignore_eos=True, logprobs=1),
    ],
    ids=["greedy,k=5", "T=1,k=3", "T=1.5,top_k=40,k=1"],
)
def test_logprobs_match_transformers(llm: LLM, hf_model: Any, params: SamplingParams) -> None:
    outs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    k = params.logprobs
    assert k is not None
    for out in outs:
        comp = out.outputs[0]
        assert comp.logprobs is not None and len(comp.logprobs) == len(comp.token_ids) == params.max_tokens
        ids = out.prompt_token_ids + comp.token_ids
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids])).logits[0].double()
        n_prompt = len(out.prompt_token_ids)
        ref = torch.log_softmax(logits[n_prompt - 1:-1], dim=-1)  # row i predicts generated token i
        for i, (tok, lp) in enumerate(zip(comp.token_ids, comp.logprobs, strict=True)):
            assert lp.token_id == tok
            assert abs(lp.logprob - float(ref[i, tok])) <= 1e-4, (i, lp.logprob, float(ref[i, tok]))
            assert len(lp.top) == k
            argmax = int(ref[i].argmax())
            assert argmax in lp.top
            ref_top = torch.topk(ref[i], k)
            assert sorted(lp.top.values(), reverse=True) == pytest.approx(ref_top.values.tolist(), abs=1e-4)
            for alt, value in lp.top.items():
                assert abs(value - float(ref[i, alt])) <= 1e-4
            if params.greedy:
                assert float(ref[i, tok]) >= float(ref[i].max()) - 1e-4


def test_logprobs_zero_returns_only_the_sampled_token(llm: LLM) -> None:
    comp = _one(llm, PROMPTS[0], _greedy(4, logprobs=0))
    assert comp.logprobs is not None and len(comp.logprobs) == 4
    assert all(lp.top == {} and lp.logprob <= 0.0 for lp in comp.logprobs)
    assert _one(llm, PROMPTS[0], _greedy(4)).logprobs is None


# --- stopping ------------------------------------------------------------------------------------


def _first_new_token(tokens: list[int], start: int = 2) -> int:
    """Index of the first token at or after `start` that does not occur earlier in `tokens`."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


def test_stop_token_ids_end_with_stop(llm: LLM) -> None:
    full = _one(llm, PROMPTS[0], _greedy(16)).token_ids
    i = _first_new_token(full)
    comp = _one(llm, PROMPTS[0], _greedy(16, stop_token_ids=[full[i], 100_000]))
    assert comp.token_ids == full[:i + 1]  # the stop token itself is part of the output
    assert comp.finish_reason == "stop"
    assert comp.stop_reason == full[i]


def test_eos_stops_unless_ignore_eos(ckpt: Path, tmp_path: Path) -> None:
    base = LLM(model=str(ckpt), **ENGINE_OPTIONS)
    full = _one(base, PROMPTS[1], _greedy(16)).token_ids
    i = _first_new_token(full)
    # Same weights, but generation_config.json names a token greedy decoding reaches as EOS.
    copy = tmp_path / "eos_copy"
    shutil.copytree(ckpt, copy)
    gen_cfg = json.loads((copy / "generation_config.json").read_text())
    gen_cfg["eos_token_id"] = [full[i]]
    (copy / "generation_config.json").write_text(json.dumps(gen_cfg))
    eos_llm = LLM(model=str(copy), **ENGINE_OPTIONS)

    stopped = _one(eos_llm, PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=16))
    assert stopped.token_ids == full[:i + 1]
    assert stopped.finish_reason == "stop"
    assert stopped.stop_reason is None  # EOS is not a user stop token

    ignored = _one(eos_llm, PROMPTS[1], _greedy(16))
    assert ignored.token_ids == full
    assert ignored.finish_reason == "length"


@pytest.mark.parametrize("max_tokens", [1, 7])
def test_max_tokens_gives_length(llm: LLM, max_tokens: int) -> None:
    for comp in (o.outputs[0] for o in llm.generate(PROMPTS, _greedy(max_tokens), use_tqdm=False)):
        assert len(comp.token_ids) == max_tokens
        assert comp.finish_reason == "length"
        assert comp.stop_reason is None


def test_max_model_len_caps_output(llm: LLM) -> None:
    comp = _one(llm, {"prompt_token_ids": [5] * (MAX_MODEL_LEN - 3)}, _greedy(50))
    assert len(comp.token_ids) == 3
    assert comp.finish_reason == "length"


def _pick_stop(text: str, start: int) -> str:
    """A 3-letter ASCII substring of `text` at or after `start`."""
    for j in range(start, len(text) - 3):
        s = text[j:j + 3]
        if s.isascii() and s.isalpha():
            return s
    raise AssertionError(f"no ASCII stop string candidate in {text!r}")


@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_stop_string_cuts_text(llm: LLM, prompt: str) -> None:
    full = _one(llm, prompt, _greedy(48))
    text = full.text
    stop = _pick_stop(text, len(text) // 3)
    cut = text.find(stop)
    assert cut > 0

    comp = _one(llm, prompt, _greedy(48, stop=[stop]))
    assert comp.text == text[:cut]
    assert comp.finish_reason == "stop"
    assert comp.stop_reason == stop
    assert comp.token_ids == full.token_ids[:len(comp.token_ids)]
    assert len(comp.token_ids) < len(full.token_ids)

    incl = _one(llm, prompt, _greedy(48, stop=[stop], include_stop_str_in_output=True))
    assert incl.text == text[:cut + len(stop)]
    assert incl.finish_reason == "stop"
    assert incl.stop_reason == stop

    # The stop string completes on exactly the last allowed token: the stop string wins over max_tokens.
    at_limit = _one(llm, prompt, _greedy(len(comp.token_ids), stop=[stop]))
    assert at_limit.token_ids == comp.token_ids
    assert (at_limit.text, at_limit.finish_reason, at_limit.stop_reason) == (text[:cut], "stop", stop)


def test_earliest_stop_string_wins(llm: LLM) -> None:
    text = _one(llm, PROMPTS[0], _greedy(48)).text
    early = _pick_stop(text, len(text) // 4)
    start = text.find(early) + len(early)
    while text.find(late := _pick_stop(text, start)) <= text.find(early):
        start += 1  # `late` must first occur after `early` does
    comp = _one(llm, PROMPTS[0], _greedy(48, stop=[late, early]))
    assert comp.stop_reason == early
    assert comp.text == text[:text.find(early)]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_text_equals_decode_of_tokens(llm: LLM, tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
    params = [
        _greedy(32, skip_special_tokens=skip_special_tokens),
        SamplingParams(temperature=1.0, seed=21, max_tokens=32, ignore_eos=True,
                       skip_special_tokens=skip_special_tokens),
        SamplingParams(temperature=2.0, seed=22, max_tokens=32, ignore_eos=True,
                       skip_special_tokens=skip_special_tokens),
    ]
    for prompt in PROMPTS:
        for out in llm.generate([prompt] * len(params), params, use_tqdm=False):
            comp = out.outputs[0]
            assert comp.stop_reason is None
            assert comp.text == tokenizer.decode(comp.token_ids, skip_special_tokens=skip_special_tokens)


# --- bad prompts ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ({"prompt_token_ids": []}, "empty"),
        ({"prompt_token_ids": [1, "VOCAB"]}, "vocab_size"),
        ({"prompt_token_ids": [1, -1]}, "vocab_size"),
        ({"prompt_token_ids": [5] * MAX_MODEL_LEN}, "max_model_len"),
        ({"tokens": [1, 2]}, "prompt_token_ids"),
    ],
    ids=["empty", "id=vocab", "id=-1", "too-long", "wrong-key"],
)
def test_bad_prompts_raise(llm: LLM, prompt: Any, match: str) -> None:
    vocab = llm.engine.model_config.vocab_size
    if "prompt_token_ids" in prompt:
        prompt = {"prompt_token_ids": [vocab if t == "VOCAB" else t for t in prompt["prompt_token_ids"]]}
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt], _greedy(2), use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_longest_prompt_is_accepted(llm: LLM) -> None:
    comp = _one(llm, {"prompt_token_ids": [5] * (MAX_MODEL_LEN - 1)}, _greedy(4))
    assert len(comp.token_ids) == 1 and comp.finish_reason == "length"


def test_text_prompt_without_tokenizer_json(ckpt: Path, tmp_path: Path) -> None:
    copy = tmp_path / "no_tokenizer"
    shutil.copytree(ckpt, copy)
    (copy / "tokenizer.json").unlink()
    bare = LLM(model=str(copy), **ENGINE_OPTIONS)
    assert bare.get_tokenizer() is None
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        bare.generate(["hello"], _greedy(2), use_tqdm=False)
    # Token ids still work; there is no text without a tokenizer.
    comp = _one(bare, {"prompt_token_ids": [1, 5, 6]}, _greedy(3))
    assert len(comp.token_ids) == 3 and comp.text == ""


def test_mismatched_prompt_and_params_lengths(llm: LLM) -> None:
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(PROMPTS[:2], [_greedy(2)], use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(PROMPTS[:1], [_greedy(2), _greedy(2)], use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_failed_generate_leaves_nothing_behind(ckpt: Path) -> None:
    fresh = LLM(model=str(ckpt), **ENGINE_OPTIONS)
    with pytest.raises(ValueError, match="empty"):
        fresh.generate([PROMPTS[0], {"prompt_token_ids": []}], _greedy(2), use_tqdm=False)
    assert not fresh.engine.has_unfinished()
    outs = fresh.generate([PROMPTS[1]], _greedy(2), use_tqdm=False)
    assert len(outs) == 1 and len(outs[0].outputs[0].token_ids) == 2
