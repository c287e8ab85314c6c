"""The hold queue: bounded, FIFO per model, nothing lost (every held request is released or refused, never dropped)."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfleet_router.hold_queue import HoldQueue, HoldRefused


def test_bad_settings_name_the_field() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        HoldQueue(4, 0)


def test_a_waiter_past_its_timeout_is_refused_with_retry_after() -> None:
    async def main() -> None:
        q = HoldQueue(4, 0.05)
        with pytest.raises(HoldRefused, match="within") as info:
            await q.wait("m")
        assert info.value.retry_after_s == 0.05 and q.held("m") == 0

    asyncio.run(main())


def test_a_cancelled_waiter_gives_up_its_place() -> None:
    async def main() -> None:
        q = HoldQueue(4, 60)
        task = asyncio.create_task(q.wait("m"))
        while q.held("m") == 0:
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert q.held("m") == 0 and q.release("m") == 0

    asyncio.run(main())


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["wait", "release"]), st.sampled_from(["a", "b"]),
                              st.integers(1, 3)), max_size=40),
       size=st.integers(0, 5))
def test_held_requests_are_bounded_fifo_and_never_lost(ops: list[tuple[str, str, int]], size: int) -> None:
    async def main() -> None:
        q = HoldQueue(size, 3600)
        started: dict[str, list[int]] = {"a": [], "b": []}
        order: dict[str, list[int]] = {"a": [], "b": []}
        refused: list[int] = []
        tasks: list[asyncio.Task[None]] = []

        async def one(model: str, i: int) -> None:
            try:
                await q.wait(model)
                order[model].append(i)
            except HoldRefused:
                refused.append(i)

        for n, (op, model, count) in enumerate(ops):
            if op == "wait":
                tasks.append(asyncio.create_task(one(model, n)))
                started[model].append(n)
                await asyncio.sleep(0)  # let it enter the queue (or be refused) before the next operation
                assert q.held(model) <= size
            else:
                q.release(model, count)
                await asyncio.sleep(0)
        for model in ("a", "b"):
            q.release(model)
        await asyncio.gather(*tasks)
        for model in ("a", "b"):
            assert order[model] == sorted(order[model])  # first held, first released
        assert sorted(refused + order["a"] + order["b"]) == sorted(started["a"] + started["b"])  # nothing lost

    asyncio.run(main())
