"""The engine thread's inbox: one small dataclass a command, posted by callers and run in order by the engine thread."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from kvfleet_agent.core.request import Request


@dataclass(frozen=True, slots=True)
class Add:
    """Queue a request (validated by make_request on the caller's thread)."""

    request: Request


@dataclass(frozen=True, slots=True)
class Abort:
    """End a request wherever it is and free its KV blocks."""

    request_id: str


@dataclass(frozen=True, slots=True)
class Stop:
    """Abort every unfinished request and end the engine thread."""


@dataclass(frozen=True, slots=True)
class CheckHealth:
    """Raise on the engine thread if a tensor-parallel worker died, so the loop ends as a failure."""


@dataclass(frozen=True, slots=True)
class Barrier:
    """Nothing: its completion tells the caller that every command posted before it has run."""


Command = Add | Abort | Stop | CheckHealth | Barrier


@dataclass(frozen=True, slots=True)
class Posted:
    """A command in the inbox, with the future its caller waits on (None: nobody waits)."""

    command: Command
    done: Future[None] | None = None
