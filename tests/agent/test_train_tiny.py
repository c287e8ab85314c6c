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


def test_the_target_learned_more_than_token_frequencies(pair: tuple[Path, dict[str, object], Path]) -> None:
    _, report, _ = pair
    target, draft = report["target"], report["draft"]
    assert isinstance(target, dict) and isinstance(draft, dict)
    unigram = report["unigram_perplexity"]
    assert isinstance(unigram, float)
    # The draft is distilled from the target: what it learned is measured as agreement with the target (below); in
    # this short recipe its perplexity on the text follows a target that is itself far from converged.
    assert target["eval_perplexity"] < unigram
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



def test_distillation_teaches_the_draft_its_targets_choices_not_the_texts() -> None:
    # A teacher with large random weights picks an arbitrary next token at each position, unrelated to the text: a
    # draft trained on the text never learns those choices; one distilled from the teacher does.
    torch.manual_seed(0)
    teacher = train_tiny._model(FAST.target, FAST).eval()
    with torch.no_grad():
        for p in teacher.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    w = torch.randint(FAST.vocab_size, (8, 33), generator=torch.Generator().manual_seed(1))
    agreement = {}
    for name, source in (("distilled", teacher), ("text", None)):
        draft = train_tiny._model(FAST.draft, FAST)
        opt = torch.optim.AdamW(draft.parameters(), lr=1e-2)
        draft.train()
        for _ in range(60):
            train_tiny._loss(draft, w, source).backward()
            opt.step()
            opt.zero_grad()
        agreement[name] = train_tiny.agreement(draft, teacher, w, 8)
    assert agreement["distilled"] > 0.7 and agreement["text"] < 0.1, agreement


def test_the_report_carries_the_drafts_agreement_with_its_target(pair: tuple[Path, dict[str, object], Path]) -> None:
    draft = pair[1]["draft"]
    assert isinstance(draft, dict) and 0.0 < draft["target_agreement"] < 1.0
