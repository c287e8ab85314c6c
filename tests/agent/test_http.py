"""The agent process end to end: HTTP with the official openai client, gRPC, metrics, overload and drain."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_process import AgentProcess, running_agent, start_agent

from kvfleet_agent import LLM, SamplingParams
from kvfleet_agent.server import kvfleet_pb2 as pb
from kvfleet_agent.server import kvfleet_pb2_grpc as pb_grpc

# A checkpoint long enough (4096 positions, 4 layers) that long generations take seconds, so
# disconnects and drains land mid-generation without any timing assumptions.
SLOW = {"max_position_embeddings": 4096, "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 4}


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint: Callable[..., str]) -> str:
    return tiny_checkpoint("llama", **SLOW)


@pytest.fixture(scope="module")
def agent(model_dir: str) -> Iterator[AgentProcess]:
    with running_agent(model_dir, "--served-model-name", "tiny", "--max-num-seqs", "32",
                       "--max-queue-length", "64") as a:
        yield a


@pytest.fixture(scope="module")
def client(agent: AgentProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=agent.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(model_dir: str) -> LLM:
    return LLM(model=model_dir)


def metrics(url: str) -> dict[str, float]:
    """Scrape /metrics and flatten samples to 'name{label=value,...}' → value."""
    text = asyncio.run(_get_text(url + "/metrics"))
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model")
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


async def _get_text(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        assert r.status == 200
        return await r.text()


def wait_for_idle(url: str, timeout: float = 60.0) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits and no KV block is held (a condition, not a sleep)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if m["kvfleet_requests_running{}"] == 0 and m["kvfleet_requests_waiting{}"] == 0 \
                and m["kvfleet_kv_cache_usage_ratio{}"] == 0.0:
            return m
        assert time.monotonic() < deadline, f"server did not go idle: {m}"
        time.sleep(0.05)  # between polls of a condition, not as synchronisation


# -- the OpenAI API ---------------------------------------------------------------------------------

def test_completion_matches_offline_greedy(client: openai.OpenAI, offline: LLM) -> None:
    r = client.completions.create(model="tiny", prompt="The cache holds", max_tokens=12, temperature=0)
    want = offline.generate("The cache holds", SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)[0]
    assert r.choices[0].text == want.outputs[0].text
    assert r.choices[0].finish_reason == want.outputs[0].finish_reason
    assert r.usage is not None and r.usage.completion_tokens == len(want.outputs[0].token_ids)
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)


def test_completion_stream_concatenates_to_the_whole(client: openai.OpenAI) -> None:
    whole = client.completions.create(model="tiny", prompt="Blocks of sixteen", max_tokens=20, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt="Blocks of sixteen", max_tokens=20,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_token_id_prompts_and_batches(client: openai.OpenAI, offline: LLM) -> None:
    ids = [[1, 40, 41, 42], [1, 99, 100]]
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0)
    want = offline.generate([{"prompt_token_ids": p} for p in ids], SamplingParams(max_tokens=6, temperature=0),
                            use_tqdm=False)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [w.outputs[0].text for w in want]
    assert r.usage is not None and r.usage.prompt_tokens == 7


def test_chat_and_chat_stream(client: openai.OpenAI, offline: LLM) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a kernel."}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)  # type: ignore[arg-type]
    tok = offline.get_tokenizer()
    assert tok is not None
    want = offline.generate(tok.apply_chat_template(messages), SamplingParams(max_tokens=10, temperature=0),
                            use_tqdm=False)[0]
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.outputs[0].text
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,  # type: ignore[arg-type]
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.outputs[0].text


def test_models_health_ready_openapi(agent: AgentProcess, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny"]

    async def fetch() -> list[tuple[int, Any]]:
        async with aiohttp.ClientSession() as s:
            out = []
            for path in ("/health", "/ready", "/openapi.json"):
                async with s.get(agent.url + path) as r:
                    out.append((r.status, await r.json()))
            return out

    (h, _), (rd, _), (o, doc) = asyncio.run(fetch())
    assert (h, rd, o) == (200, 200, 200)
    assert doc["openapi"].startswith("3.") and "/v1/chat/completions" in doc["paths"]


def test_grpc_unary_and_stream_against_the_process(agent: AgentProcess, offline: LLM) -> None:
    assert agent.grpc_port is not None
    want = offline.generate("gRPC says", SamplingParams(max_tokens=9, temperature=0), use_tqdm=False)[0].outputs[0]

    async def call() -> tuple[Any, list[Any], Any]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{agent.grpc_port}") as channel:
            gen = pb_grpc.GenerationStub(channel)  # type: ignore[no-untyped-call]
            health = pb_grpc.HealthStub(channel)  # type: ignore[no-untyped-call]
            req = pb.GenerateRequest(model="tiny", text="gRPC says", max_tokens=9, temperature=0.0)
            unary = await gen.Generate(req, timeout=60)
            chunks = [c async for c in gen.GenerateStream(req, timeout=60)]
            status = await health.Check(pb.HealthCheckRequest(), timeout=10)
            return unary, chunks, status

    unary, chunks, status = asyncio.run(call())
    assert list(unary.token_ids) == want.token_ids and unary.text == want.text
    assert unary.finish_reason == "length" and unary.usage.completion_tokens == 9
    assert "".join(c.text for c in chunks) == want.text
    assert [t for c in chunks for t in c.token_ids] == want.token_ids
    assert status.status == pb.HealthCheckResponse.SERVING


# -- bad input --------------------------------------------------------------------------------------

BAD_REQUESTS: list[tuple[str, Any, int, str | None]] = [
    ("/v1/completions", "{not json", 400, None),
    ("/v1/completions", "[1, 2]", 400, None),
    ("/v1/completions", {"model": "tiny"}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": []}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": 42}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [1, "a"]}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [1, 10**9]}, 400, "prompt"),
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": "8"}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "top_k": -3}, 400, "top_k"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "seed": 2**64}, 400, "seed"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "stop": [str(i) for i in range(17)]}, 400, "stop"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "stop": 5}, 400, "stop"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "n": 2, "best_of": 1}, 400, "best_of"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "n": 1, "best_of": 2, "stream": True}, 400, "best_of"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "temprature": 0.5}, 400, "temprature"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "min_p": 2}, 400, "min_p"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "min_tokens": 20, "max_tokens": 5}, 400, "min_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "use_beam_search": True}, 400, "use_beam_search"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400,
     "tool_choice.function.name"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400,
     "response_format.json_schema.schema"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "presence_penalty": 3.0}, 400, "presence_penalty"),
    ("/v1/completions", {"model": "tiny", "prompt": "word " * 5000}, 400, "prompt"),
    ("/v1/chat/completions", {"model": "tiny"}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": 3}]}, 400,
     "messages[0].content"),
    ("/v1/nowhere", {}, 404, None),
]


def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(agent: AgentProcess,
                                                                   client: openai.OpenAI) -> None:
    async def send_all() -> list[tuple[int, dict[str, Any]]]:
        async with aiohttp.ClientSession() as s:
            out = []
            for path, body, _, _ in BAD_REQUESTS:
                data = body if isinstance(body, str) else json.dumps(body)
                async with s.post(agent.url + path, data=data, headers={"Content-Type": "application/json"}) as r:
                    out.append((r.status, await r.json()))
            return out

    results = asyncio.run(send_all())
    for (path, body, status, param), (got, err) in zip(BAD_REQUESTS, results, strict=True):
        assert got == status, (path, body, err)
        assert set(err) == {"error"} and err["error"]["message"], (path, body, err)
        assert "Traceback" not in err["error"]["message"]
        if param is not None:
            assert err["error"]["param"] == param, (body, err)
    r = client.completions.create(model="tiny", prompt="still alive", max_tokens=3, temperature=0)
    assert r.usage is not None and r.usage.completion_tokens == 3


# -- metrics ----------------------------------------------------------------------------------------

def test_metrics_count_known_traffic(agent: AgentProcess, client: openai.OpenAI) -> None:
    wait_for_idle(agent.url)
    before = metrics(agent.url)
    prompts, lengths = [[1, 50 + i, 60 + i, 70 + i] for i in range(5)], [3, 5, 8, 13, 21]
    started = time.monotonic()
    for p, n in zip(prompts, lengths, strict=True):
        client.completions.create(model="tiny", prompt=p, max_tokens=n, temperature=0,
                                  extra_body={"ignore_eos": True})
    client_time = time.monotonic() - started
    after = wait_for_idle(agent.url)

    def delta(key: str) -> float:
        return after[key] - before.get(key, 0.0)

    assert delta("kvfleet_prompt_tokens_total{}") == 20
    assert delta("kvfleet_generation_tokens_total{}") == sum(lengths)
    assert delta("kvfleet_requests_total{outcome=length}") == 5
    assert delta("kvfleet_time_to_first_token_seconds_count{}") == 5
    assert delta("kvfleet_e2e_request_latency_seconds_count{}") == 5
    assert delta("kvfleet_request_queue_time_seconds_count{}") == 5
    assert delta("kvfleet_inter_token_latency_seconds_count{}") == sum(n - 1 for n in lengths)
    ttft, e2e = delta("kvfleet_time_to_first_token_seconds_sum{}"), delta("kvfleet_e2e_request_latency_seconds_sum{}")
    assert 0 < ttft < e2e <= client_time  # the server cannot see more latency than the client did
    assert delta("kvfleet_inter_token_latency_seconds_sum{}") <= e2e - ttft + 1e-6
    assert after["kvfleet_time_to_first_token_seconds_bucket{le=0.005}"] >= 0  # the 5 ms bucket exists
    assert 0 < after["kvfleet_engine_last_step_timestamp_seconds{}"] <= time.time()


# -- disconnects and overload -----------------------------------------------------------------------

def test_abandoned_streams_are_aborted_and_free_their_blocks(agent: AgentProcess) -> None:
    before = wait_for_idle(agent.url)

    async def abandon() -> int:
        started = 0
        async with aiohttp.ClientSession() as s:
            body = {"model": "tiny", "prompt": "a long story", "max_tokens": 3000, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            responses = [await s.post(agent.url + "/v1/completions", json=body) for _ in range(20)]
            for r in responses:
                assert r.status == 200
                await r.content.readuntil(b"\n\n")  # the first chunk: generation is under way
                started += 1
            for r in responses:
                r.close()  # hang up mid-generation
        return started

    assert asyncio.run(abandon()) == 20
    after = wait_for_idle(agent.url)  # running and waiting back to 0, no KV block held
    assert after["kvfleet_requests_total{outcome=abort}"] - before["kvfleet_requests_total{outcome=abort}"] == 20


def test_overload_gets_429_with_retry_after_and_admitted_requests_complete(model_dir: str, offline: LLM) -> None:
    a = start_agent(model_dir, "--served-model-name", "tiny", "--max-num-seqs", "1", "--max-queue-length", "2")
    try:
        async def burst() -> list[tuple[int, dict[str, Any], str | None]]:
            async with aiohttp.ClientSession() as s:
                async def one(i: int) -> tuple[int, dict[str, Any], str | None]:
                    body = {"model": "tiny", "prompt": [1, 200 + i], "max_tokens": 400, "temperature": 0,
                            "ignore_eos": True}
                    async with s.post(a.url + "/v1/completions", json=body) as r:
                        return r.status, await r.json(), r.headers.get("Retry-After")
                return await asyncio.gather(*(one(i) for i in range(12)))

        results = asyncio.run(burst())
        rejected = [r for r in results if r[0] == 429]
        admitted = [(i, r) for i, r in enumerate(results) if r[0] == 200]
        assert rejected and admitted and len(rejected) + len(admitted) == 12
        assert all(r[2] is not None and int(r[2]) >= 1 and r[1]["error"]["code"] == "queue_full" for r in rejected)
        for i, (_, body, _) in admitted:
            want = offline.generate({"prompt_token_ids": [1, 200 + i]},
                                    SamplingParams(max_tokens=400, temperature=0, ignore_eos=True), use_tqdm=False)
            assert body["choices"][0]["text"] == want[0].outputs[0].text
            assert body["usage"]["completion_tokens"] == 400
        m = metrics(a.url)
        assert m["kvfleet_requests_total{outcome=rejected_queue_full}"] == len(rejected)
    finally:
        assert a.stop() == 0


# -- drain ------------------------------------------------------------------------------------------

def test_sigterm_drains_in_flight_requests_then_exits_zero(model_dir: str) -> None:
    # A grace far above the drain's need: a loaded CI machine once took over 120 s for 3 x 2,500 tokens.
    a = start_agent(model_dir, "--served-model-name", "tiny", "--drain-grace-period", "600")

    async def scenario() -> tuple[list[int], int, int]:
        async with aiohttp.ClientSession() as s:
            body = {"model": "tiny", "prompt": "drain me", "max_tokens": 1000, "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            responses = [await s.post(a.url + "/v1/completions", json=body) for _ in range(3)]
            for r in responses:
                await r.content.readuntil(b"\n\n")  # all three are generating
            a.proc.send_signal(15)  # SIGTERM
            async with s.get(a.url + "/ready") as r:
                ready = r.status
            async with s.post(a.url + "/v1/completions", json={"model": "tiny", "prompt": "late"}) as r:
                late = r.status
            tokens = []
            for r in responses:
                usage = None
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        usage = json.loads(line[6:]).get("usage") or usage
                tokens.append(usage["completion_tokens"] if usage else -1)
            return tokens, ready, late

    tokens, ready, late = asyncio.run(scenario())
    assert a.proc.wait(600) == 0, "".join(a.lines)
    assert ready == 503 and late == 503
    assert tokens == [1000, 1000, 1000]


def test_environment_variables_configure_the_agent(model_dir: str) -> None:
    """Pod specs set flags as KVFLEET_<FLAG>: the queue limit set that way must take effect."""
    env = {**os.environ, "KVFLEET_MAX_QUEUE_LENGTH": "0", "KVFLEET_SERVED_MODEL_NAME": "from-env",
           "KVFLEET_GRPC_PORT": "-1", "KVFLEET_LOG_LEVEL": "WARNING", "KVFLEET_API_KEY": "from-a-secret"}
    proc = subprocess.Popen([sys.executable, "-m", "kvfleet_agent.cli", "serve", "--model", model_dir,
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        assert proc.stdout is not None
        seen = [proc.stdout.readline()]
        while seen[-1] and "ready:" not in seen[-1] and len(seen) < 200:  # warnings may come first
            seen.append(proc.stdout.readline())
        line = seen[-1]
        assert "ready:" in line and "model=from-env" in line and "grpc=None" in line, seen
        url = line.split()[2]

        async def probe(key: str | None) -> tuple[int, str]:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", headers=headers,
                                                            json={"model": "from-env", "prompt": "x"}) as r:
                return r.status, (await r.json())["error"]["code"]

        assert asyncio.run(probe(None)) == (401, "invalid_api_key")  # KVFLEET_API_KEY is the key
        assert asyncio.run(probe("from-a-secret")) == (429, "queue_full")  # a queue of length 0 admits nothing
    finally:
        proc.terminate()
        assert proc.wait(60) == 0


def test_drain_grace_period_is_enforced(model_dir: str) -> None:
    """Requests outliving the grace period are aborted: their streams end cleanly and the process exits 0."""
    a = start_agent(model_dir, "--served-model-name", "tiny", "--drain-grace-period", "1")

    async def scenario() -> tuple[list[int], list[bool], list[str | None], float]:
        async with aiohttp.ClientSession() as s:
            body = {"model": "tiny", "prompt": "too long to drain", "max_tokens": 3500, "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            responses = [await s.post(a.url + "/v1/completions", json=body) for _ in range(8)]
            for r in responses:
                await r.content.readuntil(b"\n\n")
            sent = time.monotonic()
            a.proc.send_signal(15)
            tokens, done, finish = [], [], []
            for r in responses:
                usage, last, reason = None, b"", None
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        chunk = json.loads(line[6:])
                        usage = chunk.get("usage") or usage
                        reason = next((c["finish_reason"] for c in chunk["choices"]), reason)
                    if line.strip():
                        last = line.strip()
                tokens.append(usage["completion_tokens"] if usage else -1)
                done.append(last == b"data: [DONE]")
                finish.append(reason)
            return tokens, done, finish, time.monotonic() - sent

    tokens, done, finish, elapsed = asyncio.run(scenario())
    assert a.proc.wait(60) == 0, "".join(a.lines)
    assert all(done), "every stream must end with [DONE]"
    assert finish == ["abort"] * 8, "the last chunk of a cut stream says why it ended"
    assert all(0 < t < 3500 for t in tokens), tokens  # cut short by the abort, not run to the end
    assert elapsed < 30, f"the drain took {elapsed:.1f} s with a 1 s grace period"
