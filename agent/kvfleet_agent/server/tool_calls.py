"""Tool calls out of a chat output: parsed (Hermes `<tool_call>` tags, Llama-3 JSON) or forced, whole or as deltas."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from kvfleet_agent.server.api.tools import Family, ToolPlan

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
_HERMES_OPEN = "<tool_call>"
_PYTHON_TAG = "<|python_tag|>"


def family_of(chat_template: str | None) -> Family:
    """Which tool-call syntax the model was trained on, from its chat template (Hermes unless it is Llama 3's)."""
    if chat_template and _HERMES_OPEN not in chat_template and (
            _PYTHON_TAG in chat_template or "ipython" in chat_template):
        return "llama3_json"
    return "hermes"


def new_call_id() -> str:
    """An OpenAI-looking tool call id."""
    return "call_" + uuid.uuid4().hex[:24]


def _call(name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": args}}


def _from_objects(objects: list[Any], args_key: str) -> list[dict[str, Any]] | None:
    calls = []
    for o in objects:
        if not isinstance(o, dict) or not isinstance(o.get("name"), str):
            return None
        calls.append(_call(o["name"], o.get(args_key, o.get("arguments", o.get("parameters", {})))))
    return calls


def parse(text: str, plan: ToolPlan, family: Family) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a finished output; text that is no complete call stays content."""
    if plan.mode == "named":
        assert plan.named is not None
        return None, [_call(plan.named, text)]
    if plan.mode == "required":
        try:
            calls = _from_objects(json.loads(text), "parameters")
        except (ValueError, TypeError):  # cut short by max_tokens: leave the text to the client
            calls = None
        return (None, calls) if calls else (text, [])
    if family == "hermes":
        start = text.find(_HERMES_OPEN)
        if start < 0:
            return text, []
        try:
            calls = _from_objects([json.loads(m) for m in _HERMES.findall(text[start:])], "arguments")
        except ValueError:
            calls = None
        return (text[:start].strip() or None, calls) if calls else (text, [])
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return text, []
    try:  # one object, or several separated by ';' (Llama 3.2's form for parallel calls)
        calls = _from_objects([json.loads(part) for part in body.split(";") if part.strip()], "parameters")
    except ValueError:
        calls = None
    return (None, calls) if calls else (text, [])


def whole_choice(piece: dict[str, Any], plan: ToolPlan) -> dict[str, Any]:
    """A finished chat choice with its tool calls parsed out of the content (finish_reason tool_calls)."""
    content, calls = parse(piece["message"]["content"], plan, plan.family)
    if not calls:
        return piece
    finish = piece["finish_reason"]
    return {**piece, "message": {"role": "assistant", "content": content, "tool_calls": calls},
            "finish_reason": "tool_calls" if finish == "stop" else finish}


class ToolDeltas:
    """One streamed choice: its text so far → OpenAI deltas (content, then tool_calls by index, id and name first).

    Forced by name, the arguments stream as they are generated. Otherwise text that may start a call
    is held back; the calls go out once the output is complete (their JSON is only known whole then).
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan, self.family = plan, plan.family
        self.sent = 0  # characters of the text accounted for
        self.held = False  # a call started: the rest is held until the end
        self.calls: list[dict[str, Any]] = []

    def feed(self, text: str, finished: bool) -> list[dict[str, Any]]:
        """Deltas for the text so far (cumulative); finished: the output is complete."""
        if self.plan.mode == "named":
            return self._named(text)
        out: list[dict[str, Any]] = []
        if self.plan.mode == "auto" and not self.held:
            cut = self._content_end(text, finished)
            if cut > self.sent:
                out.append({"content": text[self.sent:cut]})
                self.sent = cut
            if not finished:
                return out
        elif not finished:  # forced calls (required) are parsed whole, at the end
            return out
        content, calls = parse(text[self.sent:] if self.plan.mode == "auto" else text, self.plan, self.family)
        if content:  # no complete call after all (cut short, or not JSON): the text is content
            out.append({"content": content})
        self.calls = calls
        for i, c in enumerate(calls):
            out.append({"tool_calls": [{"index": i, "id": c["id"], "type": "function",
                                        "function": {"name": c["function"]["name"], "arguments": ""}}]})
            out.append({"tool_calls": [{"index": i, "function": {"arguments": c["function"]["arguments"]}}]})
        return out

    def _named(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if not self.calls:
            assert self.plan.named is not None
            self.calls = [_call(self.plan.named, "")]
            c = self.calls[0]
            out.append({"tool_calls": [{"index": 0, "id": c["id"], "type": "function",
                                        "function": {"name": self.plan.named, "arguments": ""}}]})
        if len(text) > self.sent:
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": text[self.sent:]}}]})
            self.sent = len(text)
        return out

    def _content_end(self, text: str, finished: bool) -> int:
        """Where plain content ends: before a call's start, or before a tail that might become one."""
        if self.family == "hermes":
            start = text.find(_HERMES_OPEN, self.sent)
            if start >= 0:
                self.held = True
                return start
            if finished:
                return len(text)
            for k in range(min(len(_HERMES_OPEN) - 1, len(text)), 0, -1):  # a partial "<tool_call" at the end
                if _HERMES_OPEN.startswith(text[-k:]):
                    return len(text) - k
            return len(text)
        head = text.lstrip()
        if self.sent == 0 and not finished and (not head or _PYTHON_TAG.startswith(head[:len(_PYTHON_TAG)])):
            return 0  # nothing yet, or the start of <|python_tag|>: wait for more
        if self.sent == 0 and (head.startswith("{") or head.startswith(_PYTHON_TAG)):
            self.held = True  # Llama 3 JSON calls are the whole output
            return 0
        return len(text)
