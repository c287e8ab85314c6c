"""A POST's JSON body: media type, encoding, size, a deadline to arrive, nesting and text, each refused by name."""

from __future__ import annotations

import asyncio
import json
from typing import Any, NoReturn

from aiohttp import web

from kvfleet_agent.server.protocol import APIError


def _is_json(media_type: str) -> bool:
    return media_type == "application/json" or (media_type.startswith("application/") and media_type.endswith("+json"))


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON (Python's json module accepts it, JSON does not): send a number")


async def read_json(request: web.Request, timeout_s: float) -> Any:
    """The parsed body of a POST, or an APIError naming what is wrong with it and how to fix it."""
    # Only JSON is taken: a web page may POST text/plain or a form to any origin without asking
    # (a CORS "simple request"), so accepting those would let any page spend this server's compute.
    # A missing Content-Type is accepted, as FastAPI (so vLLM) does: browsers always send one.
    if request.headers.get("Content-Type") is not None:
        if not _is_json(request.content_type):
            raise APIError(f"Content-Type {request.content_type!r} is not accepted: send a JSON body with "
                           "'Content-Type: application/json'", status=415, code="unsupported_media_type")
        if request.charset is not None and request.charset.lower() not in ("utf-8", "utf8"):
            raise APIError(f"charset {request.charset!r} is not accepted: JSON is UTF-8 (RFC 8259); send UTF-8",
                           status=415, code="unsupported_media_type")
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise APIError(f"Content-Encoding {encoding!r} is not accepted: send the body uncompressed", status=415,
                       code="unsupported_media_type")
    limit = request.client_max_size
    if request.content_length is not None and request.content_length > limit:
        raise APIError(f"the request body has {request.content_length} bytes; the limit is {limit}", status=413,
                       code="body_too_large")
    try:
        async with asyncio.timeout(timeout_s):
            raw = await request.read()
    except TimeoutError:
        raise APIError(f"the request body did not arrive within {timeout_s:g} s (--body-timeout): send it whole",
                       status=408, code="body_timeout") from None
    except web.HTTPRequestEntityTooLarge:
        raise APIError(f"the request body is over the limit of {limit} bytes", status=413,
                       code="body_too_large") from None
    if not raw.strip():
        raise APIError("the request body is empty: send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(f"the request body is not UTF-8 (byte {e.start} is invalid): JSON must be UTF-8") from None
    try:
        return json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise APIError("the request body is nested too deeply to parse: requests need only a few levels") from None
    except json.JSONDecodeError as e:
        raise APIError(f"the request body is not valid JSON: {e}") from None
    except ValueError as e:  # a NaN or Infinity, or an integer of more than 4300 digits
        raise APIError(f"the request body holds a value that cannot be read: {e}") from None
