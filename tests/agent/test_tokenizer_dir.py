"""--tokenizer DIR (EngineConfig.tokenizer): the tokenizer saved by transformers in its own directory, beside weights
that have none; its EOS ids stop generation, and the model directory's generation_config.json ids still do."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from llm_helpers import ENGINE_OPTIONS, PROMPTS, greedy, one
from transformers import AutoTokenizer

from kvfleet_agent.config import EngineConfig
from kvfleet_agent.llm import LLM
from kvfleet_agent.sampling_params import SamplingParams

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def _weights_only(ckpt: Path, to: Path, eos: int | None = None) -> Path:
    shutil.copytree(ckpt, to)
    for name in _TOKENIZER_FILES:
        (to / name).unlink(missing_ok=True)
    if eos is not None:  # the model directory's own generation_config.json names another EOS
        gen = json.loads((to / "generation_config.json").read_text())
        (to / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [eos]}))
    return to


def _first_new(tokens: list[int], start: int = 2) -> int:
    """The first position whose token did not occur before: as EOS, greedy decoding stops exactly there."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


@pytest.fixture(scope="module")
def reference(ckpt: Path) -> list[int]:
    return list(one(LLM(model=str(ckpt), **ENGINE_OPTIONS), PROMPTS[1], greedy(16)).token_ids)


def test_a_separate_tokenizer_directory_tokenizes_and_its_eos_stops(ckpt: Path, tmp_path: Path,
                                                                      reference: list[int]) -> None:
    i = _first_new(reference)
    hf = AutoTokenizer.from_pretrained(str(ckpt))
    eos_text = hf.convert_ids_to_tokens(reference[i])
    tok_dir = tmp_path / "tok"
    AutoTokenizer.from_pretrained(str(ckpt), eos_token=eos_text).save_pretrained(str(tok_dir))
    weights = _weights_only(ckpt, tmp_path / "weights")
    llm = LLM(model=str(weights), tokenizer=str(tok_dir), **ENGINE_OPTIONS)
    assert llm.engine.tokenizer is not None and llm.engine.tokenizer.chat_template is not None  # from tok_dir
    full = one(llm, PROMPTS[1], greedy(16))
    assert full.token_ids == reference and full.text  # text prompts and text outputs: the tokenizer works
    stopped = one(llm, PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=16))
    assert stopped.token_ids == reference[:i + 1] and stopped.finish_reason == "stop"  # the tokenizer's EOS


def test_the_model_directorys_eos_still_counts(ckpt: Path, tmp_path: Path, reference: list[int]) -> None:
    j = _first_new(reference, 4)
    tok_dir = tmp_path / "tok"
    AutoTokenizer.from_pretrained(str(ckpt)).save_pretrained(str(tok_dir))
    weights = _weights_only(ckpt, tmp_path / "weights", eos=reference[j])
    llm = LLM(model=str(weights), tokenizer=str(tok_dir), **ENGINE_OPTIONS)
    assert one(llm, PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=16)).token_ids == reference[:j + 1]


def test_a_tokenizer_directory_must_hold_a_tokenizer(ckpt: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tokenizer="):
        EngineConfig(model=str(ckpt), tokenizer=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"no tokenizer\.json"):
        LLM(model=str(ckpt), tokenizer=str(tmp_path), **ENGINE_OPTIONS)
