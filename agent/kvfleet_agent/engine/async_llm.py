"""AsyncLLM: the engine on its own thread, with per-request async streams and abort, for the server."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from kvfleet_agent.config import EngineConfig
from kvfleet_agent.engine.engine import LLMEngine
from kvfleet_agent.engine.request import Request
from kvfleet_agent.outputs import RequestOutput
from kvfleet_agent.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop failed or was shut down; no request can make progress any more."""


_CLOSED = object()  # put in a stream's queue by close(), so a pending __anext__ wakes up and ends


@dataclass(eq=False)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[object]
    # The consumer left: outputs are dropped, but the id stays taken until the engine confirms the
    # abort, so a new request reusing the id cannot receive the old request's last output.
    closed: bool = False


class RequestStream:
    """One request's outputs as they come (cumulative); an async iterator that aborts when closed early."""

    def __init__(self, llm: AsyncLLM, request_id: str, stream: _Stream) -> None:
        self.llm, self.request_id, self._stream = llm, request_id, stream
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._stream.queue.get()
        except asyncio.CancelledError:  # the consumer was cancelled mid-wait (a disconnect): it is gone
            self.close()
            raise
        if item is _CLOSED:
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
            self.llm._abandon(self.request_id, self._stream)
            with contextlib.suppress(RuntimeError):  # the consumer's loop may already be closed
                self._stream.queue.put_nowait(_CLOSED)  # wake a task still waiting in __anext__

    def __del__(self) -> None:
        self.close()


