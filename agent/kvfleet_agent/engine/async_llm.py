"""AsyncLLM: the engine on its own thread, with per-request async streams and abort, for the server."""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from kvfleet_agent.config import EngineConfig
from kvfleet_agent.engine.engine import LLMEngine
from kvfleet_agent.engine.request import Request
from kvfleet_agent.outputs import RequestOutput
from kvfleet_agent.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop failed; no request can make progress any more."""


@dataclass(eq=False)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


class AsyncLLM:
    """Runs LLMEngine.step in a dedicated thread; callers add requests and iterate their outputs.

    The engine is touched only by its thread: callers post commands (add, abort) to an inbox, so
    a long step never blocks the event loop and no lock is held around the model.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.engine = LLMEngine(config)
        self._inbox: queue.SimpleQueue[tuple[str, object, Future[None] | None]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._stopping = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="kvfleet-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_options(cls, model: str, **options: object) -> AsyncLLM:
        """Build from keyword engine options, like LLM(...)."""
        return cls(EngineConfig.from_kwargs(model, **options))

    @property
    def is_alive(self) -> bool:
        """Whether the engine thread is running and has not failed."""
        return self._thread.is_alive() and self.error is None

    def num_unfinished(self) -> int:
        """Requests accepted and not finished (approximate while a step runs)."""
        return len(self._streams)

    async def generate(self, prompt: str | Sequence[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's cumulative outputs; leaving the iteration early aborts the request.

        Invalid input raises ValueError before anything is queued.
        """
        if self.error is not None:
            raise EngineDeadError("the engine has failed") from self.error
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        req = self.engine.make_request(rid, prompt, params)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[rid] = stream
        self._post("add", req)
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError("the engine failed while serving this request") from item
                finished = item.finished
                yield item
        finally:
            if not finished:  # the consumer went away (disconnect, cancel): free the KV blocks now
                self._streams.pop(rid, None)
                self._post("abort", rid)

    async def abort(self, request_id: str) -> None:
        """Abort a request and wait until its blocks are back in the pool."""
        done: Future[None] = Future()
        self._streams.pop(request_id, None)
        self._post("abort", request_id, done)
        await asyncio.wrap_future(done)

    async def barrier(self) -> None:
        """Wait until the engine thread has handled every command posted before this call."""
        done: Future[None] = Future()
        self._post("barrier", None, done)
        await asyncio.wrap_future(done)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread (requests still running are aborted)."""
        self._stopping = True
        self._post("stop", None)
        self._thread.join(timeout)

    # -- engine thread ----------------------------------------------------------------------------

    def _post(self, op: str, arg: object, done: Future[None] | None = None) -> None:
        self._inbox.put((op, arg, done))

    def _drain_inbox(self, block: bool) -> None:
        while True:
            try:
                op, arg, done = self._inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            if op == "add":
                assert isinstance(arg, Request)
                self.engine.add(arg)
            elif op == "abort":
                self.engine.abort([str(arg)])
            if done is not None:
                done.set_result(None)

    def _loop(self) -> None:
        try:
            while not self._stopping:
                self._drain_inbox(block=not self.engine.has_unfinished())
                if self._stopping or not self.engine.has_unfinished():
                    continue
                for t in self.engine.step():
                    stream = self._streams.get(t.request.request_id)
                    if stream is None:
                        continue
                    out = self.engine.output(t)
                    if out.finished:
                        self._streams.pop(t.request.request_id, None)
                    stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)
        except BaseException as e:  # a failed step must not leave clients waiting forever
            log.exception("engine loop failed")
            self.error = e
            for stream in list(self._streams.values()):
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, e)
            self._streams.clear()
