"""AsyncLLM under failure: a dead engine, a reused request id, an interrupted offline generate."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from kvfleet_agent.engine.async_llm import AsyncLLM, EngineDeadError
from kvfleet_agent.engine.llm_engine import LLMEngine
from kvfleet_agent.llm import LLM
from kvfleet_agent.outputs import RequestOutput
from kvfleet_agent.sampling_params import SamplingParams

OPTIONS: dict[str, Any] = {"max_num_seqs": 8, "kv_cache_memory_bytes": 4 << 20}
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)


def _fail_after(llm: AsyncLLM | LLM, steps: int, exc: BaseException) -> None:
    """Fault injection: the engine's step raises after `steps` good steps."""
    engine = llm.engine
    real = engine.step
    count = [0]

    def step(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        if count[0] > steps:
            raise exc
        return real(*args, **kwargs)

    engine.step = step  # type: ignore[method-assign]


def test_engine_death_reaches_every_consumer_as_engine_dead_and_nothing_hangs(ckpt: Path) -> None:
    llm = AsyncLLM.from_options(str(ckpt), **OPTIONS)

    async def body() -> None:
        streams = [llm.generate([1, 30 + i, 40], LONG) for i in range(3)]
        first = [await anext(s) for s in streams]  # all three are generating
        assert all(not o.finished for o in first)
        _fail_after(llm, 0, RuntimeError("simulated device fault"))
        for s in streams:
            with pytest.raises(EngineDeadError):  # never a ValueError: clients must not see "bad input"
                async for _ in s:
                    pass
        assert not llm.is_alive and isinstance(llm.error, RuntimeError)
        await asyncio.wait_for(llm.abort("anything"), 5)  # returns instead of hanging on a dead inbox
        await asyncio.wait_for(llm.barrier(), 5)
        with pytest.raises(EngineDeadError):
            llm.generate([1, 2, 3], LONG)

    try:
        asyncio.run(asyncio.wait_for(body(), 60))
    finally:
        llm.shutdown()


def test_a_request_id_is_free_again_only_after_its_abort_lands(ckpt: Path) -> None:
    llm = AsyncLLM.from_options(str(ckpt), **OPTIONS)

    async def body() -> None:
        old = llm.generate([1, 5, 6, 7], LONG, request_id="X")
        await anext(old)
        await old.aclose()  # the consumer leaves; the abort is on its way to the engine thread
        with pytest.raises(ValueError, match="already in use"):
            llm.generate([1, 8, 9], LONG, request_id="X")  # not yet: the old request still holds the id
        await llm.barrier()
        new = llm.generate([1, 8, 9], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
                           request_id="X")
        outs = [o async for o in new]
        assert outs[-1].prompt_token_ids == [1, 8, 9]  # its own outputs, not the old request's abort
        assert outs[-1].outputs[0].finish_reason == "length" and len(outs[-1].outputs[0].token_ids) == 5
        await llm.barrier()
        assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_blocks

    try:
        asyncio.run(asyncio.wait_for(body(), 60))
    finally:
        llm.shutdown()


def test_interrupted_offline_generate_leaves_the_engine_ready_for_the_next_call(ckpt: Path) -> None:
    llm = LLM(model=str(ckpt), **OPTIONS)
    real_step = llm.engine.step
    _fail_after(llm, 2, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        llm.generate([{"prompt_token_ids": [1, 10 + i]} for i in range(4)], LONG, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_blocks
    llm.engine.step = real_step  # type: ignore[method-assign]
    outs = llm.generate([{"prompt_token_ids": [1, 99]}], SamplingParams(max_tokens=3, temperature=0),
                        use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 3


def test_the_engine_is_built_and_stepped_on_its_own_thread(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server builds AsyncLLM in an executor thread that lives on; had the model been loaded there, that thread's
    OpenMP team would double the process's OpenMP threads and make the engine thread's team sleep between regions."""
    import concurrent.futures
    import threading

    from kvfleet_agent.engine import async_llm

    seen: set[str] = set()

    class Recording(LLMEngine):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            seen.add(f"built on {threading.current_thread().name}")
            super().__init__(*args, **kwargs)

        def step(self, finished_only: bool = False) -> list[RequestOutput]:
            seen.add(f"stepped on {threading.current_thread().name}")
            return super().step(finished_only)

    monkeypatch.setattr(async_llm, "LLMEngine", Recording)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        llm = pool.submit(AsyncLLM.from_options, str(ckpt), **OPTIONS).result()
    try:
        async def one() -> list[Any]:
            return [o async for o in llm.generate("hi", SamplingParams(temperature=0.0, max_tokens=2))]

        assert asyncio.run(one())[-1].finished
    finally:
        llm.shutdown()
    assert seen == {"built on kvfleet-engine", "stepped on kvfleet-engine"}


def test_a_failed_build_is_raised_to_the_caller_and_leaves_no_engine_thread(tmp_path: Path) -> None:
    import threading

    with pytest.raises(Exception) as direct:
        LLM(model=str(tmp_path / "missing"), **OPTIONS)
    with pytest.raises(type(direct.value), match="missing"):
        AsyncLLM.from_options(str(tmp_path / "missing"), **OPTIONS)
    assert not [t for t in threading.enumerate() if t.name == "kvfleet-engine" and t.is_alive()]
