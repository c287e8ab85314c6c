"""Tests for the gRPC front end over real loopback: outputs, streaming deltas, errors, admission, cancel, stub drift.

Each test builds its own AsyncLLM, Admission and server (port 0) and talks to it with a grpc.aio
channel on one event loop. Every RPC carries a deadline and every loop a timeout, so a lost
response fails a test instead of hanging it.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import subprocess
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvfleet_agent.core.request import Request, RequestStatus
from kvfleet_agent.engine.async_llm import AsyncLLM
from kvfleet_agent.llm import LLM
from kvfleet_agent.sampling_params import MAX_STOP_STRINGS, SamplingParams
from kvfleet_agent.server import kvfleet_pb2 as pb
from kvfleet_agent.server import kvfleet_pb2_grpc as pb_grpc
from kvfleet_agent.server.admission import Admission
from kvfleet_agent.server.auth import APIKey
from kvfleet_agent.server.connections import ConnectionLimits
from kvfleet_agent.server.grpc_server import start_grpc_server

ROOT = Path(__file__).resolve().parents[2]
SERVER_DIR = ROOT / "agent" / "kvfleet_agent" / "server"
MODEL = "tiny-llama"
ENGINE_OPTIONS: dict[str, Any] = {
    "kv_cache_memory_bytes": 4 << 20,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 256,
    "block_size": 16,
}
PROMPT = "The quick brown fox"
RPC_TIMEOUT_S = 15.0  # the deadline of every RPC; none comes near it when the server works
LOOP_TIMEOUT_S = 60.0
NOT_SERVING = pb.HealthCheckResponse.NOT_SERVING
SERVING = pb.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def long_ckpt(tiny_checkpoint: Callable[..., str]) -> str:
    # 4096 positions: a request that is cancelled after two tokens still has thousands to go, so
    # it cannot finish on its own before the cancel reaches the engine.
    return tiny_checkpoint("llama", max_position_embeddings=4096)


@pytest.fixture(scope="module")
def offline(ckpt: Path) -> LLM:
    """The offline reference, with the same engine options as the served AsyncLLM."""
    return LLM(model=str(ckpt), **ENGINE_OPTIONS)


@dataclass
class Agent:
    """A running server and a client connected to it."""

    llm: AsyncLLM
    admission: Admission
    generation: pb_grpc.GenerationStub
    health: pb_grpc.HealthStub
    channel: grpc.aio.Channel

    def all_free(self) -> bool:
        return self.llm.engine.kv.pool.num_free == self.llm.engine.kv.pool.num_blocks

    async def assert_idle(self) -> None:
        """Nothing running or queued, every KV block back in the pool, the engine alive."""
        await self.llm.barrier()
        pool = self.llm.engine.kv.pool
        assert pool.num_free == pool.num_blocks, (pool.num_free, pool.num_blocks)
        assert not self.llm.engine.has_unfinished()
        assert self.llm.num_unfinished() == 0
        assert self.llm.is_alive

    async def status(self) -> pb.HealthCheckResponse:
        resp: pb.HealthCheckResponse = await self.health.Check(pb.HealthCheckRequest(), timeout=RPC_TIMEOUT_S)
        return resp

    async def generate(self, request: pb.GenerateRequest) -> pb.GenerateResponse:
        resp: pb.GenerateResponse = await self.generation.Generate(request, timeout=RPC_TIMEOUT_S)
        return resp

    async def stream(self, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
        return [m async for m in self.generation.GenerateStream(request, timeout=RPC_TIMEOUT_S)]


def _serve(ckpt: str | Path, body: Callable[[Agent], Awaitable[None]], max_queue_length: int = 64,
           api_key: str | None = None) -> None:
    """Run body against a fresh engine and server on port 0; always stops both."""
    llm = AsyncLLM.from_options(str(ckpt), **ENGINE_OPTIONS)

    async def main() -> None:
        admission = Admission(llm, max_queue_length)
        server, port = await start_grpc_server(llm, admission, MODEL, "127.0.0.1", 0,
                                               api_key=APIKey(api_key) if api_key else None)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stubs = pb_grpc.GenerationStub(channel), pb_grpc.HealthStub(channel)  # type: ignore[no-untyped-call]
                await body(Agent(llm, admission, *stubs, channel))
        finally:
            await server.stop(grace=None)

    try:
        asyncio.run(asyncio.wait_for(main(), LOOP_TIMEOUT_S))
    finally:
        llm.shutdown()


def _request(prompt: str | list[int] | None = PROMPT, **fields: Any) -> pb.GenerateRequest:
    """A greedy 12-token request for `prompt` (text, token ids, or None for no prompt), with fields overridden."""
    base: dict[str, Any] = {"model": MODEL, "temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
    req = pb.GenerateRequest(**(base | fields))
    if isinstance(prompt, str):
        req.text = prompt
    elif prompt is not None:
        req.token_ids.SetInParent()  # present even when empty: the server must see an empty prompt, not none
        req.token_ids.ids.extend(prompt)
    return req


async def _error(rpc: Awaitable[object]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await rpc
    return info.value


# --- results --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["text", "token_ids"])
def test_unary_greedy_matches_offline(ckpt: Path, offline: LLM, kind: str) -> None:
    tok = offline.get_tokenizer()
    assert tok is not None
    prompt: str | list[int] = PROMPT if kind == "text" else tok.encode("hello world, again")
    offline_prompt: Any = prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt}
    (ref,) = offline.generate([offline_prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                              use_tqdm=False)

    async def body(agent: Agent) -> None:
        model = MODEL if kind == "text" else ""  # an empty model field means the served one
        resp = await agent.generate(_request(prompt, request_id="unary-1", model=model))
        assert resp.request_id == "unary-1"
        assert list(resp.token_ids) == ref.outputs[0].token_ids
        assert resp.text == ref.outputs[0].text
        assert resp.finish_reason == "length"
        assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (len(ref.prompt_token_ids), 12)
        assert not resp.logprobs  # not asked for
        await agent.assert_idle()

    _serve(ckpt, body)


def _stop_in(text: str) -> str:
    """A stop string that occurs in `text` past its start, so a request with it ends early with "stop"."""
    mid = len(text) // 2
    stop = text[mid:mid + 3]
    assert len(stop) == 3, text
    return stop


@pytest.mark.parametrize("with_stop", [False, True], ids=["length", "stop_string"])
def test_stream_deltas_concatenate_to_unary(ckpt: Path, offline: LLM, with_stop: bool) -> None:
    n = 40
    extra: dict[str, Any] = {"logprobs": 3}
    if with_stop:  # text held back as a possible stop-string prefix must still come out exactly once
        (full,) = offline.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                                   use_tqdm=False)
        extra["stop"] = [_stop_in(full.outputs[0].text)]

    async def body(agent: Agent) -> None:
        whole = await agent.generate(_request(max_tokens=n, **extra))
        assert whole.finish_reason == ("stop" if with_stop else "length")
        assert len(whole.logprobs) == len(whole.token_ids) > 0
        msgs = await agent.stream(_request(max_tokens=n, **extra))
        assert len(msgs) >= 2
        assert len({m.request_id for m in msgs}) == 1 and msgs[0].request_id != whole.request_id
        assert "".join(m.text for m in msgs) == whole.text
        assert [t for m in msgs for t in m.token_ids] == list(whole.token_ids)
        assert [lp for m in msgs for lp in m.logprobs] == list(whole.logprobs)
        assert all(len(m.logprobs) == len(m.token_ids) for m in msgs)
        assert all(len(lp.top) == 3 for lp in whole.logprobs)
        for m in msgs[:-1]:
            assert m.finish_reason == "" and not m.HasField("usage")
        last = msgs[-1]
        assert last.finish_reason == whole.finish_reason
        assert last.HasField("usage") and last.usage == whole.usage
        assert last.usage.completion_tokens == len(whole.token_ids)
        await agent.assert_idle()

    _serve(ckpt, body)


# --- invalid input --------------------------------------------------------------------------------

INVALID: list[tuple[str, dict[str, Any], str]] = [
    ("temperature", {"temperature": -1.0}, "temperature"),
    ("top_p", {"top_p": 0.0}, "top_p"),
    ("max_tokens", {"max_tokens": 0}, "max_tokens"),
    ("logprobs", {"logprobs": 21}, "logprobs"),
    ("empty_stop_string", {"stop": [""]}, "stop"),
    ("too_many_stop_strings", {"stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}, "stop"),
    ("empty_text", {"prompt": ""}, "prompt"),
    ("empty_token_ids", {"prompt": []}, "prompt"),
    ("no_prompt", {"prompt": None}, "prompt"),
    ("token_id_out_of_vocab", {"prompt": [1, 10**6]}, "token_ids"),
    ("prompt_too_long", {"prompt": [5] * 600}, "prompt"),  # max_model_len is 512
    ("text_too_long", {"prompt": "word " * 2000}, "characters"),  # 512 tokens of at most 12 characters
    ("text_past_context_in_tokens", {"prompt": "a b " * 1000}, "tokens"),  # few characters, many tokens
    ("max_tokens_past_context", {"max_tokens": 600}, "max_tokens"),
    ("unknown_model", {"model": "gpt-4"}, "model"),
    ("empty_request_id", {"request_id": ""}, "request_id"),
]


@pytest.mark.parametrize(("fields", "field"), [case[1:] for case in INVALID], ids=[case[0] for case in INVALID])
def test_invalid_input_is_invalid_argument_and_server_keeps_serving(ckpt: Path, fields: dict[str, Any],
                                                                    field: str) -> None:
    fields = dict(fields)
    prompt = fields.pop("prompt", PROMPT)

    async def body(agent: Agent) -> None:
        unary = await _error(agent.generate(_request(prompt, **fields)))
        streamed = await _error(agent.stream(_request(prompt, **fields)))
        for err in (unary, streamed):
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
            assert field in err.details()
            assert "Traceback" not in err.details()
        await agent.assert_idle()
        assert agent.llm.engine.counters.prompt_tokens == 0  # nothing reached the engine
        assert sum(agent.admission.rejected.values()) == 0  # bad input is not an admission refusal
        resp = await agent.generate(_request(max_tokens=3))
        assert resp.finish_reason == "length" and len(resp.token_ids) == 3

    _serve(ckpt, body)


def test_max_tokens_past_the_context_names_both_limits(ckpt: Path) -> None:
    async def body(agent: Agent) -> None:
        err = await _error(agent.generate(_request(max_tokens=600)))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "512" in err.details() and "600" in err.details() and "max_tokens" in err.details()

    _serve(ckpt, body)


@pytest.mark.parametrize("method", ["Generate", "GenerateStream"])
def test_an_undecodable_payload_is_invalid_argument(ckpt: Path, method: str) -> None:
    async def body(agent: Agent) -> None:
        path = f"/kvfleet.v1.Generation/{method}"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            if method == "Generate":
                await agent.channel.unary_unary(path)(b"\xff\xff\xff", timeout=RPC_TIMEOUT_S)
            else:
                async for _ in agent.channel.unary_stream(path)(b"\xff\xff\xff", timeout=RPC_TIMEOUT_S):
                    pass
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
        assert "kvfleet.v1.GenerateRequest" in (info.value.details() or "")
        await agent.assert_idle()

    _serve(ckpt, body)


def test_an_api_key_guards_generation_but_not_health(ckpt: Path) -> None:
    async def body(agent: Agent) -> None:
        for metadata, why in ((None, "API key"), ((("authorization", "Bearer wrong"),), "incorrect"),
                              ((("authorization", "Basic a2V5"),), "Bearer")):
            err = await _error(agent.generation.Generate(_request(max_tokens=2), timeout=RPC_TIMEOUT_S,
                                                         metadata=metadata))
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED and why in (err.details() or ""), err
            err = await _error(agent.stream(_request(max_tokens=2)))
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        assert agent.llm.engine.counters.prompt_tokens == 0  # refused before anything reached the engine
        assert (await agent.status()).status == SERVING  # probes need no key
        resp = await agent.generation.Generate(_request(max_tokens=2), timeout=RPC_TIMEOUT_S,
                                               metadata=(("authorization", "Bearer s3cret"),))
        assert len(resp.token_ids) == 2

    _serve(ckpt, body, api_key="s3cret")


def test_connection_limits_cap_connections_and_close_silent_ones(ckpt: Path) -> None:
    """gRPC core enforces the same limits: connections past the cap are refused, a silent socket is dropped."""
    async def body(agent: Agent) -> None:
        limits = ConnectionLimits(max_connections=2, header_timeout_s=1.0)
        server, port = await start_grpc_server(agent.llm, agent.admission, MODEL, "127.0.0.1", 0, limits=limits)
        # A channel of its own per client: by default channels to one address share a connection.
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
                    for _ in range(3)]
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)  # never sends the HTTP/2 preface
            data = b""
            while chunk := await asyncio.wait_for(reader.read(4096), RPC_TIMEOUT_S):
                data += chunk
            assert b"handshake timeout" in data  # gRPC's GOAWAY says why, then closes
            writer.close()
            codes = []
            for channel in channels:
                try:
                    await pb_grpc.HealthStub(channel).Check(pb.HealthCheckRequest(),  # type: ignore[no-untyped-call]
                                                            timeout=RPC_TIMEOUT_S)
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as e:
                    codes.append(e.code())
            assert codes == [grpc.StatusCode.OK, grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE]
        finally:
            for channel in channels:
                await channel.close()
            await server.stop(grace=None)

    _serve(ckpt, body)


# --- admission and health -------------------------------------------------------------------------


def test_queue_full_is_resource_exhausted(ckpt: Path) -> None:
    async def body(agent: Agent) -> None:
        unary = await _error(agent.generate(_request()))
        streamed = await _error(agent.stream(_request()))
        for err in (unary, streamed):
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (err.code(), err.details())
            assert ("retry-after", "1") in tuple(err.trailing_metadata() or ())
        assert agent.admission.rejected["queue_full"] == 2
        assert agent.llm.engine.counters.prompt_tokens == 0
        assert (await agent.status()).status == SERVING  # a full queue is load, not ill health
        agent.admission.max_queue_length = 8
        resp = await agent.generate(_request(max_tokens=3))
        assert len(resp.token_ids) == 3
        await agent.assert_idle()

    _serve(ckpt, body, max_queue_length=0)  # the waiting count is never below 0: every request is refused


def test_draining_is_unavailable_and_not_serving(ckpt: Path) -> None:
    async def body(agent: Agent) -> None:
        assert (await agent.status()) == pb.HealthCheckResponse(status=SERVING)
        agent.admission.draining = True
        assert (await agent.status()) == pb.HealthCheckResponse(status=NOT_SERVING, reason="draining")
        unary = await _error(agent.generate(_request()))
        streamed = await _error(agent.stream(_request()))
        for err in (unary, streamed):
            assert err.code() == grpc.StatusCode.UNAVAILABLE, (err.code(), err.details())
            assert "draining" in err.details()
        assert agent.admission.rejected["draining"] == 2
        assert agent.llm.engine.counters.prompt_tokens == 0

    _serve(ckpt, body)


def test_dead_engine_is_unavailable_and_not_serving(ckpt: Path) -> None:
    async def body(agent: Agent) -> None:
        agent.llm.shutdown()
        assert (await agent.status()) == pb.HealthCheckResponse(status=NOT_SERVING, reason="engine_dead")
        err = await _error(agent.generate(_request()))
        assert err.code() == grpc.StatusCode.UNAVAILABLE, (err.code(), err.details())
        assert agent.admission.rejected["engine_dead"] == 1

    _serve(ckpt, body)


def test_a_taken_port_is_an_error(ckpt: Path) -> None:
    async def body(agent: Agent) -> None:
        server, port = await start_grpc_server(agent.llm, agent.admission, MODEL, "127.0.0.1", 0)
        try:
            with pytest.raises(OSError, match=str(port)):
                await start_grpc_server(agent.llm, agent.admission, MODEL, "127.0.0.1", port)
        finally:
            await server.stop(grace=None)

    _serve(ckpt, body)


# --- cancel ---------------------------------------------------------------------------------------


class _Events:
    """Engine observer: hands first tokens and finishes to the event loop (it is called on the engine thread)."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.first_tokens: asyncio.Queue[str] = asyncio.Queue()
        self.finishes: asyncio.Queue[tuple[str, RequestStatus]] = asyncio.Queue()

    def on_token(self, req: Request, now: float, gap: float | None) -> None:
        if gap is None:
            self.loop.call_soon_threadsafe(self.first_tokens.put_nowait, req.request_id)

    def on_finish(self, req: Request, now: float) -> None:
        self.loop.call_soon_threadsafe(self.finishes.put_nowait, (req.request_id, req.status))


