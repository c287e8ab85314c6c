"""The OpenAPI 3.1 description of the agent's HTTP API, served at /openapi.json: requests, responses and errors."""

from __future__ import annotations

from typing import Any

from kvfleet_agent.sampling_params import MAX_STOP_STRINGS
from kvfleet_agent.server.protocol import MAX_STOP_TOKEN_IDS

_ERROR = {"description": "OpenAI-style error naming the problem (and the field, in `param`)",
          "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
_POST_ERRORS = {
    "400": "invalid request: the message says what is wrong and how to fix it",
    "401": "missing or incorrect API key (when the server has one)",
    "404": "unknown model",
    "408": "the body did not arrive within the body timeout",
    "413": "the body is over the size limit",
    "415": "the body is not JSON (or is compressed)",
    "429": "the queue is full: retry after the Retry-After delay",
    "503": "draining or failed: retry on another replica",
}


def _or_null(schema: dict[str, Any]) -> dict[str, Any]:
    """An optional field: null means "use the default", as in OpenAI's API."""
    return {"anyOf": [schema, {"type": "null"}]}


_SAMPLING_FIELDS: dict[str, dict[str, Any]] = {
    "max_tokens": {"type": "integer", "minimum": 1, "default": 16,
                   "description": "with the prompt, at most max_model_len tokens"},
    "temperature": {"type": "number", "minimum": 0, "maximum": 100, "default": 1},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1, "default": 1},
    "top_k": {"type": "integer", "minimum": -1, "default": 0, "description": "0 or -1 disables"},
    "seed": {"type": "integer", "minimum": -(2**63), "maximum": 2**64 - 1},
    "stop": {"oneOf": [{"type": "string", "minLength": 1},
                       {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOP_STRINGS}]},
    "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}, "maxItems": MAX_STOP_TOKEN_IDS},
    "ignore_eos": {"type": "boolean", "default": False},
    "include_stop_str_in_output": {"type": "boolean", "default": False},
    "skip_special_tokens": {"type": "boolean", "default": True},
    "stream": {"type": "boolean", "default": False},
    "stream_options": {"type": "object", "properties": {"include_usage": _or_null({"type": "boolean"})}},
    "n": {"const": 1},
}
_SAMPLING = {name: _or_null(schema) for name, schema in _SAMPLING_FIELDS.items()}
_NULLABLE_STRING = {"type": ["string", "null"]}
_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"], "properties": {
    k: {"type": "integer", "minimum": 0} for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}
_FINISH = {"enum": ["stop", "length", "abort", None]}


def _json(schema: str, description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{schema}"}}}}


def _post(summary: str, request: str, response: str, secured: bool) -> dict[str, Any]:
    ok = _json(response, "The result; with stream true, a text/event-stream of chunks ending in `data: [DONE]`")
    # For an event stream, OpenAPI 3.1's `schema` describes one event: its data is a JSON chunk, or [DONE] last.
    ok["content"]["text/event-stream"] = {"schema": {"type": "object", "required": ["data"], "properties": {
        "data": {"type": "string", "minLength": 1, "contentMediaType": "application/json"},
        "event": {"type": "string"}, "id": {"type": "string"}}}}
    op: dict[str, Any] = {"summary": summary, "requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{request}"}}}},
        "responses": {"200": ok, **{code: {**_ERROR, "description": why} for code, why in _POST_ERRORS.items()}}}
    return {"post": _secure(op, secured)}


def _get(summary: str, ok: dict[str, Any], fail: dict[str, Any] | None = None, secured: bool = False
         ) -> dict[str, Any]:
    responses: dict[str, Any] = {"200": ok}
    if fail is not None:
        responses["503"] = fail
    if secured:
        responses["401"] = {**_ERROR, "description": _POST_ERRORS["401"]}
    return {"get": _secure({"summary": summary, "responses": responses}, secured)}


def _secure(op: dict[str, Any], secured: bool) -> dict[str, Any]:
    if secured:
        op["security"] = [{"bearer": []}]
    return op


def _status(*values: str) -> dict[str, Any]:
    return {"type": "object", "required": ["status"], "properties": {"status": {"enum": list(values)},
                                                                     "reason": {"type": "string"}}}


