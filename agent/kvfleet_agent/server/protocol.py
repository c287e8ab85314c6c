"""OpenAI request parsing and response shapes: pure functions, every error naming its field."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvfleet_agent.outputs import CompletionOutput, RequestOutput
from kvfleet_agent.sampling_params import MAX_STOP_STRINGS, SamplingParams


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
    # The field that set max_tokens as the client spelled it, None when defaulted: errors name it.
    max_tokens_field: str | None = None

    @property
    def prompt_field(self) -> str:
        """The field that carried the prompt, for error messages."""
        return "messages" if self.chat else "prompt"


# Fields OpenAI defines that we accept but cannot honour: refuse them when set to a non-default.
_UNSUPPORTED = {"presence_penalty": 0, "frequency_penalty": 0, "best_of": 1, "suffix": None, "echo": False,
                "logit_bias": None, "tools": None, "tool_choice": None, "response_format": None}
MAX_STOP_TOKEN_IDS = 1024  # a list this long is a mistake; a far longer one would only cost time to check


def _get(body: dict[str, Any], name: str, kinds: type | tuple[type, ...], default: Any) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    allowed = kinds if isinstance(kinds, tuple) else (kinds,)
    if isinstance(value, bool) and bool not in allowed:
        raise APIError(f"'{name}' must be {_kind_name(kinds)}, got a boolean", name)
    if not isinstance(value, kinds):
        raise APIError(f"'{name}' must be {_kind_name(kinds)}, got {_json_type(value)}", name)
    if float in allowed and isinstance(value, int) and abs(value) > 1e300:  # float(value) would overflow
        raise APIError(f"'{name}' has {len(str(abs(value)))} digits: use a number of ordinary size", name)
    return value


def _kind_name(kinds: type | tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", bool: "a boolean", str: "a string", list: "a list",
             dict: "an object"}
    seq = kinds if isinstance(kinds, tuple) else (kinds,)
    return " or ".join(dict.fromkeys(names.get(k, k.__name__) for k in seq))


def _json_type(value: Any) -> str:
    return {str: "a string", int: "an integer", float: "a number", bool: "a boolean", list: "a list",
            dict: "an object"}.get(type(value), type(value).__name__)


def check_text(text: str, name: str) -> str:
    """Refuse text holding a lone UTF-16 surrogate (JSON allows "\\ud800"; no tokenizer can encode it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(f"'{name}' holds a lone UTF-16 surrogate (\\u{ord(text[e.start]):04x} at character "
                       f"{e.start}), which is not valid Unicode: send well-formed text (surrogates only in pairs)",
                       name) from None
    return text


def _shown(value: str, limit: int = 64) -> str:
    """A client's value, cut short, for an error message (a huge one must not come back whole)."""
    return repr(value if len(value) <= limit else value[:limit] + "...")


def parse(body: Any, served_model: str, chat: bool, max_model_len: int, max_prompts: int | None = None
          ) -> tuple[GenerateRequest, list[dict[str, str]] | None]:
    """Validate a /v1/completions or /v1/chat/completions body; returns the request and chat messages.

    max_tokens defaults to 16 for completions (as OpenAI) and, for chat, to the rest of the context.
    Only what the body alone decides is checked here: prompt lengths in tokens are checked once
    tokenized (prompts.py). Sizes are checked before contents, so a huge list is refused in O(1).
    """
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    model = _get(body, "model", str, served_model)
    if model != served_model:
        raise APIError(f"The model {_shown(model)} does not exist; this server serves '{served_model}'", "model",
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
        messages = _messages(body, max_model_len)
        prompts: list[str | list[int]] = []
    else:
        prompts = _prompts(body, max_model_len, max_prompts)
    params, max_tokens_field = _sampling(body, chat, max_model_len)
    stream = _get(body, "stream", bool, False)
    options = _get(body, "stream_options", dict, {})
    wants_usage = options.get("include_usage")
    if wants_usage is not None and not isinstance(wants_usage, bool):
        raise APIError("'stream_options.include_usage' must be a boolean", "stream_options.include_usage")
    include_usage = bool(wants_usage) if stream else True
    return GenerateRequest(prompts, params, stream, include_usage, chat, max_tokens_field=max_tokens_field), messages


def _sampling(body: dict[str, Any], chat: bool, max_model_len: int) -> tuple[SamplingParams, str | None]:
    """SamplingParams from the body, and the field (as the client spelled it) that set max_tokens."""
    # SamplingParams names its own fields; the client may have used OpenAI's other names for them.
    spelled = {"max_tokens": "max_tokens", "logprobs": "top_logprobs" if chat else "logprobs"}
    max_tokens = _get(body, "max_completion_tokens", int, None) if chat else None
    if max_tokens is not None:
        spelled["max_tokens"] = "max_completion_tokens"
    else:
        max_tokens = _get(body, "max_tokens", int, None)
    max_tokens_field = spelled["max_tokens"] if max_tokens is not None else None
    if max_tokens is None:
        max_tokens = max_model_len if chat else 16
    stop = _get(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > MAX_STOP_STRINGS:
        raise APIError(f"'stop' has {len(stop)} strings; pass at most {MAX_STOP_STRINGS}", "stop")
    if any(not isinstance(s, str) for s in stop):
        raise APIError("'stop' must be a string or a list of strings", "stop")
    for s in stop:
        check_text(s, "stop")
    stop_token_ids = _get(body, "stop_token_ids", list, [])
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise APIError(f"'stop_token_ids' has {len(stop_token_ids)} ids; pass at most {MAX_STOP_TOKEN_IDS}",
                       "stop_token_ids")
    logprobs: int | None
    if chat:
        wants = _get(body, "logprobs", bool, False)
        top = _get(body, "top_logprobs", int, None)
        if top is not None and not wants:
            raise APIError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        logprobs = (top or 0) if wants else None
    else:
        logprobs = _get(body, "logprobs", int, None)
    try:
        params = SamplingParams(
            max_tokens=max_tokens, temperature=float(_get(body, "temperature", (int, float), 1.0)),
            top_p=float(_get(body, "top_p", (int, float), 1.0)), top_k=_get(body, "top_k", int, 0),
            seed=_get(body, "seed", int, None), stop=stop, stop_token_ids=stop_token_ids,
            ignore_eos=_get(body, "ignore_eos", bool, False),
            include_stop_str_in_output=_get(body, "include_stop_str_in_output", bool, False),
            logprobs=logprobs, skip_special_tokens=_get(body, "skip_special_tokens", bool, True))
    except ValueError as e:  # SamplingParams names the field as SamplingParams.<name>=<value> is invalid: ...
        internal, rest = str(e).removeprefix("SamplingParams.").split("=", 1)
        name = spelled.get(internal, internal)
        raise APIError(f"'{name}'={rest}", name) from None
    return params, max_tokens_field


def _prompts(body: dict[str, Any], max_model_len: int, max_prompts: int | None) -> list[str | list[int]]:
    prompt = body.get("prompt")
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


def _messages(body: dict[str, Any], max_model_len: int) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("'messages' must be a non-empty list of {role, content} objects", "messages")
    if len(messages) >= max_model_len:  # every message takes at least one token of the context
        raise APIError(f"'messages' has {len(messages)} messages; at most {max_model_len - 1} fit in this model's "
                       f"context (max_model_len={max_model_len} tokens)", "messages")
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
        if not isinstance(content, str):
            raise APIError(f"'messages[{i}].content' must be a string", f"messages[{i}].content")
        out.append({"role": check_text(m["role"], f"messages[{i}].role"),
                    "content": check_text(content, f"messages[{i}].content")})
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
    # "abort" too (as vLLM): a stream cut by a drain says so in its last chunk rather than just stopping.
    finish = c.finish_reason if out.finished else None
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
