"""The prefix key of a request: the leading part of its prompt that decides where its KV blocks already are.

A documented approximation of the agents' own block hashes: the router does not load the model's
tokenizer, so it keys on the first PREFIX_CHARS characters of the text (about 64 tokens, four KV
blocks of 16) or the first PREFIX_TOKENS token ids. Requests that share that much share their
leading blocks in the agent's prefix cache, which is all affinity needs.
"""

from __future__ import annotations

import json
from typing import Any

PREFIX_CHARS = 256
PREFIX_TOKENS = 64


def prefix_key(body: dict[str, Any]) -> str | None:
    """The key of a /v1/completions or /v1/chat/completions body (None when there is no prompt to follow)."""
    model = str(body.get("model", ""))
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list) or not messages:
            return None
        text = "".join(json.dumps([m.get("role"), m.get("content")], ensure_ascii=False)
                       if isinstance(m, dict) else "" for m in messages)
        return f"{model}\x00{text[:PREFIX_CHARS]}"
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:  # one prompt in a list: key on it
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return f"{model}\x00{prompt[:PREFIX_CHARS]}"
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return f"{model}\x00" + ",".join(map(str, prompt[:PREFIX_TOKENS]))
    return None  # several prompts in one request: they may share nothing, so no affinity
