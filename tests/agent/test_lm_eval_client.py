"""lm-eval's `local-completions` against a real agent: a loglikelihood (multiple-choice) task and a generate_until
task over small local datasets the test writes; the tokenizer comes from the agent (/tokenize, /detokenize,
/tokenizer_info), so nothing is downloaded. Each loglikelihood lm-eval reports is checked against the engine's."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from server_process import AgentProcess, running_agent

from kvfleet_agent import LLM, SamplingParams
from kvfleet_agent.models.tokenizer import Tokenizer

lm_eval = pytest.importorskip("lm_eval")  # the dev extra installs it

MODEL = "tiny"
QUESTIONS = [
    {"question": "The sky is", "choices": ["blue", "green", "loud"], "answer": 0},
    {"question": "Two plus two is", "choices": ["four", "five"], "answer": 0},
    {"question": "Water is", "choices": ["dry", "wet", "square", "late"], "answer": 1},
]


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint: Callable[..., str]) -> str:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def agent(model_dir: str) -> Iterator[AgentProcess]:
    with running_agent(model_dir, "--served-model-name", MODEL, "--max-model-len", "256") as a:
        yield a


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lm-eval-tasks")
    data = root / "qa.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    (root / "mc.yaml").write_text(
        "task: kvfleet_tiny_mc\n" + common + "output_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n")
    (root / "gen.yaml").write_text(
        "task: kvfleet_tiny_gen\n" + common + "output_type: generate_until\ndoc_to_text: '{{question}}'\n"
        "doc_to_target: '{{choices[answer]}}'\ngeneration_kwargs:\n  until: ['\\n']\n  max_gen_toks: 6\n"
        "  do_sample: false\nmetric_list:\n  - metric: exact_match\n")
    return root


def _evaluate(agent: AgentProcess, tasks: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    for offline in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):  # prove nothing is fetched
        monkeypatch.setenv(offline, "1")
    results: dict[str, Any] = simple_evaluate(
        model="local-completions", tasks=[name], task_manager=TaskManager(include_path=str(tasks)),
        model_args=f"model={MODEL},base_url={agent.url}/v1/completions,tokenizer_backend=remote,"
                   "num_concurrent=1,max_retries=1,tokenized_requests=True", log_samples=True)
    return results


def test_loglikelihood_task_scores_match_the_engine(agent: AgentProcess, tasks: Path, model_dir: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    results = _evaluate(agent, tasks, "kvfleet_tiny_mc", monkeypatch)
    samples = results["samples"]["kvfleet_tiny_mc"]
    assert len(samples) == len(QUESTIONS)
    tok = Tokenizer.from_dir(model_dir)
    assert tok is not None
    llm = LLM(model=model_dir)
    correct = 0
    for sample in samples:
        doc = sample["doc"]
        scores = []
        for (context, continuation), [(got, _)] in zip(sample["arguments"], sample["resps"], strict=True):
            # lm-eval's split: the whole text encoded, the context's tokens first (no special tokens).
            whole = tok.encode(context + continuation, add_special_tokens=False)
            ctxlen = len(tok.encode(context, add_special_tokens=False))
            out = llm.generate([{"prompt_token_ids": whole}], SamplingParams(max_tokens=1, prompt_logprobs=1),
                               use_tqdm=False)[0]
            want = sum(lp.logprob for lp in out.prompt_logprobs[ctxlen:] if lp is not None)  # type: ignore[index]
            assert math.isclose(got, want, abs_tol=1e-3), (context, continuation)
            scores.append(want)
        correct += scores.index(max(scores)) == doc["answer"]
    assert results["results"]["kvfleet_tiny_mc"]["acc,none"] == pytest.approx(correct / len(QUESTIONS))


def test_generate_until_task_runs(agent: AgentProcess, tasks: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    results = _evaluate(agent, tasks, "kvfleet_tiny_gen", monkeypatch)
    assert len(results["samples"]["kvfleet_tiny_gen"]) == len(QUESTIONS)
    assert 0.0 <= results["results"]["kvfleet_tiny_gen"]["exact_match,none"] <= 1.0
