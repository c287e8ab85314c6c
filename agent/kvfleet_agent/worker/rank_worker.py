"""The process of one tensor-parallel rank other than 0: load its shard, then run every step rank 0 sends."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, NoReturn

from kvfleet_agent.config import EngineConfig
from kvfleet_agent.layers.tp_group import TPGroup, join_store
from kvfleet_agent.models.config import ModelConfig
from kvfleet_agent.worker.model_runner import ModelRunner

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a rank needs to start (pickled to the spawned process)."""

    config: EngineConfig
    model_cfg: ModelConfig
    max_model_len: int
    rank: int
    size: int
    store_port: int
    store_timeout_s: float
    collective_timeout_s: float
    log_level: int


def rank_stats(runner: ModelRunner) -> dict[str, Any]:
    """What a rank reports about itself: its pid, device, parameter and checkpoint bytes, KV shapes."""
    return {"rank": runner.tp.rank, "pid": os.getpid(), "device": str(runner.device),
            "param_bytes": runner.param_bytes(), "loaded_bytes": runner.loaded_bytes,
            "kv_shapes": runner.kv_shapes(), "num_blocks": runner.num_blocks}


def _error_text(e: BaseException) -> str:
    """The exception as the parent shows it: type and message, then the worker's traceback."""
    return f"{type(e).__name__}: {e}\n" + "".join(traceback.format_exception(e))


def _fail(conn: Connection, e: BaseException) -> NoReturn:
    """Tell rank 0 why this rank is going away, then exit non-zero (the pipe may already be gone)."""
    log.error("rank failed: %s", e)
    with contextlib.suppress(OSError):
        conn.send(("error", _error_text(e)))
    sys.exit(1)


def _exit_now(code: int) -> NoReturn:
    """Exit at once, skipping the interpreter's teardown (only the logs need flushing).

    The teardown would free a large model tensor by tensor, delaying the pod's shutdown by seconds
    for nothing: the process's memory goes back to the system in one piece anyway.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_worker(spec: WorkerSpec, conn: Connection) -> None:
    """Entry point of a worker process (a multiprocessing "spawn" target).

    Protocol, all on the one pipe to rank 0: the worker sends ("loaded", stats) or ("error", text);
    then it obeys ("connect",), ("call", name, args) (both answered with ("ok", result) or
    ("error", text)), ("step", StepBatch) (not answered: the collectives inside keep the ranks in
    step) and ("stop",). End of file on the pipe means rank 0 is gone, so the worker exits too.
    """
    # Ctrl-C in a terminal reaches the whole process group; rank 0 leads the shutdown, we follow.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=spec.log_level,
                        format=f"%(asctime)s %(levelname)s %(name)s[rank {spec.rank}]: %(message)s")
    tp = TPGroup(spec.rank, spec.size)
    try:
        runner = ModelRunner(spec.config, spec.model_cfg, spec.max_model_len, tp)
        conn.send(("loaded", rank_stats(runner)))
    except BaseException as e:
        _fail(conn, e)
    calls: dict[str, Callable[..., Any]] = {"kv_budget_bytes": runner.kv_budget_bytes,
                                           "allocate_kv_cache": runner.allocate_kv_cache,
                                           "stats": lambda: rank_stats(runner)}
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # rank 0 exited or was killed: nobody will send another step
            log.info("rank 0 is gone; exiting")
            return
        try:
            if msg[0] == "step":
                runner.forward(msg[1])
            elif msg[0] == "connect":
                tp.connect(join_store(spec.store_port, spec.size, spec.store_timeout_s), runner.device,
                           spec.collective_timeout_s)
                conn.send(("ok", None))
            elif msg[0] == "call":
                conn.send(("ok", calls[msg[1]](*msg[2])))
            elif msg[0] == "stop":
                tp.close()
                _exit_now(0)
            else:
                raise ValueError(f"unknown command {msg[0]!r} from rank 0")
        except Exception as e:  # a failed step or call: report it and leave (the group is broken anyway)
            _fail(conn, e)
