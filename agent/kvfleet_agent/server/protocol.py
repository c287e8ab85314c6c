"""OpenAI request parsing and response shapes: pure functions, every error naming its field."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvfleet_agent.outputs import CompletionOutput, RequestOutput
from kvfleet_agent.sampling_params import SamplingParams


class APIError(Exception):
    """An error the client caused (or a refusal), rendered as an OpenAI-style error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type_, code

    def body(self) -> dict[str, Any]:
        """The JSON error object."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class GenerateRequest:
    """A parsed completion or chat request: prompts and how to sample them."""

    prompts: list[str | list[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    chat: bool
    created: int = field(default_factory=lambda: int(time.time()))  # one timestamp for every chunk


# Fields OpenAI defines that we accept but cannot honour: refuse them when set to a non-default.
_UNSUPPORTED = {"presence_penalty": 0, "frequency_penalty": 0, "best_of": 1, "suffix": None, "echo": False,
                "logit_bias": None, "tools": None, "tool_choice": None, "response_format": None}


def _get(body: dict[str, Any], name: str, kinds: type | tuple[type, ...], default: Any) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise APIError(f"'{name}' must be {_kind_name(kinds)}, got a boolean", name)
    if not isinstance(value, kinds):
        raise APIError(f"'{name}' must be {_kind_name(kinds)}, got {type(value).__name__}", name)
    return value


def _kind_name(kinds: type | tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", bool: "a boolean", str: "a string", list: "a list",
             dict: "an object"}
    seq = kinds if isinstance(kinds, tuple) else (kinds,)
    return " or ".join(dict.fromkeys(names.get(k, k.__name__) for k in seq))


def parse(body: Any, served_model: str, chat: bool, max_model_len: int
          ) -> tuple[GenerateRequest, list[dict[str, str]] | None]:
    """Validate a /v1/completions or /v1/chat/completions body; returns the request and chat messages.

    max_tokens defaults to 16 for completions (as OpenAI) and, for chat, to the rest of the context.
    """
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    model = _get(body, "model", str, served_model)
    if model != served_model:
        raise APIError(f"The model '{model}' does not exist; this server serves '{served_model}'", "model",
                       status=404, code="model_not_found")
    for name, default in _UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and value != default:
            raise APIError(f"'{name}' is not supported by kvfleet; remove it", name)
    n = _get(body, "n", int, 1)
    if n != 1:
        raise APIError("'n' must be 1: send one request per sample", "n")
    messages = None
    if chat:
        messages = _messages(body)
        prompts: list[str | list[int]] = []
    else:
        prompts = _prompts(body)
    max_tokens = _get(body, "max_completion_tokens", int, None) if chat else None
    max_tokens = max_tokens if max_tokens is not None else _get(body, "max_tokens", int,
                                                                max_model_len if chat else 16)
    stop = _get(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if any(not isinstance(s, str) for s in stop):
        raise APIError("'stop' must be a string or a list of strings", "stop")
    logprobs: int | None
    if chat:
        logprobs = _get(body, "top_logprobs", int, 0) if _get(body, "logprobs", bool, False) else None
    else:
        logprobs = _get(body, "logprobs", int, None)
    stream = _get(body, "stream", bool, False)
    options = _get(body, "stream_options", dict, {})
    try:
        params = SamplingParams(
            max_tokens=max_tokens, temperature=float(_get(body, "temperature", (int, float), 1.0)),
            top_p=float(_get(body, "top_p", (int, float), 1.0)), top_k=_get(body, "top_k", int, 0),
            seed=_get(body, "seed", int, None), stop=stop, stop_token_ids=_get(body, "stop_token_ids", list, []),
            ignore_eos=_get(body, "ignore_eos", bool, False),
            include_stop_str_in_output=_get(body, "include_stop_str_in_output", bool, False),
            logprobs=logprobs, skip_special_tokens=_get(body, "skip_special_tokens", bool, True))
    except ValueError as e:  # SamplingParams names the field as SamplingParams.<name>
        field = str(e).split("=", 1)[0].removeprefix("SamplingParams.")
        raise APIError(str(e).replace("SamplingParams.", ""), field) from None
    include_usage = bool(options.get("include_usage", False)) if stream else True
    return GenerateRequest(prompts, params, stream, include_usage, chat), messages


def _prompts(body: dict[str, Any]) -> list[str | list[int]]:
    prompt = body.get("prompt")
    if prompt == "" or (isinstance(prompt, list) and "" in prompt):
        raise APIError("'prompt' is empty: give at least one character or token", "prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if _token_ids(prompt):
            return [prompt]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) and _token_ids(p) for p in prompt):
            return [list(p) for p in prompt]
    raise APIError("'prompt' must be a non-empty string, a list of token ids, or a list of either", "prompt")


def _token_ids(items: list[Any]) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in items)


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("'messages' must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(f"'messages[{i}].role' must be a string", f"messages[{i}].role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise APIError(f"'messages[{i}].content' may only hold text parts", f"messages[{i}].content")
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            raise APIError(f"'messages[{i}].content' must be a string", f"messages[{i}].content")
        out.append({"role": m["role"], "content": content})
    return out


# -- responses ------------------------------------------------------------------------------------

def new_id(chat: bool) -> str:
    """An OpenAI-looking response id."""
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(outputs: list[RequestOutput]) -> dict[str, int]:
    """Token counts over all prompts of a request."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _logprobs(c: CompletionOutput, start: int, chat: bool, decode: Any) -> dict[str, Any] | None:
    if c.logprobs is None:
        return None
    steps = c.logprobs[start:]
    if chat:
        return {"content": [{"token": decode(lp.token_id), "logprob": lp.logprob,
                             "top_logprobs": [{"token": decode(t), "logprob": v} for t, v in lp.top.items()]}
                            for lp in steps]}
    return {"tokens": [decode(lp.token_id) for lp in steps], "token_logprobs": [lp.logprob for lp in steps],
            "top_logprobs": [{decode(t): v for t, v in lp.top.items()} for lp in steps]}


def choice(index: int, out: RequestOutput, chat: bool, decode: Any, text: str | None = None,
           logprob_start: int = 0, delta: bool = False, first: bool = False) -> dict[str, Any]:
    """One entry of `choices`, whole or as a stream delta."""
    c = out.outputs[0]
    text = c.text if text is None else text
    finish = c.finish_reason if out.finished and c.finish_reason != "abort" else None
    lp = _logprobs(c, logprob_start, chat, decode)
    if not chat:
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
    if delta:
        d: dict[str, str] = {"role": "assistant"} if first else {}
        if text:
            d["content"] = text
        return {"index": index, "delta": d, "logprobs": lp, "finish_reason": finish}
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": lp,
            "finish_reason": finish}


def envelope(rid: str, model: str, chat: bool, choices: list[dict[str, Any]], stream: bool,
             usage_: dict[str, int] | None = None, created: int | None = None) -> dict[str, Any]:
    """The response object around a list of choices (`created` fixed per response, as OpenAI's)."""
    kind = ("chat.completion.chunk" if stream else "chat.completion") if chat else "text_completion"
    body: dict[str, Any] = {"id": rid, "object": kind, "created": created or int(time.time()), "model": model,
                            "choices": choices}
    if usage_ is not None:
        body["usage"] = usage_
    return body
