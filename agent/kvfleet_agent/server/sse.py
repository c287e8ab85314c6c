"""Streamed completions as server-sent events: each prompt's new text as OpenAI chunks, usage, then `data: [DONE]`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from kvfleet_agent.engine.async_llm import EngineDeadError
from kvfleet_agent.outputs import RequestOutput
from kvfleet_agent.server import protocol
from kvfleet_agent.server.api.render import echoed, prompt_only
from kvfleet_agent.server.fanout import OutputStream
from kvfleet_agent.server.protocol import APIError
from kvfleet_agent.server.tool_calls import ToolDeltas

log = logging.getLogger(__name__)
Echo = Callable[[int, RequestOutput], str]  # choice index, its output → the prompt text echo puts in front


async def stream(request: web.Request, rid: str, streams: list[OutputStream], req: protocol.GenerateRequest,
                 model: str, decode: Callable[[int], str], echo: Echo | None = None) -> web.StreamResponse:
    """Send the streams' outputs as chunks; a request aborted by a drain ends with finish_reason "abort".

    echo (completions with echo): the prompt's text for choice i, put in front of that choice's first piece.
    """
    merged = merge(streams)
    first = await anext(merged, None)  # invalid input raises here, before any header is sent
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    finals: dict[int, RequestOutput] = {}
    try:
        await _pump(resp, rid, req, model, decode, merged, first, finals, len(streams), echo)
    except Exception as e:  # headers are out: report it inside the stream, then end the stream properly
        if not isinstance(e, EngineDeadError):
            log.exception("error while streaming %s", rid)
        await send(resp, APIError("the engine failed mid-stream" if isinstance(e, EngineDeadError) else
                                  "internal error mid-stream; the server logged it", status=503,
                                  type_="server_error").body())
    if req.include_usage and finals:
        await send(resp, protocol.envelope(rid, model, req.chat, [], True,
                                           protocol.usage([finals[i] for i in sorted(finals)], req.best_of),
                                           req.created))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def _pump(resp: web.StreamResponse, rid: str, req: protocol.GenerateRequest, model: str,
                decode: Callable[[int], str], merged: AsyncIterator[tuple[int, RequestOutput]],
                item: tuple[int, RequestOutput] | None, finals: dict[int, RequestOutput], count: int,
                echo: Echo | None) -> None:
    # Per stream (= per choice: prompt p's sample i is choice p * n + i, as OpenAI numbers them).
    sent_text = [0] * count
    sent_lp = [0] * count
    sent_role = [not req.chat] * count  # chat streams name the role once, in the first delta
    # With echo: whether the prompt went out yet, and where generated tokens start in the text (text_offset).
    echo_due = [echo is not None] * count
    latest: dict[int, RequestOutput] = {}  # for continuous usage: each stream's newest output
    base = [0] * count
    tools = [ToolDeltas(req.tool_plan) for _ in range(count)] if req.tool_plan is not None else None
    while item is not None:
        i, out = item
        if tools is not None:  # chat with tools: content and tool_calls deltas instead of the text's
            await _tool_chunks(resp, rid, req, model, i, out, tools[i], not sent_role[i])
            sent_role[i] = True
            if out.finished:
                finals[i] = out
            item = await anext(merged, None)
            continue
        if req.prompt_only:
            out = prompt_only(out)
        c = out.outputs[0]
        delta = c.text[sent_text[i]:]
        piece = protocol.choice(i, out, req.chat, decode, text=delta, logprob_start=sent_lp[i], delta=True,
                                first=not sent_role[i], text_offset=base[i] + sent_text[i])
        if echo is not None and echo_due[i]:
            piece = echoed(out, echo(i, out), piece, decode)
            base[i] = sum(len(decode(t)) for t in out.prompt_token_ids)
        new_lp = len(c.logprobs or []) > sent_lp[i]
        sent_text[i], sent_lp[i] = len(c.text), len(c.logprobs or [])
        latest[i] = out
        if delta or out.finished or new_lp or echo_due[i]:
            sent_role[i], echo_due[i] = True, False
            so_far = _usage_so_far(latest, req.best_of) if req.continuous_usage else None
            await send(resp, protocol.envelope(rid, model, req.chat, [piece], True, so_far, created=req.created))
        if out.finished:
            finals[i] = out
        item = await anext(merged, None)


async def _tool_chunks(resp: web.StreamResponse, rid: str, req: protocol.GenerateRequest, model: str, i: int,
                       out: RequestOutput, tools: ToolDeltas, first: bool) -> None:
    c = out.outputs[0]
    deltas = tools.feed(c.text, out.finished)
    if first:  # the role goes with the first delta, as OpenAI's
        deltas = [{"role": "assistant", **(deltas[0] if deltas else {})}, *deltas[1:]]
    if out.finished and not deltas:
        deltas = [{}]
    finish = c.finish_reason if out.finished else None
    if finish == "stop" and tools.calls:
        finish = "tool_calls"
    for k, d in enumerate(deltas):
        piece = {"index": i, "delta": d, "logprobs": None, "finish_reason": finish if k == len(deltas) - 1 else None}
        await send(resp, protocol.envelope(rid, model, req.chat, [piece], True, created=req.created))


def _usage_so_far(latest: dict[int, RequestOutput], per: int) -> dict[str, int]:
    """Usage over the outputs so far: a prompt once (its sample 0, always the first to start), every sample's tokens."""
    prompt = sum(len(out.prompt_token_ids) for i, out in latest.items() if i % per == 0)
    completion = sum(len(out.outputs[0].token_ids) for out in latest.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def merge(streams: list[OutputStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as (index, output), in arrival order."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

    async def pump(i: int, s: OutputStream) -> None:
        try:
            async for out in s:
                await queue.put((i, out))
        except BaseException as e:  # hand errors (bad input, dead engine) to the consumer
            await queue.put(e)
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        done = 0
        while done < len(streams):
            item = await queue.get()
            if item is None:
                done += 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)


async def send(resp: web.StreamResponse, obj: dict[str, Any]) -> None:
    """One SSE event carrying obj as compact JSON."""
    await resp.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")
