"""A small streaming OpenAI client for the fleet tests: each request's fate (done, cut with an error event, refused,
failed) as the client saw it, bounded in time, sent with a fixed concurrency to one URL or round-robin to several."""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Outcome:
    """One request as the client saw it."""

    status: int = 0  # HTTP status; 0 when the connection failed before any answer
    fate: str = "failed"  # done (saw [DONE]), error-event (the stream ended with an error event), http, failed
    started: float = 0.0  # monotonic send time
    first_byte_s: float | None = None
    text: str = ""
    route: str = ""  # the router's x-kvfleet-route header
    detail: str = ""


@dataclass
class Run:
    """Every request's outcome, in the order the requests were defined."""

    outcomes: list[Outcome] = field(default_factory=list)

    def count(self, fate: str) -> int:
        return sum(1 for o in self.outcomes if o.fate == fate)


def stream(url: str, body: dict[str, Any], timeout: float) -> Outcome:
    """POST a streamed completion to url (http://host:port/v1/...) and read it to its end or the timeout."""
    parts = urllib.parse.urlsplit(url)
    out = Outcome(started=time.monotonic())
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=timeout)
    try:
        conn.request("POST", parts.path, json.dumps({**body, "stream": True}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        out.status, out.route = resp.status, resp.getheader("x-kvfleet-route") or ""
        if resp.status != 200:
            out.fate, out.detail = "http", resp.read().decode(errors="replace")[:300]
            return out
        for raw in resp:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:"):
                continue
            if out.first_byte_s is None:
                out.first_byte_s = time.monotonic() - out.started
            data = line[5:].strip()
            if data == "[DONE]":
                out.fate = "done"
                return out
            event = json.loads(data)
            if "error" in event:
                out.fate, out.detail = "error-event", json.dumps(event["error"])[:300]
                return out
            out.text += "".join(c.get("text") or c.get("delta", {}).get("content") or ""
                                for c in event.get("choices", []))
        out.detail = "the stream ended without [DONE] or an error event"
    except (OSError, http.client.HTTPException, ValueError) as exc:
        out.detail = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    return out


def run(urls: Sequence[str], bodies: Sequence[dict[str, Any]], concurrency: int, timeout: float,
        on_sent: Callable[[int], None] | None = None) -> Run:
    """Send bodies in order with `concurrency` in flight; request i goes to urls[i % len(urls)] (round-robin)."""
    result = Run([Outcome() for _ in bodies])
    lock = threading.Lock()
    next_index = [0]

    def worker() -> None:
        while True:
            with lock:
                i = next_index[0]
                next_index[0] += 1
            if i >= len(bodies):
                return
            if on_sent is not None:
                on_sent(i)
            result.outcomes[i] = stream(urls[i % len(urls)], bodies[i], timeout)

    with ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(worker) for _ in range(concurrency)]:
            f.result()
    return result