LONG: dict[str, Any] = {"max_tokens": 4000, "ignore_eos": True}  # far more than the test waits for


def _watch(agent: Agent) -> _Events:
    """Observe the engine, whose checkpoint must leave LONG requests room to run on past a cancel."""
    assert agent.llm.engine.max_model_len > LONG["max_tokens"]
    events = _Events()
    agent.llm.engine.observers.append(events)
    return events


async def _assert_aborted_then_serves(agent: Agent, events: _Events, request_id: str) -> None:
    finished = await asyncio.wait_for(events.finishes.get(), RPC_TIMEOUT_S)
    assert finished == (request_id, RequestStatus.FINISHED_ABORTED), "the request was not aborted by the cancel"
    await agent.assert_idle()
    assert agent.llm.engine.counters.finished["abort"] == 1
    resp = await agent.generate(_request(max_tokens=3))
    assert len(resp.token_ids) == 3


def test_cancelling_a_stream_frees_kv_blocks(long_ckpt: str) -> None:
    async def body(agent: Agent) -> None:
        events = _watch(agent)
        call = agent.generation.GenerateStream(_request(request_id="streamed", **LONG), timeout=RPC_TIMEOUT_S)
        for _ in range(2):
            msg = await call.read()
            assert isinstance(msg, pb.GenerateResponse) and msg.finish_reason == ""
        assert not agent.all_free()  # the running request holds KV blocks
        call.cancel()
        assert await call.code() == grpc.StatusCode.CANCELLED
        await _assert_aborted_then_serves(agent, events, "streamed")

    _serve(long_ckpt, body)


