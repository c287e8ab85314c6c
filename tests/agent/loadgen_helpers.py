"""Shared by the load-generator tests (no tests of its own): a bounded event loop and a completion chunk."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine
from typing import Any, TypeVar

LOOP_TIMEOUT_S = 20.0  # guards every event loop; no test comes near it when the code works
T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run coro in a new event loop, bounded so that a lost wake-up fails a test instead of hanging it."""

    async def bounded() -> T:
        return await asyncio.wait_for(coro, LOOP_TIMEOUT_S)

    return asyncio.run(bounded())


def chunk(text: str, finish: str | None = None, usage: dict[str, int] | None = None) -> str:
    """The data of one streamed /v1/completions chunk."""
    obj: dict[str, Any] = {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}
    if usage is not None:
        obj["usage"] = usage
    return json.dumps(obj)
