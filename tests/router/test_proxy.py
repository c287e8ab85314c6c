"""kvfleet-router in front of real agent processes: relays, spreads load, follows prefixes, retries, holds from zero."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Callable

import aiohttp
import pytest
from openai import NotFoundError, OpenAI
from router_helpers import (  # noqa: F401 (fixtures, found by name)
    MODEL,
    OpenAIless,
    RouterProcess,
    agents_fixture,
    counters,
    router_fixture,
    served,
    start_router,
    wait_for,
)
from server_process import AgentProcess, start_agent

from kvfleet_router.picker import Ring
from kvfleet_router.prefix import prefix_key


def test_a_request_through_the_router_equals_a_direct_call(router: RouterProcess, agents: list[AgentProcess]) -> None:
    via = OpenAI(base_url=f"{router.url}/v1", api_key="unused")
    direct = OpenAI(base_url=f"{agents[0].url}/v1", api_key="unused")
    ask = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0.0}
    assert via.completions.create(**ask).choices[0].text == direct.completions.create(**ask).choices[0].text
    streamed = "".join(c.choices[0].text for c in via.completions.create(**ask, stream=True) if c.choices)
    assert streamed == direct.completions.create(**ask).choices[0].text
    raw = via.completions.with_raw_response.create(**ask)
    assert re.fullmatch(r"replica=127\.0\.0\.1:\d+; reason=(prefix|prefix-spill|least-load)",
                        raw.headers["x-kvfleet-route"])
    chat = via.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.choices[0].finish_reason == "length"


def test_model_lookup_and_tokenizer_routes_pass_through(router: RouterProcess, agents: list[AgentProcess]) -> None:
    via = OpenAI(base_url=f"{router.url}/v1", api_key="unused")
    assert via.models.retrieve(MODEL).id == MODEL
    with pytest.raises(NotFoundError, match="not served here"):
        via.models.retrieve("nope")
    body = json.dumps({"model": MODEL, "prompt": "The quick brown fox"}).encode()
    status, headers, routed = OpenAIless.post(f"{router.url}/tokenize", body)
    _, _, direct = OpenAIless.post(f"{agents[0].url}/tokenize", body)
    assert status == 200 and json.loads(routed)["tokens"] == json.loads(direct)["tokens"]
    assert "x-kvfleet-route" in headers
    tokens = json.loads(routed)["tokens"]
    back = json.dumps({"model": MODEL, "tokens": tokens}).encode()
    status, _, text = OpenAIless.post(f"{router.url}/detokenize", back)
    assert status == 200 and json.loads(text)["prompt"].endswith("The quick brown fox")  # maybe after a BOS


def test_a_client_that_leaves_aborts_its_upstream_request(router: RouterProcess, agents: list[AgentProcess]) -> None:
    def aborted() -> float:
        return sum(v for a in agents for labels, v in counters(a.url, "kvfleet_requests").items()
                   if ("outcome", "abort") in labels)

    def running() -> float:
        return sum(sum(counters(a.url, "kvfleet_requests_running").values()) for a in agents)

    before = aborted()

    async def leave_mid_stream() -> None:
        body = {"model": MODEL, "prompt": "a long answer, please", "max_tokens": 480, "ignore_eos": True,
                "stream": True}
        async with aiohttp.ClientSession() as s, s.post(f"{router.url}/v1/completions", json=body) as r:
            assert r.status == 200
            await r.content.readline()  # the first event: generation is under way on a replica
        # Leaving the block closes the connection with the stream unfinished.

    asyncio.run(leave_mid_stream())
    # The agent sees its connection close, aborts the request and frees its blocks, long before 480 tokens.
    wait_for(lambda: aborted() == before + 1 and running() == 0, timeout=20)


def test_distinct_prompts_spread_over_the_replicas(router: RouterProcess, agents: list[AgentProcess]) -> None:
    before = [served(a) for a in agents]

    async def load() -> None:
        async with aiohttp.ClientSession() as s:
            async def one(i: int) -> None:
                body = {"model": MODEL, "prompt": f"request number {i} about topic {i * 7}", "max_tokens": 4}
                async with s.post(f"{router.url}/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
            await asyncio.gather(*(one(i) for i in range(40)))

    asyncio.run(load())
    shares = [served(a) - b for a, b in zip(agents, before, strict=True)]
    assert sum(shares) == 40
    assert min(shares) >= 0.2 * 40, shares


def test_a_shared_prefix_stays_on_one_replica(router: RouterProcess) -> None:
    system = "You are a careful assistant for the kvfleet project. " * 8  # longer than the prefix key
    replicas = set()
    for i in range(6):  # one at a time: loads stay equal, so affinity alone decides
        status, headers, _ = OpenAIless.post(f"{router.url}/v1/completions", json.dumps(
            {"model": MODEL, "prompt": system + f"question {i}", "max_tokens": 2}).encode())
        assert status == 200
        replica, reason = re.findall(r"replica=(\S+); reason=(\S+)", headers["x-kvfleet-route"])[0]
        replicas.add(replica)
        assert reason == "prefix"
    assert len(replicas) == 1


@pytest.mark.parametrize(("body", "status", "says"), [
    (b'{"model": "nope", "prompt": "x"}', 404, "not served here"),
    (b"{not json", 400, "not valid JSON"),
])
def test_bad_requests_are_answered_by_the_router(router: RouterProcess, body: bytes, status: int, says: str) -> None:
    got, _, text = OpenAIless.post(f"{router.url}/v1/completions", body)
    assert got == status and says in text


def test_refusals_are_retried_on_another_replica(tiny_checkpoint: Callable[..., str],
                                                 agents: list[AgentProcess]) -> None:
    refuser = start_agent(tiny_checkpoint("llama"), "--served-model-name", MODEL, "--max-queue-length", "0")
    try:
        both = start_router(f"{MODEL}={refuser.url},{agents[1].url}")
        alone = start_router(f"{MODEL}={refuser.url}")
        try:
            wait_for(lambda: '"ready_replicas": 2' in OpenAIless.get(f"{both.url}/v1/models"))
            # Prompts whose affinity owner is the refuser, found with the router's own ring (names are host:port),
            # so the retries are certain rather than left to where the random ports happen to hash.
            names = [refuser.url.split("//")[1], agents[1].url.split("//")[1]]
            ring = Ring(sorted(names))
            prompts = [p for p in (f"retry {i}" for i in range(200))
                       if ring.walk(prefix_key({"model": MODEL, "prompt": p}) or "")[0] == names[0]][:4]
            assert len(prompts) == 4
            for prompt in [*prompts, "another", "and more"]:
                status, headers, _ = OpenAIless.post(f"{both.url}/v1/completions", json.dumps(
                    {"model": MODEL, "prompt": prompt, "max_tokens": 2}).encode())
                assert status == 200 and names[1] in headers["x-kvfleet-route"]
            assert sum(counters(both.url, "kvfleet_router_retries").values()) >= len(prompts)
            wait_for(lambda: '"ready_replicas": 1' in OpenAIless.get(f"{alone.url}/v1/models"))
            status, headers, text = OpenAIless.post(f"{alone.url}/v1/completions",
                                                    b'{"model": "tiny", "prompt": "x", "max_tokens": 2}')
            assert status == 429 and "Retry-After" in headers and "refused" in text
        finally:
            both.stop()
            alone.stop()
    finally:
        refuser.stop()


def free_port() -> int:
    """A port the OS says is free now (the agent binds it a moment later; the OS does not hand it out meanwhile
    unless asked for port 0 by someone else in that window)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_request_for_a_model_with_no_replica_is_held_until_one_is_ready(tiny_checkpoint: Callable[..., str]) -> None:
    port = free_port()
    router = start_router(f"{MODEL}=http://127.0.0.1:{port}")
    result: list[tuple[int, dict[str, str], str]] = []
    try:
        sender = threading.Thread(target=lambda: result.append(OpenAIless.post(
            f"{router.url}/v1/completions", b'{"model": "tiny", "prompt": "held", "max_tokens": 3}')))
        sender.start()
        wait_for(lambda: 'kvfleet_router_held_requests{inference_deployment="",model="tiny",namespace=""} 1.0'
                 in OpenAIless.get(f"{router.url}/metrics"))
        assert not result  # held, not refused
        agent = _agent_on(tiny_checkpoint("llama"), port)
        try:
            sender.join(120)
            status, _, text = result[0]
            assert status == 200, text
            assert json.loads(text)["usage"]["completion_tokens"] == 3
        finally:
            agent.stop()
    finally:
        router.stop()


