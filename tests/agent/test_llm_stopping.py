"""Tests of how LLM.generate ends requests (stop tokens, EOS, length limits, stop strings) and rejects bad prompts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from llm_helpers import ENGINE_OPTIONS, MAX_MODEL_LEN, PROMPTS, greedy, one

from kvfleet_agent.llm import LLM
from kvfleet_agent.models.tokenizer import Tokenizer
from kvfleet_agent.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(llm: LLM) -> Tokenizer:
    tok = llm.get_tokenizer()
    assert tok is not None
    return tok


# --- stopping ------------------------------------------------------------------------------------


def _first_new_token(tokens: list[int], start: int = 2) -> int:
    """Index of the first token at or after `start` that does not occur earlier in `tokens`."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


def test_stop_token_ids_end_with_stop(llm: LLM) -> None:
    full = one(llm, PROMPTS[0], greedy(16)).token_ids
    i = _first_new_token(full)
    comp = one(llm, PROMPTS[0], greedy(16, stop_token_ids=[full[i], 100_000]))
    assert comp.token_ids == full[:i + 1]  # the stop token itself is part of the output
    assert comp.finish_reason == "stop"
    assert comp.stop_reason == full[i]


def test_eos_stops_unless_ignore_eos(ckpt: Path, tmp_path: Path) -> None:
    base = LLM(model=str(ckpt), **ENGINE_OPTIONS)
    full = one(base, PROMPTS[1], greedy(16)).token_ids
    i = _first_new_token(full)
    # Same weights, but generation_config.json names a token greedy decoding reaches as EOS.
    copy = tmp_path / "eos_copy"
    shutil.copytree(ckpt, copy)
    gen_cfg = json.loads((copy / "generation_config.json").read_text())
    gen_cfg["eos_token_id"] = [full[i]]
    (copy / "generation_config.json").write_text(json.dumps(gen_cfg))
    eos_llm = LLM(model=str(copy), **ENGINE_OPTIONS)

    stopped = one(eos_llm, PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=16))
    assert stopped.token_ids == full[:i + 1]
    assert stopped.finish_reason == "stop"
    assert stopped.stop_reason is None  # EOS is not a user stop token

    ignored = one(eos_llm, PROMPTS[1], greedy(16))
    assert ignored.token_ids == full
    assert ignored.finish_reason == "length"


@pytest.mark.parametrize("max_tokens", [1, 7])
def test_max_tokens_gives_length(llm: LLM, max_tokens: int) -> None:
    for comp in (o.outputs[0] for o in llm.generate(PROMPTS, greedy(max_tokens), use_tqdm=False)):
        assert len(comp.token_ids) == max_tokens
        assert comp.finish_reason == "length"
        assert comp.stop_reason is None


def test_max_model_len_caps_output(llm: LLM) -> None:
    comp = one(llm, {"prompt_token_ids": [5] * (MAX_MODEL_LEN - 3)}, greedy(50))
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
    full = one(llm, prompt, greedy(48))
    text = full.text
    stop = _pick_stop(text, len(text) // 3)
    cut = text.find(stop)
    assert cut > 0

    comp = one(llm, prompt, greedy(48, stop=[stop]))
    assert comp.text == text[:cut]
    assert comp.finish_reason == "stop"
    assert comp.stop_reason == stop
    assert comp.token_ids == full.token_ids[:len(comp.token_ids)]
    assert len(comp.token_ids) < len(full.token_ids)

    incl = one(llm, prompt, greedy(48, stop=[stop], include_stop_str_in_output=True))
    assert incl.text == text[:cut + len(stop)]
    assert incl.finish_reason == "stop"
    assert incl.stop_reason == stop

    # The stop string completes on exactly the last allowed token: the stop string wins over max_tokens.
    at_limit = one(llm, prompt, greedy(len(comp.token_ids), stop=[stop]))
    assert at_limit.token_ids == comp.token_ids
    assert (at_limit.text, at_limit.finish_reason, at_limit.stop_reason) == (text[:cut], "stop", stop)


def test_earliest_stop_string_wins(llm: LLM) -> None:
    text = one(llm, PROMPTS[0], greedy(48)).text
    early = _pick_stop(text, len(text) // 4)
    start = text.find(early) + len(early)
    while text.find(late := _pick_stop(text, start)) <= text.find(early):
        start += 1  # `late` must first occur after `early` does
    comp = one(llm, PROMPTS[0], greedy(48, stop=[late, early]))
    assert comp.stop_reason == early
    assert comp.text == text[:text.find(early)]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_text_equals_decode_of_tokens(llm: LLM, tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
    params = [
        greedy(32, skip_special_tokens=skip_special_tokens),
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
        llm.generate([prompt], greedy(2), use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_longest_prompt_is_accepted(llm: LLM) -> None:
    comp = one(llm, {"prompt_token_ids": [5] * (MAX_MODEL_LEN - 1)}, greedy(4))
    assert len(comp.token_ids) == 1 and comp.finish_reason == "length"


def test_text_prompt_without_tokenizer_json(ckpt: Path, tmp_path: Path) -> None:
    copy = tmp_path / "no_tokenizer"
    shutil.copytree(ckpt, copy)
    (copy / "tokenizer.json").unlink()
    bare = LLM(model=str(copy), **ENGINE_OPTIONS)
    assert bare.get_tokenizer() is None
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        bare.generate(["hello"], greedy(2), use_tqdm=False)
    # Token ids still work; there is no text without a tokenizer.
    comp = one(bare, {"prompt_token_ids": [1, 5, 6]}, greedy(3))
    assert len(comp.token_ids) == 3 and comp.text == ""


def test_mismatched_prompt_and_params_lengths(llm: LLM) -> None:
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(PROMPTS[:2], [greedy(2)], use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(PROMPTS[:1], [greedy(2), greedy(2)], use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_failed_generate_leaves_nothing_behind(ckpt: Path) -> None:
    fresh = LLM(model=str(ckpt), **ENGINE_OPTIONS)
    with pytest.raises(ValueError, match="empty"):
        fresh.generate([PROMPTS[0], {"prompt_token_ids": []}], greedy(2), use_tqdm=False)
    assert not fresh.engine.has_unfinished()
    outs = fresh.generate([PROMPTS[1]], greedy(2), use_tqdm=False)
    assert len(outs) == 1 and len(outs[0].outputs[0].token_ids) == 2
