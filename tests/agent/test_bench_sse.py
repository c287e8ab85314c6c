"""Tests of the load generator's SSE parsing and the timing and token accounting of a stream."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from loadgen_helpers import chunk

from kvfleet_agent.bench.sse import SSEEvent, SSEParser, StreamState


def _events(parser: SSEParser, *chunks: bytes) -> list[SSEEvent]:
    out: list[SSEEvent] = []
    for c in chunks:
        out += parser.feed(c)
    return out + parser.close()


def test_sse_comments_multiline_done_and_line_endings() -> None:
    stream = (b": keep-alive\n\n"
              b"data: {\"a\": 1}\n\n"
              b":ping\r\n"
              b"data: line one\r\ndata:line two\r\n\r\n"
              b"event: usage\rdata: x\r\r"
              b"id: 7\nretry: 10\nunknown: field\ndata\n\n"
              b"data: [DONE]\n\n")
    want = [SSEEvent('{"a": 1}'), SSEEvent("line one\nline two"), SSEEvent("x", "usage"), SSEEvent(""),
            SSEEvent("[DONE]")]
    assert _events(SSEParser(), stream) == want


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=200), max_size=12))
def test_sse_events_do_not_depend_on_how_the_bytes_are_split(cuts: list[int]) -> None:
    stream = ("data: {\"text\": \"café 🙂\"}\r\n\r\n: keep-alive\r\n\r\ndata: a\r\ndata: b\r\n\r\n"
              "data: [DONE]\r\n\r\n").encode()
    bounds = sorted({min(c, len(stream)) for c in cuts} | {0, len(stream)})
    pieces = [stream[a:b] for a, b in itertools.pairwise(bounds)]
    assert _events(SSEParser(), *pieces) == [SSEEvent('{"text": "café 🙂"}'), SSEEvent("a\nb"), SSEEvent("[DONE]")]


def test_sse_close_keeps_a_last_event_without_its_blank_line() -> None:
    p = SSEParser()
    assert p.feed(b"data: tail") == []
    assert p.close() == [SSEEvent("tail")]
    p = SSEParser()
    assert p.feed(b"data: cr\r") == []  # the CR may be half of a CRLF: not a line end yet
    assert p.close() == [SSEEvent("cr")]


def test_stream_state_ttft_itl_and_counted_tokens() -> None:
    s = StreamState(start=100.0)
    s.on_data(chunk(""), 100.5)  # empty text (e.g. a role chunk): not the first token
    s.on_data(chunk("a"), 101.0)
    s.on_data(chunk("b"), 102.0)
    s.on_data(chunk("c", "length"), 104.0)
    assert s.ttft_s == 1.0 and s.itl_s == [1.0, 2.0]
    assert s.output_tokens == 3 and s.usage_tokens is None and s.complete and not s.done
    s.on_data(json.dumps({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}}), 104.1)
    s.on_data("[DONE]", 104.2)
    assert s.output_tokens == 4 and s.prompt_tokens == 9 and s.done  # the server's count wins
    assert s.itl_s == [1.0, 2.0]


def test_stream_state_spreads_multi_token_chunks_as_the_server_reports() -> None:
    s = StreamState(start=0.0)

    def u(n: int) -> dict[str, int]:
        return {"prompt_tokens": 5, "completion_tokens": n}

    s.on_data(chunk("a", usage=u(2)), 1.0)  # two tokens in the first chunk: TTFT, no gap
    s.on_data(chunk("bcd", usage=u(5)), 1.3)  # three tokens over 0.3 s
    s.on_data(chunk("", usage=u(6)), 1.4)  # a held-back token (no text yet)...
    s.on_data(chunk("ef", "stop", usage=u(7)), 1.5)  # ...arrives with the next: two tokens over 0.2 s
    assert s.ttft_s == 1.0
    assert s.itl_s == pytest.approx([0.1] * 3 + [0.1] * 2)
    assert s.output_tokens == 7 and s.counted_tokens == 7


def test_stream_state_usage_only_at_the_end_is_not_taken_as_per_chunk() -> None:
    s = StreamState(start=0.0)
    s.on_data(chunk("a"), 1.0)
    s.on_data(chunk("b", "length", usage={"prompt_tokens": 1, "completion_tokens": 2}), 2.0)
    assert s.itl_s == [1.0] and s.output_tokens == 2


def test_stream_state_errors() -> None:
    s = StreamState(start=0.0)
    s.on_data(json.dumps({"error": {"message": "engine failed", "type": "server_error"}}), 1.0)
    assert s.error == "engine failed"
    s = StreamState(start=0.0)
    s.on_data("{not json", 1.0)
    assert s.error is not None and "bad SSE data" in s.error
