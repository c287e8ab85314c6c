"""Prompts and chat messages as the client sent them → checked text and token ids, every error naming its field."""

from __future__ import annotations

import contextlib
import json
from typing import Any

from kvfleet_agent.server.api.common import APIError


def check_text(text: str, name: str) -> str:
    """Refuse text holding a lone UTF-16 surrogate (JSON allows "\\ud800"; no tokenizer can encode it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(f"'{name}' holds a lone UTF-16 surrogate (\\u{ord(text[e.start]):04x} at character "
                       f"{e.start}), which is not valid Unicode: send well-formed text (surrogates only in pairs)",
                       name) from None
    return text


def shown(value: str, limit: int = 64) -> str:
    """A client's value, cut short, for an error message (a huge one must not come back whole)."""
    return repr(value if len(value) <= limit else value[:limit] + "...")


def prompts_of(prompt: Any, max_model_len: int, max_prompts: int | None) -> list[str | list[int]]:
    """The prompt (a text, token ids, or a list of either) as a list of prompts."""
    if isinstance(prompt, str):
        if not prompt:
            raise APIError("'prompt' is empty: give at least one character or token", "prompt")
        return [check_text(prompt, "prompt")]
    if isinstance(prompt, list) and prompt:
        if _is_token_id(prompt[0]):  # one prompt of token ids
            return [_token_ids(prompt, "prompt", max_model_len)]
        if max_prompts is not None and len(prompt) > max_prompts:
            raise APIError(f"'prompt' holds {len(prompt)} prompts; this server takes at most {max_prompts} in one "
                           "request (its queue length): split them over several requests", "prompt")
        if all(isinstance(p, str) for p in prompt):
            if "" in prompt:
                raise APIError("'prompt' is empty: give at least one character or token", "prompt")
            return [check_text(p, "prompt") for p in prompt]
        if all(isinstance(p, list) and p for p in prompt):
            return [_token_ids(p, "prompt", max_model_len) for p in prompt]
        if any(p == "" or p == [] for p in prompt):
            raise APIError("'prompt' is empty: give at least one character or token", "prompt")
    if prompt == "" or prompt == []:
        raise APIError("'prompt' is empty: give at least one character or token", "prompt")
    raise APIError("'prompt' must be a non-empty string, a list of token ids, or a list of either", "prompt")


def _is_token_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _token_ids(items: list[Any], name: str, max_model_len: int) -> list[int]:
    if len(items) >= max_model_len:  # before looking at each id: a huge list is refused in O(1)
        raise APIError(f"'{name}' has {len(items)} tokens; this model's context is max_model_len={max_model_len} "
                       "tokens, and the prompt must leave room for at least one generated token: shorten it", name)
    if not all(_is_token_id(t) for t in items):
        raise APIError(f"'{name}' must be a non-empty string, a list of token ids, or a list of either", name)
    return items


def messages_of(messages: Any) -> list[dict[str, Any]]:
    """Chat messages as {role, content} with text content (text parts joined), and the tool-calling keys.

    An assistant message may carry tool_calls (content then may be null); a tool message its
    tool_call_id. Arguments that are JSON text are handed to the template as objects, as vLLM does:
    templates write them with tojson.
    """
    if not isinstance(messages, list) or not messages:
        raise APIError("'messages' must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(f"'messages[{i}].role' must be a string", f"messages[{i}].role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise APIError(f"'messages[{i}].content' may only hold text parts ({{\"type\": \"text\", "
                               "\"text\": \"...\"}})", f"messages[{i}].content")
            content = "".join(p["text"] for p in content)
        if content is None and m.get("tool_calls"):
            content = ""
        if not isinstance(content, str):
            raise APIError(f"'messages[{i}].content' must be a string", f"messages[{i}].content")
        msg: dict[str, Any] = {"role": check_text(m["role"], f"messages[{i}].role"),
                               "content": check_text(content, f"messages[{i}].content")}
        for key in ("name", "tool_call_id"):
            if key in m and m[key] is not None:
                if not isinstance(m[key], str):
                    raise APIError(f"'messages[{i}].{key}' must be a string", f"messages[{i}].{key}")
                msg[key] = check_text(m[key], f"messages[{i}].{key}")
        if m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(m["tool_calls"], f"messages[{i}].tool_calls")
        out.append(msg)
    return out


def _tool_calls(calls: Any, name: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise APIError(f"'{name}' must be a list of tool calls", name)
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or \
                not isinstance(fn.get("arguments", ""), str | dict):
            raise APIError(f"'{name}[{j}]' must be {{id, type: function, function: {{name, arguments}}}}",
                           f"{name}[{j}]")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            with contextlib.suppress(ValueError):  # not JSON: left as text, the template writes it as it is
                args = json.loads(args)
        out.append({"id": c.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


# -- responses ------------------------------------------------------------------------------------
