"""Server-Sent Events parsing and the timing and token accounting of one streamed completion."""

from __future__ import annotations

import codecs
import json
import re
from dataclasses import dataclass, field

__all__ = ["SSEEvent", "SSEParser", "StreamState"]


@dataclass(frozen=True)
class SSEEvent:
    data: str
    event: str = "message"


_EOL = re.compile(r"\r\n|\r|\n")


class SSEParser:
    """Incremental Server-Sent Events parser: feed it bytes as they arrive, get the complete events.

    Follows the WHATWG rules a completion stream needs: CR, LF and CRLF line ends (even split across
    reads), comment lines (keep-alives), multi-line data joined with newlines, events ending at a blank
    line. The id and retry fields are ignored: a completion stream is never resumed.
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buf = ""
        self._data: list[str] = []
        self._event = ""

    def feed(self, chunk: bytes | str) -> list[SSEEvent]:
        self._buf += self._decoder.decode(chunk) if isinstance(chunk, bytes) else chunk
        events: list[SSEEvent] = []
        pos = 0
        while (m := _EOL.search(self._buf, pos)) is not None:
            if m.group() == "\r" and m.end() == len(self._buf):
                break  # may be the first half of a CRLF whose LF is in the next read
            ev = self._line(self._buf[pos:m.start()])
            pos = m.end()
            if ev is not None:
                events.append(ev)
        self._buf = self._buf[pos:]
        return events

    def close(self) -> list[SSEEvent]:
        """End of stream: what is left, including a last event without its blank line (a lenient reading)."""
        events = self.feed(self._decoder.decode(b"", final=True))
        if self._buf.endswith("\r"):
            self._buf = self._buf[:-1] + "\n"
            events += self.feed("")
        if self._buf:
            ev = self._line(self._buf)
            self._buf = ""
            if ev is not None:
                events.append(ev)
        if (ev := self._line("")) is not None:
            events.append(ev)
        return events

    def _line(self, line: str) -> SSEEvent | None:
        if not line:
            ev = SSEEvent("\n".join(self._data), self._event or "message") if self._data else None
            self._data, self._event = [], ""
            return ev
        if line.startswith(":"):
            return None
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        return None


@dataclass
class StreamState:
    """Timing and token accounting of one streamed completion, fed the data of each SSE event.

    Content chunks are those with non-empty text: the first one's arrival is the TTFT, and the gaps
    between successive ones are the inter-token latencies. When the server reports usage on every chunk
    (vLLM's continuous usage stats), a chunk that carries k tokens contributes k gaps of gap/k each, and
    tokens of chunks without text (held back by a detokenizer) are added to the next content chunk.
    """

    start: float
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    counted_tokens: int = 0
    usage_tokens: int | None = None
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    done: bool = False
    error: str | None = None
    last_time: float | None = None
    _continuous: bool | None = None  # usage on every chunk? decided by the first chunk that tells
    _cum_tokens: int = 0
    _pending_tokens: int = 0
    _last_content: float | None = None

    @property
    def output_tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else self.counted_tokens

    @property
    def complete(self) -> bool:
        return self.done or self.finish_reason is not None

    def on_data(self, data: str, now: float) -> None:
        self.last_time = now
        if data.strip() == "[DONE]":
            self.done = True
            return
        try:
            obj = json.loads(data)
        except json.JSONDecodeError:
            self.error = f"bad SSE data: {data[:200]!r}"
            return
        if not isinstance(obj, dict):
            self.error = f"bad SSE data: {data[:200]!r}"
            return
        if "error" in obj or obj.get("object") == "error":
            err = obj.get("error", obj)
            self.error = str(err.get("message", err) if isinstance(err, dict) else err)[:500]
            return
        choices = [c for c in obj.get("choices") or [] if isinstance(c, dict)]
        text = "".join(c["text"] for c in choices if isinstance(c.get("text"), str))
        for c in choices:
            if c.get("finish_reason") is not None:
                self.finish_reason = str(c["finish_reason"])
        delta = 0
        usage = obj.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.usage_tokens = usage["completion_tokens"]
            if isinstance(usage.get("prompt_tokens"), int):
                self.prompt_tokens = usage["prompt_tokens"]
            if choices and self._continuous is not False:
                self._continuous = True
                delta = self.usage_tokens - self._cum_tokens
                self._cum_tokens = self.usage_tokens
        if not text:
            if self._continuous:
                self._pending_tokens += delta
            return
        if self._continuous is None:
            # A content chunk without usage: the server reports usage at the end only, if at all.
            self._continuous = False
        k = max(self._pending_tokens + delta, 1) if self._continuous else 1
        self._pending_tokens = 0
        self.counted_tokens += k
        if self.ttft_s is None:
            self.ttft_s = now - self.start  # tokens beyond the first that came with it add no gap
        else:
            assert self._last_content is not None
            gap = (now - self._last_content) / k
            self.itl_s.extend([gap] * k)
        self._last_content = now
