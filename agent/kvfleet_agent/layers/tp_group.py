"""TPGroup: one rank's place in the tensor-parallel group and the two collectives the layers need."""

from __future__ import annotations

import datetime
from typing import Protocol, cast

import torch

# The c10d classes themselves, not torch.distributed's process-global API (see TPGroup).
from torch._C._distributed_c10d import ProcessGroupGloo, ProcessGroupNCCL, Store, TCPStore, Work

# A collective waits at most this long for its peers. Ranks enter collectives only inside a step
# (idle workers block on their pipe instead), so this bounds how long a stuck peer can stall a
# step, never how long the engine may sit idle. A dead peer is noticed far sooner: its sockets close.
COLLECTIVE_TIMEOUT_S = 120.0
LOOPBACK = "127.0.0.1"  # the ranks of one replica share a host (one pod); nothing listens beyond it


class _Collectives(Protocol):
    """The two backend calls used here (present on every c10d backend; the stubs list them on ProcessGroup only)."""

    def allreduce(self, tensors: list[torch.Tensor]) -> Work: ...

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor]) -> Work: ...


class TPGroup:
    """Rank and size, plus all-reduce and all-gather over the group (no-ops for a single rank).

    Layers hold a reference to their group instead of using torch.distributed's process-global
    default group, so an engine's collectives are explicit and two engines in one process (tests)
    cannot step on each other.
    """

    def __init__(self, rank: int = 0, size: int = 1) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"tensor-parallel rank {rank} is outside a group of {size}")
        self.rank, self.size = rank, size
        self._pg: _Collectives | None = None

    def connect(self, store: Store, device: torch.device, timeout_s: float) -> None:
        """Join the group's communicator (blocks until every rank has joined): NCCL on GPU, gloo on CPU."""
        timeout = datetime.timedelta(seconds=timeout_s)
        if device.type == "cuda":
            opts = ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self._pg = cast(_Collectives, ProcessGroupNCCL(store, self.rank, self.size, opts))
            return
        # Gloo's own options type (the stubs know only the generic one): bound to loopback, so no
        # hostname lookup or network interface is needed inside a pod or sandbox.
        gloo = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        gloo._devices = [ProcessGroupGloo.create_device(hostname=LOOPBACK)]
        gloo._timeout = timeout
        self._pg = cast(_Collectives, ProcessGroupGloo(store, self.rank, self.size, gloo))

    def close(self) -> None:
        """Drop the communicator (peers still inside a collective with us get an error, not a hang)."""
        self._pg = None

    def _backend(self) -> _Collectives:
        if self._pg is None:
            raise RuntimeError(f"tensor-parallel rank {self.rank} of {self.size} ran a collective before "
                               "connect()")
        return self._pg

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the group, in place; returns x."""
        if self.size > 1:
            self._backend().allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's x (same shape on every rank), in rank order."""
        if self.size == 1:
            return [x]
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._backend().allgather([parts], [x.contiguous()]).wait()
        return parts


def start_store(world_size: int, timeout_s: float) -> TCPStore:
    """The rendezvous store, served by rank 0 on a loopback port the OS picks (no fixed port, no race)."""
    return TCPStore(LOOPBACK, 0, world_size, True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def join_store(port: int, world_size: int, timeout_s: float) -> TCPStore:
    """A worker's client of rank 0's store."""
    return TCPStore(LOOPBACK, port, world_size, False, timeout=datetime.timedelta(seconds=timeout_s))
