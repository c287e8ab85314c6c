"""The rate-limiting log filter: a burst per message, a cap per logger, windows, and a count of what was dropped."""

from __future__ import annotations

import logging

from kvfleet_agent.server import log_limit
from kvfleet_agent.server.log_limit import RateLimitFilter


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _record(msg: str, name: str = "agent", level: int = logging.WARNING, *args: object) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, args, None)


def test_a_burst_per_message_then_silence_then_a_count() -> None:
    clock = Clock()
    flt = RateLimitFilter(burst=3, per_logger=100, window_s=10.0, clock=clock)
    passed = [flt.filter(_record("refused %d", "agent", logging.WARNING, i)) for i in range(1000)]
    assert passed[:3] == [True] * 3 and not any(passed[3:])
    assert flt.filter(_record("another message"))  # a different template has its own burst
    clock.now = 10.0
    late = _record("refused %d", "agent", logging.WARNING, 1000)
    assert flt.filter(late)
    assert late.getMessage() == "refused 1000 (997 similar lines suppressed)"
    assert flt.filter(_record("refused %d", "agent", logging.WARNING, 1001))


def test_a_logger_emitting_ever_new_messages_is_capped_too() -> None:
    flt = RateLimitFilter(burst=5, per_logger=20, window_s=10.0, clock=Clock())
    passed = sum(flt.filter(_record(f"unique message {i}", "noisy")) for i in range(500))
    assert passed == 20
    assert flt.filter(_record("from elsewhere", "quiet"))


def test_the_templates_remembered_are_bounded() -> None:
    flt = RateLimitFilter(burst=1, per_logger=10**9, window_s=10.0, clock=Clock(), max_keys=50)
    for i in range(10_000):
        flt.filter(_record(f"message {i}"))
    assert len(flt._windows) <= 51


def test_install_puts_one_filter_on_each_handler() -> None:
    logger = logging.getLogger("kvfleet-test-log-limit")
    handlers = [logging.NullHandler(), logging.NullHandler()]
    for h in handlers:
        logger.addHandler(h)
    try:
        log_limit.install(logger)
        log_limit.install(logger)  # idempotent
        assert all(sum(isinstance(f, RateLimitFilter) for f in h.filters) == 1 for h in handlers)
    finally:
        for h in handlers:
            logger.removeHandler(h)
