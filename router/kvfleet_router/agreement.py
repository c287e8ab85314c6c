"""Pure: the quality measure, how far a lower tier's answer agrees with the top tier's (ROUGE-L F1 over words).

The monitor replays a sample of lower-tier requests on the top tier and scores each pair here; answers come as
the OpenAI responses the agents send, whole JSON bodies or server-sent-event streams, and `answer_text` reads
the answer of choice 0 out of either.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

MAX_WORDS = 2048  # of each answer compared: bounds one score's work (see agreement)
_WORD = re.compile(r"\w+|[^\w\s]")


def _choice0(obj: Any) -> Mapping[str, Any] | None:
    """Choice 0 of a response or stream chunk: the one whose index is 0 (n > 1 streams interleave choices)."""
    if not isinstance(obj, Mapping) or "error" in obj:
        return None
    choices = obj.get("choices")
    if not isinstance(choices, list):
        return None
    for c in choices:
        if isinstance(c, Mapping) and c.get("index", 0) == 0:
            return c
    return None


def _calls_text(calls: list[tuple[str, str]]) -> str:
    return "\n".join(f"{name}({arguments})" for name, arguments in calls)


def _join(content: str, calls: list[tuple[str, str]]) -> str:
    # Tool calls read as name(arguments), after any content: the same text whether the answer came whole or
    # streamed, so a streamed and a whole answer of the same tokens score alike.
    return "\n".join(p for p in (content, _calls_text(calls)) if p)


def _json_answer(body: bytes) -> str | None:
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(obj, Mapping) or not isinstance(obj.get("choices"), list):
        return None
    choice = _choice0(obj)
    if choice is None:
        return None
    if isinstance(choice.get("text"), str):  # completions
        return str(choice["text"])
    message = choice.get("message")
    if not isinstance(message, Mapping):
        return None
    content = message.get("content")
    calls: list[tuple[str, str]] = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(fn, Mapping):
            calls.append((str(fn.get("name") or ""), str(fn.get("arguments") or "")))
    return _join(content if isinstance(content, str) else "", calls)


def _sse_answer(body: bytes) -> str | None:
    try:
        text = body.decode()
    except UnicodeDecodeError:
        return None
    parts: list[str] = []
    calls: dict[int, list[str]] = {}  # tool call index → [name, arguments], each the concatenation of its deltas
    seen = done = False
    for line in text.splitlines():
        if not line.startswith("data:"):
            continue  # blank separators, comments, event: and id: lines
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        try:
            chunk = json.loads(data)
        except ValueError:
            return None
        if not isinstance(chunk, Mapping) or "error" in chunk:
            return None  # the stream failed part-way: no whole answer to judge
        choice = _choice0(chunk)
        if choice is None:
            continue  # another choice's chunk, or the usage chunk (no choices)
        seen = True
        if isinstance(choice.get("text"), str):
            parts.append(choice["text"])
            continue
        delta = choice.get("delta")
        if not isinstance(delta, Mapping):
            continue
        if isinstance(delta.get("content"), str):
            parts.append(delta["content"])
        for call in delta.get("tool_calls") or []:
            if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
                continue
            index = call.get("index", 0)
            acc = calls.setdefault(index if isinstance(index, int) else 0, ["", ""])
            name, arguments = call["function"].get("name"), call["function"].get("arguments")
            acc[0] += name if isinstance(name, str) else ""
            acc[1] += arguments if isinstance(arguments, str) else ""
    # A stream cut short (no [DONE]) holds part of an answer: judging it would count the cut as disagreement.
    if not (seen and done):
        return None
    return _join("".join(parts), [(calls[i][0], calls[i][1]) for i in sorted(calls)])


def answer_text(body: bytes, content_type: str) -> str | None:
    """The answer of choice 0 in a completions or chat completions response, a JSON body or an event stream
    (text/event-stream); chat tool calls read as `name(arguments)`, one a line after the content. None for
    anything else: an error object, invalid JSON, no choices, a stream cut short or failed part-way."""
    media = content_type.split(";", 1)[0].strip().lower()
    return _sse_answer(body) if media == "text/event-stream" else _json_answer(body)


def words(text: str) -> list[str]:
    """The tokens compared: lowercased runs of word characters, and each punctuation character on its own."""
    return _WORD.findall(text.lower())


def _lcs(a: list[str], b: list[str]) -> int:
    """The length of the longest common subsequence of a and b.

    The O(len(a) × len(b)) dynamic programme, one row of it at a time as the bits of an integer (Allison-Dix,
    Hyyrö's form): bit j of `row` is set where the DP row does not step up at column j, and each word of `a`
    updates the whole row in a few integer operations. The same table, but fast enough in Python that the
    2048-word cap keeps a score to milliseconds.
    """
    if not a or not b:
        return 0
    where: dict[str, int] = {}  # word → the bits of its positions in b
    for j, w in enumerate(b):
        where[w] = where.get(w, 0) | (1 << j)
    mask = (1 << len(b)) - 1
    row = mask
    for w in a:
        u = row & where.get(w, 0)
        row = ((row + u) | (row - u)) & mask
    return len(b) - row.bit_count()


def agreement(candidate: str, reference: str) -> float:
    """How far `candidate` agrees with `reference`, in [0, 1]: 1.0 identical (as words), 0.0 nothing in common.

    ROUGE-L F1 over `words`: with L the longest common subsequence of the two word lists, precision L/|candidate|
    and recall L/|reference|, and their harmonic mean 2L / (|candidate| + |reference|). ROUGE-L because it is
    order-aware (the same words shuffled score lower), tolerant of small edits (a changed word costs only that
    word, not the alignment of the rest), and needs no model: a score costs the router no GPU and no request.
    Both empty: 1.0; exactly one empty: 0.0.

    Each side is cut to its first 2048 words (MAX_WORDS) so that one long answer cannot stall the event loop; a
    longer pair is judged on its beginnings.
    """
    c, r = words(candidate)[:MAX_WORDS], words(reference)[:MAX_WORDS]
    if not c and not r:
        return 1.0
    if not c or not r:
        return 0.0
    # A shared head and tail are common subsequence as they stand: only the differing middle needs the table.
    head = 0
    while head < min(len(c), len(r)) and c[head] == r[head]:
        head += 1
    tail = 0
    while tail < min(len(c), len(r)) - head and c[-1 - tail] == r[-1 - tail]:
        tail += 1
    common = head + tail + _lcs(c[head:len(c) - tail], r[head:len(r) - tail])
    return 2 * common / (len(c) + len(r))
