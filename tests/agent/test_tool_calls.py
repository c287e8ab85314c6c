"""Tool calls parsed out of model text (Hermes tags, Llama-3 JSON) and streamed as the OpenAI clients assemble them."""

from __future__ import annotations

import json
from typing import Any

from kvfleet_agent.server.api.tools import ToolPlan
from kvfleet_agent.server.tool_calls import ToolDeltas, family_of, parse

HERMES = 'I will check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' \
         '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
LLAMA3 = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}'


def _assemble(deltas: list[dict[str, Any]]) -> tuple[str, list[dict[str, str]]]:
    """What the openai client's stream helpers do: content concatenated, tool calls merged by index."""
    content, calls = "", {}
    for d in deltas:
        content += d.get("content") or ""
        for tc in d.get("tool_calls", []):
            c = calls.setdefault(tc["index"], {"id": "", "name": "", "arguments": ""})
            c["id"] += tc.get("id", "")
            c["name"] += tc.get("function", {}).get("name", "")
            c["arguments"] += tc.get("function", {}).get("arguments", "")
    return content, [calls[i] for i in sorted(calls)]


def _stream(text: str, plan: ToolPlan, step: int = 3) -> tuple[str, list[dict[str, str]]]:
    s, deltas = ToolDeltas(plan), []
    for end in range(step, len(text) + step, step):
        deltas += s.feed(text[:end], end >= len(text))
    return _assemble(deltas)


def test_hermes_calls_parse_whole_and_streamed() -> None:
    content, calls = parse(HERMES, ToolPlan("auto"), "hermes")
    assert content == "I will check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert all(c["id"].startswith("call_") for c in calls) and len({c["id"] for c in calls}) == 2
    content, streamed = _stream(HERMES, ToolPlan("auto"))
    assert content == "I will check." and [c["name"] for c in streamed] == ["get_weather", "get_time"]
    assert json.loads(streamed[0]["arguments"]) == {"city": "Oslo"}


def test_llama3_json_calls_and_plain_text() -> None:
    plan = ToolPlan("auto", family="llama3_json")
    content, calls = parse(LLAMA3, plan, "llama3_json")
    assert content is None and calls[0]["function"]["name"] == "get_weather"
    assert _stream(LLAMA3, plan)[1][0]["name"] == "get_weather"
    assert parse("just words", plan, "llama3_json") == ("just words", [])
    assert _stream("just <tool words", ToolPlan("auto")) == ("just <tool words", [])  # a held tail comes back


def test_forced_calls_and_cut_outputs() -> None:
    named = ToolPlan("named", "get_weather")
    content, calls = _stream('{"city": "Oslo"}', named)
    assert not content and calls[0]["name"] == "get_weather" and calls[0]["arguments"] == '{"city": "Oslo"}'
    required = '[{"name": "get_time", "parameters": {"zone": "utc"}}]'
    assert _stream(required, ToolPlan("required"))[1][0]["name"] == "get_time"
    assert parse('[{"name": "get_ti', ToolPlan("required"), "hermes") == ('[{"name": "get_ti', [])


def test_family_from_the_chat_template() -> None:
    assert family_of("{{ '<tool_call>' }}") == "hermes"
    assert family_of("{% if m.role == 'ipython' %}<|python_tag|>{% endif %}") == "llama3_json"
    assert family_of(None) == "hermes"
