"""The OpenAPI 3.1 description of the agent's HTTP API, served at /openapi.json."""

from __future__ import annotations

from typing import Any

_ERROR = {"description": "OpenAI-style error", "content": {"application/json": {"schema": {
    "$ref": "#/components/schemas/Error"}}}}
_SAMPLING = {
    "max_tokens": {"type": "integer", "minimum": 1, "default": 16},
    "temperature": {"type": "number", "minimum": 0, "maximum": 100, "default": 1},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1, "default": 1},
    "top_k": {"type": "integer", "minimum": -1, "default": 0, "description": "0 or -1 disables"},
    "seed": {"type": "integer"},
    "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 16}]},
    "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}},
    "ignore_eos": {"type": "boolean", "default": False},
    "stream": {"type": "boolean", "default": False},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "n": {"type": "integer", "enum": [1]},
}


def _post(summary: str, schema: str) -> dict[str, Any]:
    return {"post": {"summary": summary, "requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{schema}"}}}}, "responses": {
        "200": {"description": "The result, or a text/event-stream of chunks ending in `data: [DONE]` when "
                               "stream is true"},
        "400": _ERROR, "404": _ERROR, "429": _ERROR, "503": _ERROR}}}


def _get(summary: str, ok: str, fail: str | None = None) -> dict[str, Any]:
    responses: dict[str, Any] = {"200": {"description": ok}}
    if fail:
        responses["503"] = {"description": fail}
    return {"get": {"summary": summary, "responses": responses}}


def openapi_document(model: str) -> dict[str, Any]:
    """The API description, naming the served model."""
    return {
        "openapi": "3.1.0",
        "info": {"title": "kvfleet agent", "version": "v1",
                 "description": f"OpenAI-compatible inference for the model '{model}'."},
        "paths": {
            "/v1/completions": _post("Complete a prompt (text or token ids, or a list of them)", "Completion"),
            "/v1/chat/completions": _post("Answer a conversation, rendered with the model's chat template",
                                          "ChatCompletion"),
            "/v1/models": _get("The served model", "A list with one model"),
            "/health": _get("Liveness: the engine loop is alive and making progress", "alive", "failed or stalled"),
            "/ready": _get("Readiness: loaded, warmed up and not draining", "ready", "draining or failed"),
            "/metrics": _get("Prometheus metrics", "text exposition format"),
            "/openapi.json": _get("This document", "OpenAPI 3.1"),
        },
        "components": {"schemas": {
            "Completion": {"type": "object", "required": ["prompt"], "properties": {
                "model": {"type": "string", "enum": [model]},
                "prompt": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "integer"}},
                                     {"type": "array", "items": {"type": "string"}},
                                     {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}}]},
                "logprobs": {"type": "integer", "minimum": 0, "maximum": 20}, **_SAMPLING}},
            "ChatCompletion": {"type": "object", "required": ["messages"], "properties": {
                "model": {"type": "string", "enum": [model]},
                "messages": {"type": "array", "minItems": 1, "items": {"type": "object", "required": [
                    "role", "content"], "properties": {"role": {"type": "string"}, "content": {"type": "string"}}}},
                "max_completion_tokens": {"type": "integer", "minimum": 1},
                "logprobs": {"type": "boolean"}, "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
                **_SAMPLING}},
            "Error": {"type": "object", "properties": {"error": {"type": "object", "properties": {
                "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]}}}}},
        }},
    }
