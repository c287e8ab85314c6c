"""Pure: a request body's features (estimated prompt size, output limit, turns, markers) → its class, with a reason.

A request belongs to the first configured class whose every given limit holds; one no class takes is `unmatched`
and goes to the top tier. The optional classifier model is asked through an ordinary /v1/completions body built
here, its answer constrained to the class names; the caller falls back to the features when it fails or is slow.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvfleet_router.tier_config import UNMATCHED, Classifier, RequestClass

CHARS_PER_TOKEN = 4  # the estimate's rate: English text runs about 4 characters a token in common tokenizers
LABEL_TEXT_CHARS = 2000  # of the request shown to the classifier model: enough to judge, cheap to prefill
REASON_CHARS = 200  # a reason goes into headers and logs: one short phrase


@dataclass(frozen=True)
class Features:
    """What the classes' limits are checked against."""

    prompt_tokens: int  # estimated: characters / 4 rounded up (token-id prompts: their count)
    max_tokens: int | None  # the request's output limit; None when it states none
    turns: int  # user messages in a chat (at least 1); a completion is one turn
    markers: tuple[str, ...]  # the configured markers found in the lowercased text, in the configured order


@dataclass(frozen=True)
class Classification:
    """The class picked, the tier it names (before any promotion) and why, as one readable phrase."""

    name: str
    tier: int
    reason: str


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # a JSON true is no count


def _content(content: Any) -> list[str]:
    """A chat message's text: a string, or the text parts of a list of parts (images and the like carry none)."""
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [p["text"] for p in content
                if isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)]
    return []


def _prompt(prompt: Any) -> tuple[list[str], int]:
    """A completions prompt → (its texts, its token ids counted). Any shape the API takes, and none raises."""
    if isinstance(prompt, str):
        return [prompt], 0
    if not isinstance(prompt, list):
        return [], 0
    texts: list[str] = []
    ids = 0
    for item in prompt:
        if isinstance(item, str):
            texts.append(item)
        elif _is_int(item):
            ids += 1
        elif isinstance(item, list) and all(_is_int(t) for t in item):
            ids += len(item)
    return texts, ids


def _chat(messages: Any) -> tuple[list[tuple[str, str]], int]:
    """Chat messages → ((role, text) of each message with text, user turns)."""
    if not isinstance(messages, list):
        return [], 0
    out: list[tuple[str, str]] = []
    users = 0
    for m in messages:
        if not isinstance(m, Mapping):
            continue
        role = m.get("role") if isinstance(m.get("role"), str) else ""
        users += role == "user"
        out.extend((str(role), text) for text in _content(m.get("content")))
    return out, users


def _texts(body: Mapping[str, Any]) -> tuple[list[tuple[str, str]], int, int]:
    """A body's ((role, text) pieces, token ids counted, turns): chat when it has messages, else a completion."""
    if "messages" in body:
        pieces, users = _chat(body.get("messages"))
        return pieces, 0, max(1, users)
    texts, ids = _prompt(body.get("prompt"))
    return [("", t) for t in texts], ids, 1


def features(body: Mapping[str, Any], markers: Sequence[str]) -> Features:
    """A /v1/completions or /v1/chat/completions body → its features; a malformed shape counts as empty text."""
    pieces, ids, turns = _texts(body)
    chars = sum(len(t) for _, t in pieces)
    # Joined with newlines so that a marker never matches across two messages or prompts.
    text = "\n".join(t for _, t in pieces).lower()
    found = tuple(m for m in markers if m and m in text)
    # The newer name wins, as OpenAI's server reads them.
    limit = next((v for v in (body.get("max_completion_tokens"), body.get("max_tokens")) if _is_int(v)), None)
    return Features(prompt_tokens=math.ceil(chars / CHARS_PER_TOKEN) + ids,
                    max_tokens=None if limit is None else int(limit), turns=turns, markers=found)


def _checks(f: Features, c: RequestClass) -> list[tuple[bool, str]]:
    """Each limit the class gives: (whether it holds, the phrase saying so either way)."""
    out: list[tuple[bool, str]] = []
    if c.max_prompt_tokens is not None:
        ok = f.prompt_tokens <= c.max_prompt_tokens
        out.append((ok, f"prompt ~{f.prompt_tokens} tokens {'<=' if ok else '>'} {c.max_prompt_tokens}"))
    if c.max_output_tokens is not None:
        if f.max_tokens is None:
            out.append((True, "max_tokens unset"))
        else:
            ok = f.max_tokens <= c.max_output_tokens
            out.append((ok, f"max_tokens {f.max_tokens} {'<=' if ok else '>'} {c.max_output_tokens}"))
    if c.max_turns is not None:
        ok = f.turns <= c.max_turns
        out.append((ok, f"{f.turns} turn(s) {'<=' if ok else '>'} {c.max_turns}"))
    if c.markers is not None:
        said = f"marker {f.markers[0]!r}" if f.markers else "no marker"
        out.append((bool(f.markers) == c.markers, said))
    return out


def _short(reason: str) -> str:
    # "..." rather than an ellipsis character: reasons go into a header, which is ASCII.
    return reason if len(reason) <= REASON_CHARS else reason[:REASON_CHARS - 3] + "..."


def classify(f: Features, classifier: Classifier, top: int) -> Classification:
    """The first class (in order) whose every given limit holds; none → `unmatched`, served by `top`. The reason
    names the limits that held, or for `unmatched` the first limit each class failed."""
    failed: list[str] = []
    for c in classifier.classes:
        checks = _checks(f, c)
        misses = [said for ok, said in checks if not ok]
        if not misses:
            return Classification(c.name, c.tier, _short(f"{c.name}: " + (", ".join(said for _, said in checks)
                                                                          or "no limits")))
        failed.append(f"{misses[0]} ({c.name})")
    return Classification(UNMATCHED, top, _short(f"{UNMATCHED}: " + ", ".join(failed)))


def _request_text(body: Mapping[str, Any]) -> str:
    pieces, ids, _ = _texts(body)
    if "messages" in body:
        text = "\n".join(f"{role or 'message'}: {t}" for role, t in pieces)
    else:
        text = "\n".join(t for _, t in pieces)
    if not text and ids:
        text = f"({ids} prompt token ids, no text)"
    return text[:LABEL_TEXT_CHARS]


def label_request(body: Mapping[str, Any], classifier: Classifier) -> dict[str, Any]:
    """The /v1/completions body asking `classifier.model` which class fits the request: the request's text (its
    first 2000 characters) and the class names, the answer constrained to exactly one name."""
    if classifier.model is None:
        raise ValueError("label_request() needs a classifier with a model")
    names = [c.name for c in classifier.classes]
    prompt = ("Classify the request below by how demanding it is to answer well. Answer with exactly one of these "
              f"class names: {', '.join(names)}.\n\nRequest:\n<<<\n{_request_text(body)}\n>>>\n\nClass:")
    return {"model": classifier.model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "stream": False,
            "structured_outputs": {"choice": names}}


def parse_label(response: Mapping[str, Any], classifier: Classifier) -> str | None:
    """The class the classifier model named in its completions response; None when it named none of the classes
    (or the response is no completion)."""
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
        return None
    text = choices[0].get("text")
    if not isinstance(text, str):
        return None
    name = text.strip()
    return name if any(c.name == name for c in classifier.classes) else None