class AsyncLLM:
    """Runs LLMEngine.step in a dedicated thread; callers add requests and iterate their outputs.

    The engine is touched only by its thread: callers post commands (add, abort) to an inbox, so
    a long step never blocks the event loop and no lock is held around the model. One small lock
    orders stream registration against the engine's death, so no stream can outlive the engine.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.engine = LLMEngine(config)
        self._inbox: queue.SimpleQueue[tuple[str, object, Future[None] | None]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        # Adds posted (caller side) and taken (engine side): each written by one thread only.
        self._adds_posted = 0
        self._adds_taken = 0
        self._closed = False  # shutdown() was called: take no new requests
        self._stopped = False  # the engine thread is done (stop handled, or it failed)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="kvfleet-engine", daemon=True)
        self._thread.start()
        # A tensor-parallel worker's death wakes the engine thread even when it is idle, so the
        # failure reaches /health and the watchdog now rather than on the next request.
        self.engine.executor.on_failure(lambda: self._post("check", None))

    @classmethod
    def from_options(cls, model: str, **options: object) -> AsyncLLM:
        """Build from keyword engine options, like LLM(...)."""
        return cls(EngineConfig.from_kwargs(model, **options))

    @property
    def is_alive(self) -> bool:
        """Whether the engine thread is running and has not failed, and no tensor-parallel worker has died."""
        return (self._thread.is_alive() and self.error is None and not self._stopped
                and self.engine.executor.failure is None)

    def num_unfinished(self) -> int:
        """Requests accepted and not finished (approximate while a step runs)."""
        return len(self._streams)

    def num_waiting(self) -> int:
        """Requests accepted but not yet running: queued in the engine or still on their way to it."""
        # Read from another thread without a lock: len() of a deque is atomic, and an estimate
        # one step stale is all admission control needs.
        return len(self.engine.scheduler.waiting) + max(0, self._adds_posted - self._adds_taken)

    def generate(self, prompt: str | Sequence[int], params: SamplingParams,
                 request_id: str | None = None) -> RequestStream:
        """Queue a request now and return the stream of its cumulative outputs.

        Invalid input raises ValueError here, before anything is queued. Queueing at call time (not
        at first iteration) keeps admission control exact: a request counts as waiting the moment
        it is accepted. Closing the stream early, or dropping it, aborts the request.
        """
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        req = self.engine.make_request(rid, prompt, params)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if self.error is not None or self._stopped or self._closed:
                raise EngineDeadError("the engine has failed" if self.error else "the engine is shut down")
            if rid in self._streams:
                raise ValueError(f"request_id {rid!r} is already in use by a running request: pick another")
            self._streams[rid] = stream
            self._adds_posted += 1
            self._post("add", req)
        return RequestStream(self, rid, stream)

    def _abandon(self, request_id: str, stream: _Stream) -> None:
        """A consumer left before the end: stop delivering to it and free the request's blocks."""
        stream.closed = True
        if not self._stopped:
            self._post("abort", request_id)

    async def abort(self, request_id: str) -> None:
        """Abort a request and wait until its blocks are back in the pool.

        A consumer still iterating the request's stream gets a last output with finish_reason "abort".
        """
        await self._command("abort", request_id)

    async def barrier(self) -> None:
        """Wait until the engine thread has handled every command posted before this call."""
        await self._command("barrier", None)

    async def _command(self, op: str, arg: object) -> None:
        done: Future[None] = Future()
        with self._lock:
            if self._stopped:  # nobody will read the inbox again: the command is moot
                return
            self._post(op, arg, done)
        await asyncio.wrap_future(done)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread and any worker processes; unfinished requests end with finish_reason "abort"."""
        self._closed = True
        self._post("stop", None)
        self._thread.join(timeout)
        # Also after a join that timed out: a thread stuck in a collective is freed when the workers exit.
        self.engine.shutdown()

    # -- engine thread ----------------------------------------------------------------------------

    def _post(self, op: str, arg: object, done: Future[None] | None = None) -> None:
        self._inbox.put((op, arg, done))

    def _drain_inbox(self, block: bool) -> None:
        while True:
            try:
                op, arg, done = self._inbox.get(block=block)
            except queue.Empty:
                return
            if block:  # the engine was idle: restart the progress clock so /health sees no stall
                self.engine.counters.last_step_time = time.time()
            block = False
            if op == "check":
                self.engine.check_health()  # raises if a worker died: the loop ends as a failure
            elif op == "add":
                assert isinstance(arg, Request)
                self._adds_taken += 1
                try:
                    self.engine.add(arg)
                except ValueError as e:  # one bad request must not take the engine down
                    self._deliver(arg.request_id, e)
            elif op in ("abort", "stop"):
                ids = [str(arg)] if op == "abort" else self.engine.unfinished_ids()
                for out in self.engine.abort(ids):
                    self._deliver(out.request_id, out)
                self._stopped = self._stopped or op == "stop"
            if done is not None:
                done.set_result(None)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        """Hand an output (or error) to the request's consumer; its last item releases the id."""
        last = not isinstance(item, RequestOutput) or item.finished
        stream = self._streams.pop(request_id, None) if last else self._streams.get(request_id)
        if stream is None or stream.closed:
            return
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the consumer's event loop is closed: it is gone, free its request
            stream.closed = True
            if not last:
                self._post("abort", request_id)

    def _loop(self) -> None:
        failure: BaseException | None = None
        try:
            while not self._stopped:
                self._drain_inbox(block=not self.engine.has_unfinished())
                if self._stopped or not self.engine.has_unfinished():
                    continue
                for t in self.engine.step():
                    if t.request.request_id in self._streams:
                        self._deliver(t.request.request_id, self.engine.output(t))
        except BaseException as e:  # a failed step must not leave clients waiting forever
            log.exception("engine loop failed")
            failure = e
        with self._lock:  # from here no stream can be registered, and none is left waiting
            self.error = failure
            self._stopped = True
            streams, self._streams = list(self._streams.items()), {}
        dead = EngineDeadError("the engine failed while serving this request" if failure
                               else "the engine was shut down")
        if failure is not None:
            dead.__cause__ = failure
        for rid, stream in streams:
            self._streams[rid] = stream  # _deliver pops it again
            self._deliver(rid, dead)
        while True:  # resolve commands nobody will run, so no caller of abort()/barrier() hangs
            try:
                _, _, done = self._inbox.get_nowait()
            except queue.Empty:
                break
            if done is not None:
                done.set_result(None)
