"""AsyncLLM: the engine on its own thread behind one facade, the only engine object the server sees."""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future

from kvfleet_agent.config import EngineConfig
from kvfleet_agent.engine.commands import Abort, Add, Barrier, CheckHealth, Command, Posted, Stop
from kvfleet_agent.engine.llm_engine import LLMEngine
from kvfleet_agent.engine.request_stream import RequestStream, StreamChannel
from kvfleet_agent.engine.stats import EngineObserver, EngineStats
from kvfleet_agent.models.tokenizer import Tokenizer
from kvfleet_agent.outputs import RequestOutput
from kvfleet_agent.sampling_params import SamplingParams
from kvfleet_agent.worker.grammar_compiler import GrammarCompiler

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop failed or was shut down; no request can make progress any more."""


class AsyncLLM:
    """Runs LLMEngine.step in a dedicated thread; callers add requests and iterate their outputs.

    The engine is touched only by its thread: callers post commands (commands.py) to an inbox, so
    a long step never blocks the event loop and no lock is held around the model. One small lock
    orders stream registration against the engine's death, so no stream can outlive the engine.
    Everything a server needs of the engine (tokenizer, limits, health, stats, worker pids) is a
    method here.
    """

    def __init__(self, config: EngineConfig) -> None:
        self._inbox: queue.SimpleQueue[Posted] = queue.SimpleQueue()
        self._streams: dict[str, StreamChannel] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        # Adds posted (caller side) and taken (engine side): each written by one thread only.
        self._adds_posted = 0
        self._adds_taken = 0
        # (waiting, running, adds taken) as the engine thread last left them, published as one tuple so a reader on
        # another thread sees one moment: len(waiting) then len(running) read apart counted a request that moved
        # between them twice (an agent's gauges read 4 where the router had sent it 3).
        self._queues = (0, 0, 0)
        self._closed = False  # shutdown() was called: take no new requests
        self._stopped = False  # the engine thread is done (stop handled, or it failed)
        self.error: BaseException | None = None
        # The engine is built on its own thread, not the caller's: libgomp counts every OpenMP team's threads, and
        # once there are more than cores (the caller's team from loading the model, kept by a thread that lives
        # on, plus the engine thread's own) a team's workers stop spinning between parallel regions and sleep in
        # the kernel, to be woken for each of a step's hundreds of regions: a batch-1 decode step took 26 ms on
        # the engine thread against 17 ms on the thread that built the model (2 cores).
        built: Future[LLMEngine] = Future()
        self._thread = threading.Thread(target=self._build_and_loop, args=(config, built), name="kvfleet-engine",
                                        daemon=True)
        self._thread.start()
        self.engine = built.result()  # re-raises what building raised, on the caller's thread
        # A tensor-parallel worker's death wakes the engine thread even when it is idle, so the
        # failure reaches /health and the watchdog now rather than on the next request.
        self.engine.executor.on_failure(lambda: self._post(CheckHealth()))

    @classmethod
    def from_options(cls, model: str, **options: object) -> AsyncLLM:
        """Build from keyword engine options, like LLM(...)."""
        return cls(EngineConfig.from_kwargs(model, **options))

    # -- what the server reads ----------------------------------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer, or None when the checkpoint has no tokenizer.json."""
        return self.engine.tokenizer

    @property
    def grammars(self) -> GrammarCompiler | None:
        """The structured-output grammar compiler (cached), or None without a tokenizer; call it off the loop."""
        return self.engine.grammars

    @property
    def max_model_len(self) -> int:
        """Prompt plus output tokens a request may reach."""
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        """Token ids a request may name: [0, vocab_size)."""
        return self.engine.model_config.vocab_size

    @property
    def model_path(self) -> str:
        """The checkpoint directory the model was loaded from."""
        return self.engine.config.model

    @property
    def is_alive(self) -> bool:
        """Whether the engine thread is running and has not failed, and no tensor-parallel worker has died."""
        return (self._thread.is_alive() and self.error is None and not self._stopped
                and self.engine.executor.failure is None)

    def failure(self) -> str | None:
        """Why the engine can serve no more (its loop failed, or a tensor-parallel worker died), or None."""
        if self.error is not None:
            return f"{type(self.error).__name__}: {self.error}"
        return self.engine.executor.failure

    def worker_pids(self) -> list[int]:
        """Process ids of the tensor-parallel workers (ranks 1..N-1; empty with one rank)."""
        return self.engine.executor.worker_pids()

    def add_observer(self, observer: EngineObserver) -> None:
        """Tell observer of every token and finished request, on the engine's thread (add before serving)."""
        self.engine.observers.append(observer)

    def stats(self) -> EngineStats:
        """The engine's gauges and counters now (read without a lock: a step stale at worst)."""
        return self.engine.stats(queues=self._queue_lengths())

    def num_unfinished(self) -> int:
        """Requests accepted and not finished (approximate while a step runs)."""
        return len(self._streams)

    def num_waiting(self) -> int:
        """Requests accepted but not yet running: queued in the engine or still on their way to it."""
        return self._queue_lengths()[0]

    def _queue_lengths(self) -> tuple[int, int]:
        """(waiting, running) from the engine thread's last published queues (a step stale at worst, all a scrape or
        admission control needs), waiting with the adds posted since it took its last: each request counted once."""
        waiting, running, taken = self._queues
        return waiting + max(0, self._adds_posted - taken), running

    def _publish(self) -> None:
        """Publish the scheduler's queue lengths (engine thread, after every change and before any output goes)."""
        sched = self.engine.scheduler
        self._queues = (len(sched.waiting), len(sched.running), self._adds_taken)

    # -- requests -------------------------------------------------------------------------------------

    def generate(self, prompt: str | Sequence[int], params: SamplingParams,
                 request_id: str | None = None) -> RequestStream:
        """Queue a request now and return the stream of its cumulative outputs.

        Invalid input raises ValueError here, before anything is queued. Queueing at call time (not
        at first iteration) keeps admission control exact: a request counts as waiting the moment
        it is accepted. Closing the stream early, or dropping it, aborts the request.
        """
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        req = self.engine.make_request(rid, prompt, params)
        channel = StreamChannel(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if self.error is not None or self._stopped or self._closed:
                raise EngineDeadError("the engine has failed" if self.error else "the engine is shut down")
            if rid in self._streams:
                raise ValueError(f"request_id {rid!r} is already in use by a running request: pick another")
            self._streams[rid] = channel
            self._adds_posted += 1
            self._post(Add(req))
        return RequestStream(rid, channel, lambda: self._abandon(rid, channel))

    def _abandon(self, request_id: str, channel: StreamChannel) -> None:
        """A consumer left before the end: stop delivering to it and free the request's blocks."""
        channel.closed = True
        if not self._stopped:
            self._post(Abort(request_id))

    async def abort(self, request_id: str) -> None:
        """Abort a request and wait until its blocks are back in the pool.

        A consumer still iterating the request's stream gets a last output with finish_reason "abort".
        """
        await self._command(Abort(request_id))

    async def barrier(self) -> None:
        """Wait until the engine thread has handled every command posted before this call."""
        await self._command(Barrier())

    async def _command(self, command: Command) -> None:
        done: Future[None] = Future()
        with self._lock:
            if self._stopped:  # nobody will read the inbox again: the command is moot
                return
            self._post(command, done)
        await asyncio.wrap_future(done)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread and any worker processes; unfinished requests end with finish_reason "abort"."""
        self._closed = True
        self._post(Stop())
        self._thread.join(timeout)
        # Also after a join that timed out: a thread stuck in a collective is freed when the workers exit.
        self.engine.shutdown()

    # -- engine thread ----------------------------------------------------------------------------

    def _post(self, command: Command, done: Future[None] | None = None) -> None:
        self._inbox.put(Posted(command, done))

    def _drain_inbox(self, block: bool) -> None:
        while True:
            try:
                posted = self._inbox.get(block=block)
            except queue.Empty:
                return
            if block:  # the engine was idle: restart the progress clock so /health sees no stall
                self.engine.counters.last_step_time = time.time()
            block = False
            self._run(posted.command)
            self._publish()
            if posted.done is not None:
                posted.done.set_result(None)

    def _run(self, command: Command) -> None:
        match command:
            case CheckHealth():
                self.engine.check_health()  # raises if a worker died: the loop ends as a failure
            case Add(request=req):
                self._adds_taken += 1
                try:
                    self.engine.add(req)
                except ValueError as e:  # one bad request must not take the engine down
                    self._deliver(req.request_id, e)
            case Abort(request_id=rid):
                for out in self.engine.abort([rid]):
                    self._deliver(out.request_id, out)
            case Stop():
                for out in self.engine.abort(self.engine.unfinished_ids()):
                    self._deliver(out.request_id, out)
                self._stopped = True
            case Barrier():
                pass

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        """Hand an output (or error) to the request's consumer; its last item releases the id."""
        last = not isinstance(item, RequestOutput) or item.finished
        channel = self._streams.pop(request_id, None) if last else self._streams.get(request_id)
        if channel is None or channel.closed:
            return
        try:
            channel.loop.call_soon_threadsafe(channel.queue.put_nowait, item)
        except RuntimeError:  # the consumer's event loop is closed: it is gone, free its request
            channel.closed = True
            if not last:
                self._post(Abort(request_id))

    def _build_and_loop(self, config: EngineConfig, built: Future[LLMEngine]) -> None:
        try:
            self.engine = LLMEngine(config)
        except BaseException as e:  # the caller re-raises it; nothing was started
            self._stopped = True
            built.set_exception(e)
            return
        built.set_result(self.engine)
        self._loop()

    def _loop(self) -> None:
        failure: BaseException | None = None
        try:
            while not self._stopped:
                self._drain_inbox(block=not self.engine.has_unfinished())
                if self._stopped or not self.engine.has_unfinished():
                    continue
                outs = self.engine.step()
                self._publish()  # before the outputs: a client that has its answer is no longer counted
                for out in outs:
                    if out.request_id in self._streams:
                        self._deliver(out.request_id, out)
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
        for rid, channel in streams:
            self._streams[rid] = channel  # _deliver pops it again
            self._deliver(rid, dead)
        while True:  # resolve commands nobody will run, so no caller of abort()/barrier() hangs
            try:
                posted = self._inbox.get_nowait()
            except queue.Empty:
                break
            if posted.done is not None:
                posted.done.set_result(None)
