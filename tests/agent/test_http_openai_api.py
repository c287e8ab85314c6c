"""The OpenAI API's wider surface against a real agent, with the official openai client: n and best_of,
penalties and the other sampling fields, refusals by name, and responses that match the declared models."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from server_process import AgentProcess, running_agent

from kvfleet_agent import LLM, SamplingParams
from kvfleet_agent.server.api import responses

MODEL = "tiny"
BLOCK = 16


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint: Callable[..., str]) -> str:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def agent(model_dir: str) -> Iterator[AgentProcess]:
    with running_agent(model_dir, "--served-model-name", MODEL, "--block-size", str(BLOCK)) as a:
        yield a


@pytest.fixture(scope="module")
def client(agent: AgentProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=agent.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(model_dir: str) -> LLM:
    return LLM(model=model_dir, block_size=BLOCK)


def _metric(agent: AgentProcess, name: str) -> float:
    with urllib.request.urlopen(agent.url + "/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


def _raw(client: openai.OpenAI, **kwargs: Any) -> dict[str, Any]:
    body: dict[str, Any] = client.completions.with_raw_response.create(**kwargs).http_response.json()
    return body


# -- n and best_of ----------------------------------------------------------------------------------

def test_n_samples_are_seed_plus_i_distinct_and_reproducible(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": MODEL, "prompt": "Once upon", "max_tokens": 12, "temperature": 1.0, "seed": 7,
                          "extra_body": {"ignore_eos": True}}
    r = client.completions.create(n=3, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.text for c in r.choices]
    assert len(set(texts)) > 1, texts  # distinct samples, not one sample three times
    assert [c.text for c in client.completions.create(n=3, **kw).choices] == texts  # reproducible
    # Sample i is the request with seed + i, as in vLLM.
    assert [client.completions.create(**{**kw, "seed": 7 + i}).choices[0].text for i in range(3)] == texts
    assert r.usage is not None
    prompt_tokens = client.completions.create(**kw).usage.prompt_tokens  # type: ignore[union-attr]
    assert r.usage.prompt_tokens == prompt_tokens  # the prompt counts once, not n times
    assert r.usage.completion_tokens == 3 * 12


def test_n_samples_share_the_prompt_blocks(agent: AgentProcess, client: openai.OpenAI) -> None:
    prompt = [(17 * i + 5) % 700 + 3 for i in range(3 * BLOCK + 4)]  # 52 tokens: 3 full blocks, seen nowhere else
    queries = _metric(agent, "kvfleet_prefix_cache_queries_total")
    hits = _metric(agent, "kvfleet_prefix_cache_hits_total")
    client.completions.create(model=MODEL, prompt=prompt, n=4, max_tokens=3, temperature=1.0)
    # Sample 0 computes the prompt; samples 1..3 each find its 3 full blocks in the cache (shared, not copied).
    assert _metric(agent, "kvfleet_prefix_cache_queries_total") - queries == 4 * len(prompt)
    assert _metric(agent, "kvfleet_prefix_cache_hits_total") - hits == 3 * 3 * BLOCK


def test_streamed_n_choices_carry_their_index_and_match_the_whole(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 10,
                          "temperature": 1.0, "seed": 3, "n": 2}
    whole = client.chat.completions.create(**kw)
    texts: dict[int, str] = {}
    usage = None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
        usage = chunk.usage or usage
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert usage is not None and whole.usage is not None and usage.total_tokens == whole.usage.total_tokens


def test_best_of_returns_the_most_likely_sample(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": MODEL, "prompt": "The", "max_tokens": 6, "temperature": 1.0,
                          "extra_body": {"ignore_eos": True}}
    r = client.completions.create(best_of=4, seed=11, **kw)
    assert len(r.choices) == 1 and r.choices[0].logprobs is None  # logprobs were only used for ranking
    assert r.usage is not None and r.usage.completion_tokens == 4 * 6  # every sample drawn is counted
    samples = [client.completions.create(seed=11 + i, logprobs=0, **kw).choices[0] for i in range(4)]
    ranked = max(samples, key=lambda c: sum(c.logprobs.token_logprobs))  # type: ignore[arg-type,union-attr]
    assert r.choices[0].text == ranked.text


# -- sampling fields ----------------------------------------------------------------------------------

def test_penalties_min_p_and_min_tokens_match_the_engine(client: openai.OpenAI, offline: LLM) -> None:
    extra = {"frequency_penalty": 1.5, "presence_penalty": 0.5}
    for body, params in [
        (extra, SamplingParams(temperature=0, max_tokens=24, **extra)),  # type: ignore[arg-type]
        ({"repetition_penalty": 2.0, "min_tokens": 20}, SamplingParams(temperature=0, max_tokens=24,
                                                                       repetition_penalty=2.0, min_tokens=20)),
        ({"min_p": 0.2, "seed": 5, "temperature": 1.0}, SamplingParams(temperature=1.0, min_p=0.2, seed=5,
                                                                       max_tokens=24)),
    ]:
        want = offline.generate("Penalised", params, use_tqdm=False)[0].outputs[0]
        sent = {k: v for k, v in body.items() if k not in ("frequency_penalty", "presence_penalty", "seed",
                                                            "temperature")}
        r = client.completions.create(model=MODEL, prompt="Penalised", max_tokens=24, temperature=body.get(
            "temperature", 0), seed=body.get("seed"), frequency_penalty=body.get("frequency_penalty"),
            presence_penalty=body.get("presence_penalty"), extra_body=sent)
        assert r.choices[0].text == want.text, body


def test_logit_bias_forces_a_token_and_min_tokens_holds_off_eos(client: openai.OpenAI, model_dir: str) -> None:
    eos = json.loads((Path(model_dir) / "config.json").read_text())["eos_token_id"]
    free = _raw(client, model=MODEL, prompt=[5, 6, 7], max_tokens=8, temperature=1.0, logprobs=0, seed=1)
    forced = _raw(client, model=MODEL, prompt=[5, 6, 7], max_tokens=8, temperature=1.0, logprobs=0, seed=1,
                  logit_bias={"300": 100})
    tokens = forced["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 8 and len(set(tokens)) == 1  # token 300, at every step
    assert set(tokens) != set(free["choices"][0]["logprobs"]["tokens"])
    # EOS forced by its bias: min_tokens decides exactly where the output ends.
    r = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=30, logit_bias={str(eos): 100},
                                  extra_body={"min_tokens": 5})
    assert r.choices[0].finish_reason == "stop" and r.usage is not None and r.usage.completion_tokens == 6


# -- refusals and shapes -----------------------------------------------------------------------------

@pytest.mark.parametrize(("extra", "param"), [
    ({"temprature": 0.5}, "temprature"),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ({"guided_json": {"type": "nope"}}, "guided_json"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"logprobs": 21}, "logprobs"),
])
def test_unknown_and_unimplemented_fields_are_refused_by_name(client: openai.OpenAI, extra: dict[str, Any],
                                                             param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body=extra)
    assert info.value.body["param"] == param and f"'{param}'" in info.value.body["message"]  # type: ignore[index]


def test_no_op_values_of_unimplemented_fields_are_accepted(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       response_format={"type": "text"}, tool_choice="none", user="u-1")
    assert r.choices[0].message.role == "assistant"


def test_responses_match_their_declared_models(client: openai.OpenAI) -> None:
    body = _raw(client, model=MODEL, prompt="Shapes", max_tokens=4, n=2, logprobs=2)
    responses.CompletionResponse.model_validate(body)
    assert body["choices"][1]["logprobs"]["text_offset"][0] == 0
    chat = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3, logprobs=True, top_logprobs=2)
    responses.ChatCompletionResponse.model_validate(chat.http_response.json())


def test_continuous_usage_stats_put_usage_so_far_in_every_chunk(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model=MODEL, prompt="Count", max_tokens=4, n=2, stream=True, seed=1,
                                            extra_body={"ignore_eos": True},
                                            stream_options={"include_usage": True,
                                                            "continuous_usage_stats": True}))  # type: ignore[typeddict-unknown-key]
    counts = [c.usage.completion_tokens for c in chunks if c.choices and c.usage is not None]
    assert len(counts) == len([c for c in chunks if c.choices]) and counts == sorted(counts) and counts[-1] == 8
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
