"""Completions echo and prompt logprobs (what lm-eval's loglikelihood tasks send), against a real agent with the
official openai client; and --max-logprobs."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest
from server_process import AgentProcess, running_agent

from kvfleet_agent import LLM, SamplingParams
from kvfleet_agent.server.api import responses

MODEL = "tiny"


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint: Callable[..., str]) -> str:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def agent(model_dir: str) -> Iterator[AgentProcess]:
    # A small token budget, so a prompt's logprobs come from several prefill chunks.
    with running_agent(model_dir, "--served-model-name", MODEL, "--max-logprobs", "5",
                       "--max-num-batched-tokens", "24") as a:
        yield a


@pytest.fixture(scope="module")
def client(agent: AgentProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=agent.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(model_dir: str) -> LLM:
    return LLM(model=model_dir)


def _raw(client: openai.OpenAI, **kwargs: Any) -> dict[str, Any]:
    body: dict[str, Any] = client.completions.with_raw_response.create(**kwargs).http_response.json()
    responses.CompletionResponse.model_validate(body)
    return body


PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the woods."


def test_echo_with_max_tokens_zero_scores_the_prompt(client: openai.OpenAI, offline: LLM) -> None:
    body = _raw(client, model=MODEL, prompt=PROMPT, echo=True, logprobs=2, max_tokens=0, temperature=0)
    choice = body["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    want = offline.generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    assert want.prompt_logprobs is not None and len(want.prompt_token_ids) > 24  # several chunks
    lp = choice["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing predicts the first token
    assert len(lp["tokens"]) == len(want.prompt_token_ids)
    for got, ref, top in zip(lp["token_logprobs"][1:], want.prompt_logprobs[1:], lp["top_logprobs"][1:], strict=True):
        assert ref is not None and math.isclose(got, ref.logprob, abs_tol=1e-4)
        # The top 2 and the token itself, keyed by text (tokens decoding alike, such as partial characters, merge).
        allowed = [*ref.top.values(), ref.logprob]
        assert 1 <= len(top) <= 3 and all(any(math.isclose(v, a, abs_tol=1e-4) for a in allowed) for v in top.values())
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert [offsets[i + 1] - offsets[i] for i in range(len(offsets) - 1)] == [len(t) for t in lp["tokens"][:-1]]
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(want.prompt_token_ids)


def test_echo_puts_the_prompt_before_the_completion(client: openai.OpenAI) -> None:
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=1)
    echoed = _raw(client, model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=1, echo=True)
    choice = echoed["choices"][0]
    assert choice["text"] == PROMPT + plain.choices[0].text
    assert plain.choices[0].logprobs is not None
    assert choice["logprobs"]["token_logprobs"][-5:] == plain.choices[0].logprobs.token_logprobs
    offsets = choice["logprobs"]["text_offset"]
    assert offsets == sorted(offsets) and len(offsets) == len(choice["logprobs"]["tokens"])
    streamed = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, echo=True,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == choice["text"]


def test_token_id_prompts_echo_their_decoded_text(client: openai.OpenAI) -> None:
    ids = [5, 6, 7, 8, 9, 10]
    body = _raw(client, model=MODEL, prompt=[ids, ids[:3]], echo=True, max_tokens=0, logprobs=0)
    assert [len(c["logprobs"]["tokens"]) for c in body["choices"]] == [6, 3]
    assert body["choices"][1]["text"] and body["choices"][0]["text"].startswith(body["choices"][1]["text"])


def test_max_logprobs_bounds_every_logprobs_field(client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt="x", max_tokens=1, logprobs=5)
    with pytest.raises(openai.BadRequestError, match="--max-logprobs"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, logprobs=6)
    with pytest.raises(openai.BadRequestError, match="--max-logprobs"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                       logprobs=True, top_logprobs=6)


def test_max_tokens_zero_without_echo_is_refused_with_the_fix(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)


def _entries(scored: list[dict[str, Any] | None]) -> list[dict[str, Any]]:
    assert scored[0] is None  # nothing predicts the first prompt token
    return [e for e in scored[1:] if e is not None]


def test_prompt_logprobs_are_the_engines_with_ranks(client: openai.OpenAI, offline: LLM) -> None:
    want = offline.generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=3), use_tqdm=False)[0]
    assert want.prompt_logprobs is not None
    body = _raw(client, model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"prompt_logprobs": 3})
    scored = _entries(body["choices"][0]["prompt_logprobs"])
    assert len(scored) == len(want.prompt_token_ids) - 1
    for entry, ref, tid in zip(scored, want.prompt_logprobs[1:], want.prompt_token_ids[1:], strict=True):
        assert ref is not None and next(iter(entry)) == str(tid)  # the prompt token first, as vLLM
        assert math.isclose(entry[str(tid)]["logprob"], ref.logprob, abs_tol=1e-4)
        assert entry[str(tid)]["rank"] == ref.rank
        for t, v in ref.top.items():
            assert math.isclose(entry[str(t)]["logprob"], v, abs_tol=1e-4)
            assert entry[str(t)]["rank"] == 1 + sum(o > v for o in ref.top.values())
        assert len(entry) <= 4 and all(e["decoded_token"] is not None for e in entry.values())
    chat = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=1,
        extra_body={"prompt_logprobs": 0}).http_response.json()
    responses.ChatCompletionResponse.model_validate(chat)
    assert all(len(e) == 1 for e in _entries(chat["prompt_logprobs"]))  # k=0: the prompt token alone


def test_prompt_logprobs_with_echo_keep_each_fields_k(client: openai.OpenAI) -> None:
    body = _raw(client, model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1,
                extra_body={"prompt_logprobs": 4})
    choice = body["choices"][0]
    assert all(len(top) <= 2 for top in choice["logprobs"]["top_logprobs"][1:])  # logprobs=1 (+ the token)
    assert max(len(e) for e in _entries(choice["prompt_logprobs"])) >= 4


def test_prompt_logprobs_are_bounded_and_not_streamed(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="--max-logprobs"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={"prompt_logprobs": 6})
    with pytest.raises(openai.BadRequestError, match=r"prompt_logprobs.*stream"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, stream=True,
                                  extra_body={"prompt_logprobs": 1})
