"""A logging filter against floods: a few lines per message and per logger in each window, then a count."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Window:
    start: float
    sent: int = 0
    dropped: int = 0  # since the last line this key let through


class RateLimitFilter(logging.Filter):
    """Lets through `burst` records per message template, and `per_logger` per logger, every `window_s` seconds.

    The first record let through after some of its kind were dropped says how many: "(1234
    similar lines suppressed)". A template is the logger, level and format string, so one noisy
    message cannot silence a different one; the number of templates remembered is bounded.
    """

    def __init__(self, burst: int = 5, per_logger: int = 50, window_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, max_keys: int = 1024) -> None:
        super().__init__()
        self.burst, self.per_logger, self.window_s = burst, per_logger, window_s
        self.clock, self.max_keys = clock, max_keys
        self._windows: OrderedDict[tuple[object, ...], _Window] = OrderedDict()

    def filter(self, record: logging.LogRecord) -> bool:
        """Whether to emit `record`; one emitted after drops gains a note of how many."""
        now = self.clock()
        template = self._window((record.name, record.levelno, str(record.msg)), now)
        per_logger = self._window((record.name,), now)
        if template.sent >= self.burst or per_logger.sent >= self.per_logger:
            template.dropped += 1
            return False
        template.sent += 1
        per_logger.sent += 1
        if template.dropped:
            record.msg = f"{record.msg} ({template.dropped} similar lines suppressed)"
            template.dropped = 0
        return True

    def _window(self, key: tuple[object, ...], now: float) -> _Window:
        window = self._windows.get(key)
        if window is None:
            window = self._windows[key] = _Window(now)
            if len(self._windows) > self.max_keys:
                self._windows.popitem(last=False)
        elif now - window.start >= self.window_s:
            window.start, window.sent = now, 0
        self._windows.move_to_end(key)
        return window


def install(logger: logging.Logger | None = None) -> None:
    """Put a RateLimitFilter on every handler of `logger` (the root logger by default).

    On handlers, not on the logger: a logger's own filters never see records from its children.
    One filter a handler, since a record passes each handler's filters once.
    """
    for handler in (logger or logging.getLogger()).handlers:
        if not any(isinstance(f, RateLimitFilter) for f in handler.filters):
            handler.addFilter(RateLimitFilter())
