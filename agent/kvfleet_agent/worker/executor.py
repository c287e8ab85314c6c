"""Executor: runs the model on tensor_parallel_size ranks (rank 0 in this process), and supervises the workers.

Rank 0 is the engine's own process, as in vLLM's multiprocessing executor with a driver worker:
the scheduler's output never leaves the process, rank 0 samples from the gathered logits with no
extra hop, and with one rank nothing is spawned at all. Ranks 1..N-1 are spawned processes that
get each step's batch (plain numpy data, pickled once) over a pipe. Pipes rather than a broadcast
collective: an idle worker waits on its pipe as long as the engine idles with no timeout to trip,
and end of file tells it that rank 0 is gone. Collectives (with timeouts) run only inside steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import pickle
import signal
import threading
import time
import weakref
from collections.abc import Callable
from multiprocessing import connection, get_context
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from kvfleet_agent.config import EngineConfig
from kvfleet_agent.core.scheduler_output import SchedulerOutput
from kvfleet_agent.layers import tp_group
from kvfleet_agent.layers.tp_group import TPGroup, start_store
from kvfleet_agent.models.config import ModelConfig
from kvfleet_agent.worker.cpu_budget import usable_cpus
from kvfleet_agent.worker.device import rank_device
from kvfleet_agent.worker.model_runner import ModelRunner
from kvfleet_agent.worker.rank_worker import WorkerSpec, rank_stats, run_worker
from kvfleet_agent.worker.sampler import StepResult
from kvfleet_agent.worker.step_batch import StepBatch, plan_batch, warmup_steps

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 900.0  # loading a large checkpoint from a slow volume takes minutes
CALL_TIMEOUT_S = 120.0
STOP_GRACE_S = 5.0  # a worker asked to stop gets this long before SIGTERM, then SIGKILL


class RankError(RuntimeError):
    """A tensor-parallel rank failed or died; the message names the rank and carries its error."""


@dataclasses.dataclass(eq=False)
class _Worker:
    rank: int
    proc: BaseProcess
    conn: connection.Connection

    def describe_exit(self) -> str:
        """How the (exited) worker ended, for messages."""
        # Its pipes close before it can be reaped, so whoever saw them close may be a moment early.
        self.proc.join(2.0)
        code = self.proc.exitcode
        if code is not None and code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"


def _stop_workers(workers: list[_Worker], closing: threading.Event, lock: threading.Lock,
                  grace_s: float = STOP_GRACE_S, restore_threads: int | None = None) -> None:
    """Ask every worker to stop, then terminate and kill the laggards (idempotent; holds no executor reference)."""
    if restore_threads is not None:  # rank 0 shared the cores with its workers: give them all back
        torch.set_num_threads(restore_threads)
    closing.set()
    with lock:
        for w in workers:
            with contextlib.suppress(OSError):  # already gone
                w.conn.send(("stop",))
    deadline = time.monotonic() + grace_s
    for w in workers:
        w.proc.join(max(0.0, deadline - time.monotonic()))
    for w in workers:
        if w.proc.is_alive():
            w.proc.terminate()
            w.proc.join(2.0)
        if w.proc.is_alive():
            w.proc.kill()
            w.proc.join()
        w.conn.close()


class Executor:
    """Rank 0's runner plus the worker processes of the other ranks; every call reaches every rank.

    Not thread-safe: calls come from the engine's thread. Only `failure`, `worker_pids` and
    `shutdown` may be used from elsewhere.
    """

    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, max_model_len: int) -> None:
        n = config.tensor_parallel_size
        self.size = n
        self.failure: str | None = None  # why a worker died, set by the supervisor thread
        self.workers: list[_Worker] = []
        self._listeners: list[Callable[[], None]] = []
        self._closing = threading.Event()
        self._send_lock = threading.Lock()
        threads_before = None
        if rank_device(config, 0).type == "cpu" and config.num_threads is None:
            # N ranks on one CPU share its cores (without this each would start one thread per core), and the
            # cores are the pod's CPU limit where it has one, not the node's (cpu_budget).
            per_rank = max(1, usable_cpus() // n)
            if n > 1 or per_rank < torch.get_num_threads():
                config = dataclasses.replace(config, num_threads=per_rank)
                threads_before = torch.get_num_threads()
        # Runs on shutdown(), when the executor is garbage collected, or at interpreter exit.
        self._finalizer = weakref.finalize(self, _stop_workers, self.workers, self._closing, self._send_lock,
                                           restore_threads=threads_before)
        try:
            store = None
            if n > 1:
                store = start_store(n, STARTUP_TIMEOUT_S)
                self._spawn(config, model_cfg, max_model_len, store.port, tp_group.COLLECTIVE_TIMEOUT_S)
            # Rank 0 loads its shard while the workers load theirs.
            self.runner = ModelRunner(config, model_cfg, max_model_len, TPGroup(0, n))
            if store is not None:
                self._gather("start-up", STARTUP_TIMEOUT_S)
                self._send(("connect",))
                self.runner.tp.connect(store, self.runner.device, tp_group.COLLECTIVE_TIMEOUT_S)
                self._gather("connect", CALL_TIMEOUT_S)
                # The thread holds no reference to the executor, so an engine dropped without
                # shutdown() is still collected (and its finalizer stops the workers).
                threading.Thread(target=_supervise, args=(list(self.workers), self._closing,
                                                          weakref.WeakMethod(self._on_death)),
                                 name="kvfleet-tp-supervisor", daemon=True).start()
                log.info("tensor parallel: %d ranks; workers %s", n,
                         ", ".join(f"rank {w.rank} pid {w.proc.pid}" for w in self.workers))
        except BaseException:
            # Workers still loading would read "stop" only when done: there is nothing to save, end them now.
            _stop_workers(self.workers, self._closing, self._send_lock, grace_s=0.0)
            self.shutdown()
            raise

    def _spawn(self, config: EngineConfig, model_cfg: ModelConfig, max_model_len: int, port: int,
               collective_timeout_s: float) -> None:
        # "spawn", not fork: a forked child would inherit this process's threads (the server's
        # event loop, torch's pools) in whatever state they were, and CUDA cannot be forked at all.
        ctx = get_context("spawn")
        level = logging.getLogger().getEffectiveLevel()
        for rank in range(1, self.size):
            spec = WorkerSpec(config, model_cfg, max_model_len, rank, self.size, port, STARTUP_TIMEOUT_S,
                              collective_timeout_s, level)
            parent, child = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=run_worker, args=(spec, child), name=f"kvfleet-tp-rank{rank}", daemon=True)
            proc.start()
            child.close()  # only the worker holds its end now, so its death reads as end of file here
            self.workers.append(_Worker(rank, proc, parent))

    # -- what the engine calls --------------------------------------------------------------------

    def worker_pids(self) -> list[int]:
        """Process ids of ranks 1..N-1 (empty with one rank)."""
        return [w.proc.pid for w in self.workers if w.proc.pid is not None]

    def on_failure(self, listener: Callable[[], None]) -> None:
        """Call listener (on the supervisor's thread) when a worker dies unexpectedly."""
        self._listeners.append(listener)

    def check(self) -> None:
        """Raise RankError if a worker has died."""
        if self.failure is not None:
            raise RankError(self.failure)

    def kv_budget_bytes(self) -> int:
        """The smallest KV budget of any rank: every rank must hold the same number of blocks."""
        # Sizing the pool is the first part of the kv_profile phase; allocating (zero-filling) it, the last.
        with self.runner.startup.phase("kv_profile", last=False):
            return min([self.runner.kv_budget_bytes(), *(int(b) for b in self._call("kv_budget_bytes"))])

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate num_blocks blocks (decided by rank 0) on every rank."""
        with self.runner.startup.phase("kv_profile"):
            self.runner.allocate_kv_cache(num_blocks)
            self._call("allocate_kv_cache", num_blocks)

    def rank_stats(self) -> list[dict[str, Any]]:
        """Every rank's report (rank_stats), rank 0 first."""
        return [rank_stats(self.runner), *self._call("stats")]

    def warmup(self) -> None:
        """The warm-up steps, on every rank."""
        with self.runner.startup.phase("warmup"):
            for step in warmup_steps(self.runner.block_size):
                self.execute(step)
                self.runner.forget(step.finished)  # execute forgot them before the step that made their state

    def execute(self, out: SchedulerOutput) -> StepResult:
        """One step on every rank: plan its batch, send it to the workers, run it here; rank 0 samples.

        The executor alone owns the step broadcast: the runner only runs the batch it is given.
        """
        self.check()
        self.runner.forget(out.finished)
        if not out.chunks:
            return {}, {}, {}, {}
        batch, samplers = plan_batch(out.chunks, self.runner.block_size, rows_within=self.runner.rows_within)
        if not self.workers:
            return self.runner.execute(batch, samplers, out.draft_k)
        try:
            self._publish(batch)  # before rank 0 runs it: the ranks run the same forward pass on their shards
            return self.runner.execute(batch, samplers, out.draft_k)
        except BaseException as e:
            # Whatever broke the step (a peer, a pipe, rank 0 itself, even Ctrl-C), the ranks may now
            # be at different collectives: running another step could pair them wrongly and return
            # garbage instead of failing. This executor is done.
            if not isinstance(e, RuntimeError | OSError):
                self.failure = self.failure or f"a tensor-parallel step was interrupted on rank 0 ({e!r})"
                raise
            self.failure = self.failure or self._explain(e)
            raise RankError(self.failure) from e

    def shutdown(self) -> None:
        """Stop every worker (asked, then terminated, then killed); safe to call more than once."""
        self._finalizer()
        runner: ModelRunner | None = getattr(self, "runner", None)
        if runner is not None:
            runner.tp.close()

    # -- plumbing ---------------------------------------------------------------------------------

    def _send(self, msg: tuple[Any, ...]) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)  # pickled once for all workers
        with self._send_lock:
            for w in self.workers:
                w.conn.send_bytes(data)

    def _publish(self, batch: StepBatch) -> None:
        """The step broadcast: every worker gets the batch rank 0 is about to run."""
        self._send(("step", batch))

    def _call(self, name: str, *args: Any) -> list[Any]:
        if not self.workers:
            return []
        self.check()
        self._send(("call", name, args))
        return self._gather(name, CALL_TIMEOUT_S)

    def _gather(self, what: str, timeout_s: float) -> list[Any]:
        """One answer from every worker, in rank order; a worker's error or death raises RankError."""
        pending = {w.conn: w for w in self.workers}
        replies: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                ranks = ", ".join(str(w.rank) for w in pending.values())
                raise RankError(f"tensor-parallel rank(s) {ranks} did not answer {what} within {timeout_s:.0f} s")
            sentinels = {w.proc.sentinel: w for w in pending.values()}
            ready = connection.wait([*pending, *sentinels], left)
            # Messages first: a worker that failed sent its reason just before exiting.
            for w in [pending[c] for c in ready if c in pending] + [sentinels[s] for s in ready if s in sentinels]:
                if w.conn not in pending:
                    continue
                if not w.conn.poll():
                    raise RankError(f"tensor-parallel rank {w.rank} (pid {w.proc.pid}) {w.describe_exit()} "
                                    f"during {what}")
                try:
                    kind, payload = w.conn.recv()
                except EOFError:
                    raise RankError(f"tensor-parallel rank {w.rank} (pid {w.proc.pid}) "
                                    f"{w.describe_exit()} during {what}") from None
                if kind == "error":
                    raise RankError(f"tensor-parallel rank {w.rank} (pid {w.proc.pid}) failed during {what}: "
                                    f"{payload}")
                replies[w.rank] = payload
                del pending[w.conn]
        return [replies[w.rank] for w in self.workers]

    def _explain(self, e: BaseException) -> str:
        """Why a step failed: the first worker error or death seen within a moment, else the local error."""
        conns = {w.conn: w for w in self.workers}
        connection.wait([*conns, *(w.proc.sentinel for w in self.workers)], 2.0)
        for w in self.workers:
            try:
                if w.conn.poll():
                    kind, payload = w.conn.recv()
                    if kind == "error":
                        return f"tensor-parallel rank {w.rank} (pid {w.proc.pid}) failed: {payload}"
            except (EOFError, OSError):  # its end closed: it is exiting, and describe_exit waits for that
                return f"tensor-parallel rank {w.rank} (pid {w.proc.pid}) {w.describe_exit()}"
        if self.failure is not None:
            return self.failure
        for w in self.workers:
            if not w.proc.is_alive():
                return f"tensor-parallel rank {w.rank} (pid {w.proc.pid}) {w.describe_exit()}"
        return f"tensor-parallel step failed on rank 0 (no worker died; one may be stuck): {e}"

    def _on_death(self, reason: str) -> None:
        self.failure = reason
        log.error("%s; this engine can no longer run steps", reason)
        for listener in self._listeners:
            listener()


def _supervise(workers: list[_Worker], closing: threading.Event,
               on_death: weakref.WeakMethod[Callable[[str], None]]) -> None:
    """Wait for any worker to exit; outside a shutdown that is a failure the engine must hear about."""
    ready = connection.wait([w.proc.sentinel for w in workers])
    if closing.is_set():
        return
    w = next(w for w in workers if w.proc.sentinel in ready)
    report = on_death()
    if report is not None:
        report(f"tensor-parallel rank {w.rank} (pid {w.proc.pid}) {w.describe_exit()}")