def _agent_on(model_dir: str, port: int) -> AgentProcess:
    """An agent on a given port (the router was told of it before it existed)."""
    cmd = [sys.executable, "-m", "kvfleet_agent.cli", "--log-level", "WARNING", "serve", "--model", model_dir,
           "--host", "127.0.0.1", "--port", str(port), "--grpc-port", "-1", "--served-model-name", MODEL]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines: list[str] = []
    for line in proc.stdout:
        lines.append(line)
        if "kvfleet-agent ready" in line:
            threading.Thread(target=lambda: lines.extend(proc.stdout or []), daemon=True).start()
            return AgentProcess(proc, f"http://127.0.0.1:{port}", None, lines)
    raise RuntimeError(f"agent exited with {proc.wait()}:\n{''.join(lines)}")


def test_an_agent_killed_mid_load_ends_its_streams_cleanly_and_the_rest_go_elsewhere(
        tiny_checkpoint: Callable[..., str]) -> None:
    pair = [start_agent(tiny_checkpoint("llama"), "--served-model-name", MODEL, "--max-num-seqs", "16")
            for _ in range(2)]
    router = start_router(f"{MODEL}={pair[0].url},{pair[1].url}")
    victim = pair[0].url.split("//")[1]
    try:
        wait_for(lambda: '"ready_replicas": 2' in OpenAIless.get(f"{router.url}/v1/models"))

        async def run() -> list[tuple[str, str]]:
            started = asyncio.Event()
            streaming: set[int] = set()

            async def stream(s: aiohttp.ClientSession, i: int) -> tuple[str, str]:
                body = {"model": MODEL, "prompt": f"stream {i}", "max_tokens": 400, "ignore_eos": True,
                        "stream": True}
                async with s.post(f"{router.url}/v1/completions", json=body) as r:
                    replica = re.findall(r"replica=(\S+);", r.headers["x-kvfleet-route"])[0]
                    last = ""
                    async for line in r.content:
                        if line.strip():
                            last = line.decode().strip()
                            streaming.add(i)
                            if len(streaming) == 8:
                                started.set()
                    return replica, last

            async with aiohttp.ClientSession() as s:
                tasks = [asyncio.create_task(stream(s, i)) for i in range(8)]
                await asyncio.wait_for(started.wait(), 60)
                pair[0].proc.kill()  # our own agent process, by its pid
                return await asyncio.wait_for(asyncio.gather(*tasks), 120)  # the router never hangs

        ends = asyncio.run(run())
        on_victim = [last for replica, last in ends if replica == victim]
        elsewhere = [last for replica, last in ends if replica != victim]
        assert on_victim and elsewhere, ends  # both replicas were streaming when one died
        assert all("upstream_error" in last for last in on_victim), on_victim  # a clean error event, no hang
        assert all(last == "data: [DONE]" for last in elsewhere), elsewhere
        for i in range(6):  # new requests avoid the dead replica, or are retried off it before any byte
            status, headers, _ = OpenAIless.post(f"{router.url}/v1/completions", json.dumps(
                {"model": MODEL, "prompt": f"after {i}", "max_tokens": 2}).encode())
            assert status == 200 and victim not in headers["x-kvfleet-route"]
    finally:
        router.stop()
        for a in pair:
            if a.proc.poll() is None:
                a.stop()