def test_request_id_in_use_is_invalid_argument(long_ckpt: str) -> None:
    async def body(agent: Agent) -> None:
        events = _watch(agent)
        call = agent.generation.GenerateStream(_request(request_id="taken", **LONG), timeout=RPC_TIMEOUT_S)
        assert isinstance(await call.read(), pb.GenerateResponse)  # "taken" is running now
        err = await _error(agent.generate(_request(request_id="taken")))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
        assert "request_id" in err.details()
        call.cancel()
        await _assert_aborted_then_serves(agent, events, "taken")

    _serve(long_ckpt, body)


def test_cancelling_a_unary_call_frees_kv_blocks(long_ckpt: str) -> None:
    async def body(agent: Agent) -> None:
        events = _watch(agent)
        call = agent.generation.Generate(_request(request_id="unary", **LONG), timeout=RPC_TIMEOUT_S)
        assert await asyncio.wait_for(events.first_tokens.get(), RPC_TIMEOUT_S) == "unary"
        call.cancel()
        assert await call.code() == grpc.StatusCode.CANCELLED
        await _assert_aborted_then_serves(agent, events, "unary")

    _serve(long_ckpt, body)


# --- generated code -------------------------------------------------------------------------------


def test_committed_stubs_match_the_proto(tmp_path: Path) -> None:
    """Rerun the protoc command documented in grpc_server.py; the committed files must be its exact output."""
    out = tmp_path / "gen"
    out.mkdir()
    cmd = [sys.executable, "-m", "grpc_tools.protoc", "-I", "agent", f"--python_out={out}", f"--pyi_out={out}",
           f"--grpc_python_out={out}", "agent/kvfleet_agent/server/kvfleet.proto"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    tools = importlib.metadata.version("grpcio-tools")
    for name in ("kvfleet_pb2.py", "kvfleet_pb2.pyi", "kvfleet_pb2_grpc.py"):
        fresh = (out / "kvfleet_agent" / "server" / name).read_bytes()
        assert fresh == (SERVER_DIR / name).read_bytes(), (
            f"{name} differs from what protoc makes of kvfleet.proto with grpcio-tools {tools}: rerun the command "
            "at the top of grpc_server.py (with the grpcio-tools version the committed stubs name)")
