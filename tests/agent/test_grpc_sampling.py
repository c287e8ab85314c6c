"""The gRPC API's n and logits-processing fields, over real loopback: they reach the engine as the offline API's do.

Each test starts its own AsyncLLM and gRPC server (port 0) and talks to it with a grpc.aio client.
The offline LLM on the same checkpoint and options is the reference: a field that reached the
engine gives the same tokens as SamplingParams with that field, and (checked once) other tokens
than without it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvfleet_agent.engine.async_llm import AsyncLLM
from kvfleet_agent.llm import LLM
from kvfleet_agent.sampling_params import SamplingParams
from kvfleet_agent.server import kvfleet_pb2 as pb
from kvfleet_agent.server import kvfleet_pb2_grpc as pb_grpc
from kvfleet_agent.server.admission import Admission
from kvfleet_agent.server.grpc_server import start_grpc_server

ENGINE_OPTIONS: dict[str, Any] = {"kv_cache_memory_bytes": 4 << 20, "max_num_seqs": 8,
                                  "max_num_batched_tokens": 256, "block_size": 16}
PROMPT = "The quick brown fox"
RPC_TIMEOUT_S = 15.0
Body = Callable[[AsyncLLM, pb_grpc.GenerationStub], Awaitable[None]]


@pytest.fixture(scope="module")
def offline(ckpt: Path) -> LLM:
    return LLM(model=str(ckpt), **ENGINE_OPTIONS)


def _serve(ckpt: Path, body: Body, max_queue_length: int = 64, max_logprobs: int = 20) -> None:
    llm = AsyncLLM.from_options(str(ckpt), **ENGINE_OPTIONS)

    async def main() -> None:
        server, port = await start_grpc_server(llm, Admission(llm, max_queue_length), "tiny", "127.0.0.1", 0,
                                               max_logprobs=max_logprobs)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                await body(llm, pb_grpc.GenerationStub(channel))  # type: ignore[no-untyped-call]
            await llm.barrier()
            pool = llm.engine.kv.pool
            assert pool.num_free == pool.num_blocks and llm.num_unfinished() == 0  # every sample ended and freed
        finally:
            await server.stop(grace=None)

    try:
        asyncio.run(asyncio.wait_for(main(), 60.0))
    finally:
        llm.shutdown()


def _offline_ids(offline: LLM, params: SamplingParams) -> list[int]:
    (out,) = offline.generate([PROMPT], params, use_tqdm=False)
    return out.outputs[0].token_ids


def test_n_samples_use_seed_plus_i_whole_and_streamed(ckpt: Path, offline: LLM) -> None:
    base = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, logprobs=1)
    want = [_offline_ids(offline, replace(base, seed=7 + i)) for i in range(3)]
    assert len({tuple(w) for w in want}) == 3  # the seeds give distinct samples
    request = pb.GenerateRequest(text=PROMPT, n=3, seed=7, temperature=1.0, max_tokens=8, ignore_eos=True,
                                 logprobs=1, request_id="fan")

    async def body(llm: AsyncLLM, stub: pb_grpc.GenerationStub) -> None:
        whole = await stub.Generate(request, timeout=RPC_TIMEOUT_S)
        assert whole.request_id == "fan" and not whole.token_ids and not whole.text and whole.finish_reason == ""
        assert [s.index for s in whole.samples] == [0, 1, 2]
        assert [list(s.token_ids) for s in whole.samples] == want
        assert all(s.finish_reason == "length" and len(s.logprobs) == 8 for s in whole.samples)
        assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(llm.tokenizer.encode(PROMPT)), 24)
        msgs = [m async for m in stub.GenerateStream(request, timeout=RPC_TIMEOUT_S)]
        assert all(len(m.samples) == 1 and m.request_id == "fan" for m in msgs)
        assert [m.HasField("usage") for m in msgs] == [False] * (len(msgs) - 1) + [True]
        assert msgs[-1].usage == whole.usage
        for s in whole.samples:
            mine = [m.samples[0] for m in msgs if m.samples[0].index == s.index]
            assert "".join(p.text for p in mine) == s.text
            assert [t for p in mine for t in p.token_ids] == list(s.token_ids)
            streamed = [lp for p in mine for lp in p.logprobs]  # batched differently: equal up to float noise
            assert [lp.token_id for lp in streamed] == [lp.token_id for lp in s.logprobs]
            assert [lp.logprob for lp in streamed] == pytest.approx([lp.logprob for lp in s.logprobs], abs=1e-4)
            assert [p.finish_reason for p in mine][-1] == "length" and not any(p.finish_reason for p in mine[:-1])

    _serve(ckpt, body)


def test_logits_processing_fields_reach_the_engine(ckpt: Path, offline: LLM) -> None:
    tok = offline.get_tokenizer()
    assert tok is not None
    biased = tok.encode(" fox", add_special_tokens=False)[-1]
    fields: dict[str, Any] = {"presence_penalty": 1.5, "frequency_penalty": 0.5, "repetition_penalty": 1.3,
                              "min_p": 0.05, "min_tokens": 6, "stop_token_ids": [5, 6], "logit_bias": {biased: 3.0}}
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=12, **{**fields, "logit_bias": {biased: 3.0}})
    want = _offline_ids(offline, params)
    assert want != _offline_ids(offline, SamplingParams(temperature=0.8, seed=3, max_tokens=12))

    async def body(llm: AsyncLLM, stub: pb_grpc.GenerationStub) -> None:
        resp = await stub.Generate(pb.GenerateRequest(text=PROMPT, temperature=0.8, seed=3, max_tokens=12, **fields),
                                   timeout=RPC_TIMEOUT_S)
        assert list(resp.token_ids) == want
        forced = await stub.Generate(pb.GenerateRequest(text=PROMPT, temperature=0.0, max_tokens=5, ignore_eos=True,
                                                        logit_bias={biased: 100.0}), timeout=RPC_TIMEOUT_S)
        assert list(forced.token_ids) == [biased] * 5

    _serve(ckpt, body)


INVALID: list[tuple[str, dict[str, Any], str]] = [
    ("n_zero", {"n": 0}, "n=0"),
    ("n_too_many", {"n": 65}, "n=65"),
    ("presence_penalty", {"presence_penalty": 2.5}, "presence_penalty"),
    ("frequency_penalty_nan", {"frequency_penalty": float("nan")}, "frequency_penalty"),
    ("repetition_penalty_zero", {"repetition_penalty": 0.0}, "repetition_penalty"),
    ("min_p", {"min_p": 1.5}, "min_p"),
    ("logit_bias_value", {"logit_bias": {3: 150.0}}, "logit_bias"),
    ("logit_bias_outside_vocab", {"logit_bias": {10**6: 1.0}}, "logit_bias"),
    ("min_tokens_above_max_tokens", {"min_tokens": 20}, "min_tokens"),
    ("too_many_stop_token_ids", {"stop_token_ids": list(range(1025))}, "stop_token_ids"),
    ("n_above_queue", {"n": 5}, "--max-queue-length"),
    ("logprobs_above_max_logprobs", {"logprobs": 3}, "--max-logprobs"),
]


@pytest.mark.parametrize(("fields", "named"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_new_fields_are_invalid_argument_naming_them(ckpt: Path, fields: dict[str, Any], named: str) -> None:
    async def body(llm: AsyncLLM, stub: pb_grpc.GenerationStub) -> None:
        request = pb.GenerateRequest(text=PROMPT, max_tokens=12, **fields)
        for rpc in (stub.Generate(request, timeout=RPC_TIMEOUT_S),
                    _drain(stub.GenerateStream(request, timeout=RPC_TIMEOUT_S))):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await rpc
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
            assert named in (info.value.details() or "")
        assert llm.engine.counters.prompt_tokens == 0  # nothing reached the engine

    _serve(ckpt, body, max_queue_length=4, max_logprobs=2)


async def _drain(call: Any) -> None:
    async for _ in call:
        pass