def openapi_document(model: str, secured: bool = False) -> dict[str, Any]:
    """The API description, naming the served model; `secured` when /v1 routes need the API key."""
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "kvfleet agent", "version": "v1",
                 "description": f"OpenAI-compatible inference for the model '{model}'."},
        "paths": {
            "/v1/completions": _post("Complete a prompt (text or token ids, or a list of them)", "Completion",
                                     "CompletionResponse", secured),
            "/v1/chat/completions": _post("Answer a conversation, rendered with the model's chat template",
                                          "ChatCompletion", "ChatCompletionResponse", secured),
            "/v1/models": _get("The served model", _json("ModelList", "A list with one model"), secured=secured),
            "/health": _get("Liveness: the engine loop is alive and making progress",
                            {"description": "alive", "content": {"application/json": {"schema": _status("ok")}}},
                            {"description": "failed or stalled", "content": {"application/json": {
                                "schema": _status("unhealthy")}}}),
            "/ready": _get("Readiness: loaded, warmed up and not draining",
                           {"description": "ready", "content": {"application/json": {"schema": _status("ready")}}},
                           {"description": "draining or failed", "content": {"application/json": {
                               "schema": _status("draining", "failed")}}}),
            "/metrics": _get("Prometheus metrics", {"description": "text exposition format", "content": {
                "text/plain": {"schema": {"type": "string"}}}}),
            "/openapi.json": _get("This document", {"description": "OpenAPI 3.1", "content": {
                "application/json": {"schema": {"type": "object"}}}}),
        },
        "components": {"schemas": _schemas(model)},
    }
    if secured:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return doc


def _schemas(model: str) -> dict[str, Any]:
    token_ids = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
    text = {"type": "string", "minLength": 1}
    logprobs = {"type": ["object", "null"]}
    return {
        "Completion": {"type": "object", "required": ["prompt"], "properties": {
            "model": _or_null({"const": model}),
            "prompt": {"oneOf": [text, token_ids, {"type": "array", "items": text, "minItems": 1},
                                 {"type": "array", "items": token_ids, "minItems": 1}]},
            "logprobs": _or_null({"type": "integer", "minimum": 0, "maximum": 20}), **_SAMPLING}},
        "ChatCompletion": {"type": "object", "required": ["messages"], "properties": {
            "model": _or_null({"const": model}),
            "messages": {"type": "array", "minItems": 1, "items": {"type": "object", "required": [
                "role", "content"], "properties": {"role": {"type": "string"}, "content": {"oneOf": [
                    {"type": "string"}, {"type": "array", "items": {
                        "type": "object", "required": ["type", "text"], "properties": {
                            "type": {"const": "text"}, "text": {"type": "string"}}}}]}}}},
            "max_completion_tokens": _or_null({"type": "integer", "minimum": 1}),
            "logprobs": _or_null({"type": "boolean"}),
            "top_logprobs": _or_null({"type": "integer", "minimum": 0, "maximum": 20,
                                      "description": "needs logprobs: true"}),
            **_SAMPLING},
            # top_logprobs (not null) needs logprobs: true, as in OpenAI's API.
            "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
            "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}},
        "CompletionResponse": {"type": "object", "required": ["id", "object", "created", "model", "choices"],
                               "properties": {
            "id": {"type": "string"}, "object": {"const": "text_completion"}, "created": {"type": "integer"},
            "model": {"const": model}, "usage": _USAGE, "choices": {"type": "array", "items": {
                "type": "object", "required": ["index", "text", "finish_reason"], "properties": {
                    "index": {"type": "integer", "minimum": 0}, "text": {"type": "string"}, "logprobs": logprobs,
                    "finish_reason": _FINISH}}}}},
        "ChatCompletionResponse": {"type": "object", "required": ["id", "object", "created", "model", "choices"],
                                   "properties": {
            "id": {"type": "string"}, "object": {"const": "chat.completion"}, "created": {"type": "integer"},
            "model": {"const": model}, "usage": _USAGE, "choices": {"type": "array", "items": {
                "type": "object", "required": ["index", "message", "finish_reason"], "properties": {
                    "index": {"type": "integer", "minimum": 0}, "logprobs": logprobs, "finish_reason": _FINISH,
                    "message": {"type": "object", "required": ["role", "content"], "properties": {
                        "role": {"const": "assistant"}, "content": {"type": "string"}}}}}}}},
        "ModelList": {"type": "object", "required": ["object", "data"], "properties": {
            "object": {"const": "list"}, "data": {"type": "array", "items": {
                "type": "object", "required": ["id", "object", "created", "owned_by"], "properties": {
                    "id": {"const": model}, "object": {"const": "model"}, "created": {"type": "integer"},
                    "owned_by": {"type": "string"}, "max_model_len": {"type": "integer", "minimum": 1}}}}}},
        "Error": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["message", "type", "param", "code"], "properties": {
                "message": {"type": "string", "minLength": 1}, "type": {"type": "string"},
                "param": _NULLABLE_STRING, "code": _NULLABLE_STRING}}}},
    }
