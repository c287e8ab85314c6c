"""RequestStream: one request's outputs as an async iterator, fed from the engine thread; closing it early aborts."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass

from kvfleet_agent.outputs import RequestOutput

CLOSED = object()  # put in a stream's queue by close(), so a pending __anext__ wakes up and ends


@dataclass(eq=False)
class StreamChannel:
    """The engine side of a stream: the consumer's loop and queue."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[object]
    # The consumer left: outputs are dropped, but the id stays taken until the engine confirms the
    # abort, so a new request reusing the id cannot receive the old request's last output.
    closed: bool = False


class RequestStream:
    """One request's outputs as they come (cumulative); an async iterator that aborts when closed early."""

    def __init__(self, request_id: str, channel: StreamChannel, abandon: Callable[[], None]) -> None:
        self.request_id, self._channel, self._abandon = request_id, channel, abandon
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._channel.queue.get()
        except asyncio.CancelledError:  # the consumer was cancelled mid-wait (a disconnect): it is gone
            self.close()
            raise
        if item is CLOSED:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._done = True
            raise item  # ValueError: this request was refused; EngineDeadError: the engine failed
        assert isinstance(item, RequestOutput)
        self._done = item.finished
        return item

    async def aclose(self) -> None:
        """Stop listening; an unfinished request is aborted and its KV blocks freed."""
        self.close()

    def close(self) -> None:
        """Synchronous aclose, also run when the stream is garbage collected (e.g. after `break`)."""
        if not self._done:
            self._done = True
            self._abandon()
            with contextlib.suppress(RuntimeError):  # the consumer's loop may already be closed
                self._channel.queue.put_nowait(CLOSED)  # wake a task still waiting in __anext__

    def __del__(self) -> None:
        self.close()
