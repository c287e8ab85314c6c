"""`model train-tiny` in its fast variant: real training on the stdlib's source, transformers-written checkpoints
that kvfleet serves exactly, held-out perplexity below the unigram baseline, and the cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvfleet_agent import LLM, SamplingParams
from kvfleet_agent.models import train_tiny
from kvfleet_agent.models.stdlib_corpus import is_eval, source_files, texts
from kvfleet_agent.models.train_tiny import FAST, train_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, object], Path]:
    cache = tmp_path_factory.mktemp("cache")
    out = tmp_path_factory.mktemp("pair")
    return out, train_pair(str(out), FAST, cache), cache


def test_the_corpus_holds_back_whole_files_for_evaluation() -> None:
    files = source_files()
    held = [f for f in files if is_eval(f)]
    assert len(files) > 200 and 0 < len(held) < len(files) * 0.15
    train, evaluation = texts(200_000)
    assert train and evaluation and not set(train) & set(evaluation)


def test_both_models_learned_more_than_token_frequencies(pair: tuple[Path, dict[str, object], Path]) -> None:
    _, report, _ = pair
    target, draft = report["target"], report["draft"]
    assert isinstance(target, dict) and isinstance(draft, dict)
    unigram = report["unigram_perplexity"]
    assert isinstance(unigram, float)
    assert target["eval_perplexity"] < draft["eval_perplexity"] < unigram
    assert target["parameters"] > draft["parameters"]


@pytest.mark.parametrize("which", ["target", "draft"])
def test_kvfleet_serves_the_trained_checkpoints_exactly(pair: tuple[Path, dict[str, object], Path],
                                                         which: str) -> None:
    path = str(pair[0] / which)
    llm = LLM(model=path, dtype="float32", kv_cache_memory_bytes=1 << 22)
    prompt = "def main(argv):\n    "
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    ids = out.prompt_token_ids
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    want: list[int] = []
    with torch.no_grad():  # plain argmax, EOS included, as ignore_eos asks of kvfleet
        for _ in range(12):
            want.append(int(hf(input_ids=torch.tensor([ids + want])).logits[0, -1].argmax()))
    assert out.outputs[0].token_ids == want
    assert out.outputs[0].text  # the shared tokenizer decodes it
    llm.shutdown()


def test_a_trained_recipe_comes_from_the_cache(pair: tuple[Path, dict[str, object], Path], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    _, report, cache = pair

    def no_training(*_: object) -> None:
        raise AssertionError("the recipe was trained again")

    monkeypatch.setattr(train_tiny, "_build", no_training)
    again = train_pair(str(tmp_path / "copy"), FAST, cache)
    assert again == report and (tmp_path / "copy" / "target" / "config.json").exists()
