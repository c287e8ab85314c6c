"""Tests for AsyncLLM: streaming, concurrency, abort/disconnect freeing KV blocks, bad input, shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import pytest
from llm_helpers import greedy

from kvfleet_agent.engine.async_llm import AsyncLLM
from kvfleet_agent.llm import LLM
from kvfleet_agent.outputs import RequestOutput
from kvfleet_agent.sampling_params import SamplingParams

# Not llm_helpers.ENGINE_OPTIONS: no max_model_len cap, so that LONG requests run on until a test ends them.
ENGINE_OPTIONS: dict[str, Any] = {
    "kv_cache_memory_bytes": 4 << 20,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 256,
    "block_size": 16,
}
PROMPTS = [
    "The quick brown fox",
    "hello world",
    "one two three four five",
    "café naïve Straße",
    "a b c",
    "The money and the woman",
    "🙂 🚀 €",
    "write a great word",
]
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)  # far longer than any test waits for
LOOP_TIMEOUT_S = 30.0  # guards against hangs; no test comes near it when the library works
HANG_TIMEOUT_S = 3.0  # how long a stream may take to end after abort/shutdown before we call it hung


@pytest.fixture(scope="module")
def offline(ckpt: Path) -> LLM:
    return LLM(model=str(ckpt), **ENGINE_OPTIONS)


def _run(llm: AsyncLLM, body: Callable[[AsyncLLM], Awaitable[None]]) -> None:
    """Run body(llm) on a fresh event loop, always shutting the engine down afterwards.

    The loop is bounded by LOOP_TIMEOUT_S, so that a lost output fails the test instead of hanging it.
    """
    try:
        asyncio.run(asyncio.wait_for(body(llm), LOOP_TIMEOUT_S))
    finally:
        llm.shutdown()


def _all_free(llm: AsyncLLM) -> bool:
    return llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_blocks


def _assert_idle(llm: AsyncLLM) -> None:
    """Call after barrier(): nothing running, nothing queued, every KV block back in the pool."""
    assert _all_free(llm), (llm.engine.kv.pool.num_free, llm.engine.kv.pool.num_blocks)
    assert not llm.engine.has_unfinished()
    assert llm.num_unfinished() == 0
    assert llm.is_alive


async def _collect(llm: AsyncLLM, prompt: str | list[int], params: SamplingParams,
                   request_id: str | None = None) -> list[RequestOutput]:
    return [out async for out in llm.generate(prompt, params, request_id=request_id)]


# --- streaming -----------------------------------------------------------------------------------


def test_streams_token_by_token_and_matches_offline(ckpt: Path, offline: LLM) -> None:
    n = 12
    (ref,) = offline.generate([PROMPTS[0]], greedy(n), use_tqdm=False)

    async def body(llm: AsyncLLM) -> None:
        outs = await _collect(llm, PROMPTS[0], greedy(n), request_id="stream-1")
        assert [len(o.outputs[0].token_ids) for o in outs] == list(range(1, n + 1))
        assert [o.finished for o in outs] == [False] * (n - 1) + [True]
        for prev, cur in itertools.pairwise(outs):
            assert cur.outputs[0].token_ids[:-1] == prev.outputs[0].token_ids  # cumulative, one more each
            assert cur.outputs[0].text.startswith(prev.outputs[0].text)
        final = outs[-1]
        assert final.request_id == "stream-1"
        assert final.prompt == PROMPTS[0]
        assert final.prompt_token_ids == ref.prompt_token_ids
        assert final.outputs[0].token_ids == ref.outputs[0].token_ids
        assert final.outputs[0].text == ref.outputs[0].text
        assert final.outputs[0].finish_reason == "length"
        assert all(o.outputs[0].finish_reason is None for o in outs[:-1])
        await llm.barrier()
        _assert_idle(llm)

    _run(AsyncLLM.from_options(str(ckpt), **ENGINE_OPTIONS), body)


def _stop_across_token_boundary(offline: LLM, prompt: str, n: int) -> tuple[str, str]:
    """(greedy text, a 3-letter stop string whose first letter ends one token and the rest starts the next)."""
    tok = offline.get_tokenizer()
    assert tok is not None
    comp = offline.generate([prompt], greedy(n), use_tqdm=False)[0].outputs[0]
    full = comp.text
    for k in range(1, len(comp.token_ids)):
        head = tok.decode(comp.token_ids[:k])
        b = len(head)
        stop = full[b - 1:b + 2]
        if full.startswith(head) and len(stop) == 3 and stop.isascii() and stop.isalpha() \
                and full.find(stop) == b - 1:
            return full, stop
    raise AssertionError(f"no stop string across a token boundary in {full!r}")


def test_streamed_text_with_stop_string_only_grows(ckpt: Path, offline: LLM) -> None:
    full, stop = _stop_across_token_boundary(offline, PROMPTS[2], 40)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop])

    async def body(llm: AsyncLLM) -> None:
        outs = await _collect(llm, PROMPTS[2], params)
        final = outs[-1].outputs[0]
        assert (final.finish_reason, final.stop_reason) == ("stop", stop)
        assert final.text == full[:full.find(stop)]
        # Streams send differences, so no intermediate text may be taken back: each one is a prefix
        # of the final text and never shows (part of) the stop string that ends it.
        for out in outs:
            assert final.text.startswith(out.outputs[0].text)
        await llm.barrier()
        _assert_idle(llm)

    _run(AsyncLLM.from_options(str(ckpt), **ENGINE_OPTIONS), body)


def test_concurrent_requests_all_finish(ckpt: Path, offline: LLM) -> None:
    lengths = [3 + i for i in range(len(PROMPTS))]
    refs = offline.generate(PROMPTS, [greedy(m) for m in lengths], use_tqdm=False)

    async def body(llm: AsyncLLM) -> None:
        results = await asyncio.gather(*(_collect(llm, p, greedy(m)) for p, m in zip(PROMPTS, lengths, strict=True)))
        ids = {outs[-1].request_id for outs in results}
        assert len(ids) == len(PROMPTS)  # generated request ids are unique
        for outs, m, ref in zip(results, lengths, refs, strict=True):
            final = outs[-1]
            assert final.finished and len(outs) == m
            assert final.outputs[0].finish_reason == "length"
            assert final.outputs[0].token_ids == ref.outputs[0].token_ids
        await llm.barrier()
        _assert_idle(llm)
        assert llm.engine.counters.finished["length"] == len(PROMPTS)

    _run(AsyncLLM.from_options(str(ckpt), **ENGINE_OPTIONS), body)


def test_the_gauges_are_one_moment_the_engine_thread_published(ckpt: Path) -> None:
    # A reader on another thread that took len(waiting) and len(running) apart counted a request that moved between
    # them twice (an agent's gauges read 4 requests where its router had sent 3): stats() reads the queues the engine
    # thread last published, whole, plus the adds posted since, never the scheduler's lists while they change.
    async def body(llm: AsyncLLM) -> None:
        stream = llm.generate("hello world", LONG)
        async for _ in stream:  # its first token: it runs
            break
        assert (llm.stats().num_waiting, llm.stats().num_running) == (0, 1)
        await llm.abort(stream.request_id)
        await llm.barrier()
        _assert_idle(llm)
        assert (llm.stats().num_waiting, llm.stats().num_running, llm.num_waiting()) == (0, 0, 0)
        sched = llm.engine.scheduler
        # The engine thread is idle (it waits for a command), so nothing but this test touches the lists now: what
        # a reader sees of them mid-change stands in for a half-made move.
        ghost = object()
        sched.waiting.append(ghost)  # type: ignore[arg-type]
        sched.running.append(ghost)  # type: ignore[arg-type]
        try:
            assert (llm.stats().num_waiting, llm.stats().num_running, llm.num_waiting()) == (0, 0, 0)
        finally:
            sched.waiting.pop()
            sched.running.pop()

    _run(AsyncLLM.from_options(str(ckpt), **ENGINE_OPTIONS), body)


# --- abort and disconnect -------------------------------------------------------------------------


def test_abort_frees_blocks(ckpt: Path) -> None:
    async def body(llm: AsyncLLM) -> None:
        received = 0
        stream = cast(AsyncGenerator[RequestOutput, None], llm.generate(PROMPTS[1], LONG, request_id="long"))
        async with contextlib.aclosing(stream):
            async for out in stream:
                received += 1
                assert not out.finished
                if received == 2:
                    assert not _all_free(llm)  # the request holds KV blocks while it runs
                    await llm.abort("long")
                    break
        await llm.barrier()
        _assert_idle(llm)
        assert llm.engine.counters.finished["abort"] == 1
        # The engine keeps serving.
        outs = await _collect(llm, PROMPTS[2], greedy(3))
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3

    _run(AsyncLLM.from_options(str(ckpt), **ENGINE_OPTIONS), body)


def test_abort_of_unknown_or_finished_request_is_harmless(ckpt: Path) -> None:
    async def body(llm: AsyncLLM) -> None:
        outs = await _collect(llm, PROMPTS[0], greedy(2), request_id="done")
        await llm.abort("done")
        await llm.abort("never-existed")
        await llm.barrier()
        _assert_idle(llm)
        assert outs[-1].outputs[0].finish_reason == "length"
        assert llm.engine.counters.finished["abort"] == 0

    _run(AsyncLLM.from_options(str(ckpt), **ENGINE_OPTIONS), body)


def test_breaking_out_of_the_stream_frees_blocks(ckpt: Path) -> None:
    async def body(llm: AsyncLLM) -> None:
        for _ in range(3):
            received = 0
            async for _out in llm.generate(PROMPTS[3], LONG):
                received += 1
                if received == 2:
                    assert not _all_free(llm)
                    break
            # The abandoned generator is finalised by asyncio, which schedules its aclose() (whose
            # `finally` posts the abort) before this task can resume from the first barrier; the
            # second barrier then runs after that abort in the engine thread.
            await llm.barrier()
            await llm.barrier()
            _assert_idle(llm)
        assert llm.engine.counters.finished["abort"] == 3

    _run(AsyncLLM.from_options(str(ckpt), **ENGINE_OPTIONS), body)


def test_cancelled_consumer_frees_blocks(ckpt: Path) -> None:
    async def body(llm: AsyncLLM) -> None:
        two = asyncio.Event()

        async def consume() -> None:
            received = 0
            async for _out in llm.generate(PROMPTS[4], LONG):
                received += 1
                if received == 2:
                    two.set()

        task = asyncio.create_task(consume())
        await two.wait()
        assert not _all_free(llm)
        task.cancel()  # what a server does when the client disconnects
        with pytest.raises(asyncio.CancelledError):
            await task
        await llm.barrier()
        _assert_idle(llm)
        assert llm.engine.counters.finished["abort"] == 1

    _run(AsyncLLM.from_options(str(ckpt), **ENGINE_OPTIONS), body)


def test_abort_ends_a_concurrent_consumers_stream(ckpt: Path) -> None:
    async def body(llm: AsyncLLM) -> None:
        two = asyncio.Event()
        outs: list[RequestOutput] = []

        async def consume() -> None:
            async for out in llm.generate(PROMPTS[5], LONG, request_id="victim"):
                outs.append(out)
                if len(outs) == 2:
                    two.set()

        task = asyncio.create_task(consume())
        await two.wait()
        await llm.abort("victim")
        try:
            await asyncio.wait_for(task, HANG_TIMEOUT_S)
        except TimeoutError:
            pytest.fail("the consumer of an aborted request is still waiting for output")
        assert outs[-1].finished
        assert outs[-1].outputs[0].finish_reason == "abort"

    _run(AsyncLLM.from_options(str(ckpt), **ENGINE_OPTIONS), body)


# --- invalid input --------------------------------------------------------------------------------


@pytest.mark.parametrize(("prompt", "match"), [([], "empty"), ([1, 10**6], "vocab_size")], ids=["empty", "oov"])
def test_invalid_input_raises_before_queueing(ckpt: Path, prompt: list[int], match: str) -> None:
    async def body(llm: AsyncLLM) -> None:
        with pytest.raises(ValueError, match=match):
            await _collect(llm, prompt, greedy(4), request_id="bad")
        assert llm.num_unfinished() == 0  # no stream was registered
        await llm.barrier()
        _assert_idle(llm)
        assert llm.engine.counters.prompt_tokens == 0  # nothing reached the engine
        # The engine keeps serving, even under the id the bad request asked for.
        outs = await _collect(llm, PROMPTS[0], greedy(3), request_id="bad")
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3

    _run(AsyncLLM.from_options(str(ckpt), **ENGINE_OPTIONS), body)


def test_duplicate_request_id_is_rejected_and_engine_survives(ckpt: Path) -> None:
    async def body(llm: AsyncLLM) -> None:
        first = asyncio.Event()

        async def consume() -> list[RequestOutput]:
            outs = []
            async for out in llm.generate(PROMPTS[0], greedy(40), request_id="dup"):
                outs.append(out)
                first.set()
            return outs

        task = asyncio.create_task(consume())
        await first.wait()
        try:
            with pytest.raises(ValueError, match="dup"):
                await asyncio.wait_for(_collect(llm, PROMPTS[1], greedy(4), request_id="dup"), HANG_TIMEOUT_S)
            # The first request generates its remaining tokens: that takes what the machine takes (LOOP_TIMEOUT_S
            # still bounds a hang), unlike an abort's end, which HANG_TIMEOUT_S times.
            outs = await task
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 40
            assert llm.is_alive
        finally:
            task.cancel()

    _run(AsyncLLM.from_options(str(ckpt), **ENGINE_OPTIONS), body)


# --- shutdown -------------------------------------------------------------------------------------


def test_shutdown_stops_idle_engine_thread(ckpt: Path) -> None:
    llm = AsyncLLM.from_options(str(ckpt), **ENGINE_OPTIONS)
    try:
        assert llm.is_alive
    finally:
        start = time.monotonic()
        llm.shutdown(timeout=10.0)
    assert time.monotonic() - start < 5.0
    assert not llm.is_alive


def test_shutdown_stops_busy_engine_thread(ckpt: Path) -> None:
    llm = AsyncLLM.from_options(str(ckpt), **ENGINE_OPTIONS)
    elapsed: list[float] = []

    async def body(llm: AsyncLLM) -> None:
        running = asyncio.Event()

        async def consume() -> None:
            async for _out in llm.generate(PROMPTS[6], LONG):
                running.set()

        task = asyncio.create_task(consume())
        await running.wait()
        start = time.monotonic()
        llm.shutdown(timeout=10.0)
        elapsed.append(time.monotonic() - start)
        task.cancel()  # shutdown ends the stream too (next test); cancelling keeps this one about timing
        with contextlib.suppress(asyncio.CancelledError):
            await task

    _run(llm, body)
    assert elapsed and elapsed[0] < 5.0
    assert not llm.is_alive


def test_shutdown_aborts_running_requests(ckpt: Path) -> None:
    llm = AsyncLLM.from_options(str(ckpt), **ENGINE_OPTIONS)

    async def body(llm: AsyncLLM) -> None:
        running = asyncio.Event()
        outs: list[RequestOutput] = []

        async def consume() -> None:
            async for out in llm.generate(PROMPTS[7], LONG):
                outs.append(out)
                running.set()

        task = asyncio.create_task(consume())
        await running.wait()
        llm.shutdown(timeout=10.0)
        assert not llm.engine.has_unfinished()
        assert _all_free(llm)
        try:
            await asyncio.wait_for(task, HANG_TIMEOUT_S)
        except TimeoutError:
            pytest.fail("the stream of a request running at shutdown never ended")

    _run(llm, body)
