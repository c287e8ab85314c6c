"""Requests for a model with no ready replica wait here, bounded and FIFO per model, until one is ready or time ends."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field


class HoldRefused(Exception):
    """The request could not be held (queue full) or waited past its timeout: answer 503 with Retry-After."""

    def __init__(self, reason: str, retry_after_s: float) -> None:
        super().__init__(reason)
        self.reason, self.retry_after_s = reason, retry_after_s


@dataclass
class _Model:
    waiters: deque[asyncio.Future[None]] = field(default_factory=deque)


class HoldQueue:
    """Per model: at most max_size requests wait, each at most timeout_s, released oldest first.

    The number held per model is the demand the operator reads to scale up from zero.
    """

    def __init__(self, max_size: int, timeout_s: float) -> None:
        if max_size < 0 or timeout_s <= 0:
            raise ValueError(f"hold queue: max_size={max_size} must be >= 0 and timeout_s={timeout_s} > 0")
        self.max_size, self.timeout_s = max_size, timeout_s
        self._models: dict[str, _Model] = {}

    def held(self, model: str) -> int:
        """Requests waiting for the model now."""
        m = self._models.get(model)
        return len(m.waiters) if m else 0

    def models(self) -> list[str]:
        """Models with requests waiting."""
        return [name for name, m in self._models.items() if m.waiters]

    async def wait(self, model: str) -> None:
        """Wait for release(model); raises HoldRefused when the queue is full or the timeout passes."""
        m = self._models.setdefault(model, _Model())
        if len(m.waiters) >= self.max_size:
            raise HoldRefused(f"{len(m.waiters)} requests already wait for model {model!r} (hold queue full)",
                              self.timeout_s)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        m.waiters.append(fut)
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.timeout_s)
        except TimeoutError:
            raise HoldRefused(f"no replica of model {model!r} became ready within {self.timeout_s:g}s",
                              self.timeout_s) from None
        finally:
            if fut in m.waiters:  # timed out or cancelled (the client left): give up the place
                m.waiters.remove(fut)

    def release(self, model: str, n: int | None = None) -> int:
        """Wake the n oldest waiters of a model (all when n is None); returns how many were woken."""
        m = self._models.get(model)
        woken = 0
        while m and m.waiters and (n is None or woken < n):
            fut = m.waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                woken += 1
        return woken
