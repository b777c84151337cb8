"""Serving one OpenAI request: its choices run through the engine front (a decode role with a prefill URL fetches
each prompt's Handoff first), then answered whole or streamed as server-sent events."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from ..engine.pd import Handoff
from ..engine.request import SamplingParams
from ..engine.workers import needs_prefill
from .deltas import EngineDead, EngineFull, RequestTimedOut
from .openai_logprobs import CompletionLogprobs, choice_chat_logprobs, choice_completion_logprobs, prompt_logprobs_json
from .protocol import BadRequest, SamplingFields, error_body
from .server_state import ServerState
from .text import TextStream

logger = logging.getLogger("jaxgdn.serve")


@dataclasses.dataclass
class Choice:
    """One choice of a response: its prompt's ids and parameters, and what it produced."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams
    text: TextStream
    token_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    handoff: Handoff | None = None  # a request pushed to a decode role prefilled
    cached_tokens: int = 0  # of its prompt, found in the prefix cache
    echo: bool = False  # /v1/completions' echo: the prompt's text (and logprobs) come first
    score_only: bool = False  # max_tokens 0 with echo: nothing generated is kept
    entries: list = dataclasses.field(default_factory=list)  # logprobs' raw entries, one per token of token_ids
    prompt_entries: list | None = None  # prompt logprobs' raw entries (None at position 0)
    completion_logprobs: CompletionLogprobs | None = None  # a stream's, keeping the text offset between chunks


async def generate(state: ServerState, ids: list[int], sp: SamplingParams, handoff: Handoff | None = None
                   ) -> AsyncIterator:
    """The request's deltas; a decode role with a prefill URL fetches the prompt's handoff first."""
    started = None
    if handoff is not None:
        ids = None
    elif state.http is not None and needs_prefill(ids):
        started = time.monotonic()
        handoff, ids = await fetch_handoff(state, ids, sp), None
    staged, timeout = False, state.request_timeout
    if timeout is not None and started is not None:  # the prefill server's time counts against the request's
        timeout = max(0.0, timeout - (time.monotonic() - started))
    try:
        if handoff is not None and state.staging is not None:
            await state.staging.acquire()
            staged = True
            await stage(state, handoff)
        async for delta in state.front.generate(ids, sp, handoff=handoff, timeout=timeout):
            if staged:  # its first delta comes after its import: the staged arrays are free
                state.staging.release()
                staged = False
            yield delta
    except EngineFull as e:
        raise BadRequest(str(e), status=429, kind="rate_limit_error") from None
    except EngineDead as e:
        raise BadRequest(str(e), status=503, kind="server_error") from None
    except RequestTimedOut as e:
        raise BadRequest(str(e), status=408, kind="timeout_error") from None
    finally:
        if staged:
            state.staging.release()


async def fetch_handoff(state: ServerState, ids: list[int], sp: SamplingParams) -> Handoff:
    """A decode role's handoff of a prompt from its prefill server; BadRequest 502 when that server is unreachable,
    fails or dies mid-request, 504 when it sends nothing within the prefill (or request) timeout."""
    import httpx

    limits = [t for t in (state.prefill_timeout, state.request_timeout) if t is not None]
    timeout = min(limits) if limits else None
    try:
        r = await state.http.post("/v1/prefill", json={"prompt_token_ids": ids, "sampling_params": dataclasses.asdict(sp)},
                                  timeout=timeout)
    except httpx.TimeoutException:
        raise BadRequest(f"the prefill server {state.prefill_url} sent no handoff within {timeout:g} s", status=504,
                         kind="timeout_error") from None
    except httpx.HTTPError as e:
        raise BadRequest(f"the prefill server {state.prefill_url} is unreachable or failed mid-request: {e!r}",
                         status=502, kind="server_error") from None
    if r.status_code == 429:  # full: the client may retry later, as with this server's own 429
        raise BadRequest(f"the prefill server is full: {r.text[:500]}", status=429, kind="rate_limit_error")
    if r.status_code != 200:
        raise BadRequest(f"the prefill server answered {r.status_code}: {r.text[:500]}", status=502, kind="server_error")
    try:
        return Handoff.from_bytes(r.content)
    except ValueError as e:
        raise BadRequest(f"the prefill server sent a bad handoff: {e}", status=502, kind="server_error") from None


async def until_done_or_gone(tasks: list[asyncio.Task], http_request: Request | None) -> bool:
    """Wait for tasks, raising the first one's error; False as soon as the client has hung up (tasks left running:
    the caller cancels them)."""
    pending = set(tasks)
    while pending:
        done, pending = await asyncio.wait(pending, timeout=0.25, return_when=asyncio.FIRST_EXCEPTION)
        for t in done:
            t.result()  # a refused choice (429, 408, 502) raises its BadRequest here
        if pending and http_request is not None and await http_request.is_disconnected():
            return False
    return True


async def stage(state: ServerState, handoff: Handoff) -> None:
    """Copy a decode role's handoff to the device off the event loop and the engine thread (its pages padded to the
    import program's bucket), so the engine thread only imports it. A handoff the engine cannot import is left as it
    is: its request fails there with the reason."""
    engine = state.front.engine
    if engine.role.check(handoff) is not None:
        return
    pages = handoff.num_pages(engine.ecfg.kv_page_size)
    arrays = await asyncio.to_thread(engine.copies.stage, handoff.arrays, pages)
    for name, array in zip(Handoff.ARRAYS, arrays):
        setattr(handoff, name, array)
    handoff.valid_pages = pages


async def run_choice(state: ServerState, c: Choice, on_text=None) -> None:
    """Run one choice to its end, calling on_text(choice, text, token_ids) for what it may send as it goes;
    a stop string ends it early (finish_reason "stop")."""
    gen = generate(state, c.prompt_ids, c.params, c.handoff)
    try:
        async for delta in gen:
            if delta.prompt_logprobs is not None:
                c.prompt_entries = delta.prompt_logprobs
            if c.score_only:  # the prompt was scored with its first token; that token is not kept
                c.finish_reason, c.error = ("error", delta.error) if delta.finish_reason == "error" else ("length", None)
                if on_text is not None:
                    on_text(c, "", [], [])
                break
            c.token_ids += delta.token_ids
            c.entries += delta.logprobs or []
            c.cached_tokens = max(c.cached_tokens, delta.num_cached_tokens)
            text = c.text.add(delta.token_ids, final=delta.finished)
            if c.text.stopped:
                c.finish_reason = "stop"
            elif delta.finished:
                c.finish_reason, c.error = delta.finish_reason, delta.error
            if text or delta.token_ids or c.finish_reason:
                if on_text is not None:
                    on_text(c, text, delta.token_ids, delta.logprobs or [])
            if c.finish_reason:
                break
    finally:
        await gen.aclose()  # a stop string (or a client gone) aborts the engine's request


def _usage(choices: list[Choice]) -> dict:
    """OpenAI's usage: a prompt shared by several choices counts once, with its cached tokens as found by the
    choice that found most."""
    prompts: dict[int, tuple[int, int]] = {}  # id of the prompt -> (its tokens, cached)
    for c in choices:
        n, cached = prompts.get(id(c.prompt_ids), (len(c.prompt_ids), 0))
        prompts[id(c.prompt_ids)] = (n, max(cached, c.cached_tokens))
    prompt = sum(n for n, _ in prompts.values())
    completion = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(cached for _, cached in prompts.values())}}


async def respond(state: ServerState, body: SamplingFields, choices: list[Choice], chat: bool,
                   http_request: Request | None = None):
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created, kind = int(time.time()), "chat.completion" if chat else "text_completion"
    if not body.stream:
        tasks = [asyncio.create_task(run_choice(state, c)) for c in choices]
        try:
            if not await until_done_or_gone(tasks, http_request):
                logger.info("%s: the client hung up; its choices are aborted", rid)
                return Response(status_code=499)  # nobody reads it; every choice is aborted below
        finally:  # the client gone, a choice refused or the handler cancelled: every choice stops
            cancel_tasks(tasks)
        failed = [c for c in choices if c.finish_reason == "error"]
        if failed:
            raise BadRequest(failed[0].error or "request failed", status=500, kind="server_error")
        out = []
        for c in choices:
            item = {"index": c.index, "finish_reason": c.finish_reason, "token_ids": c.token_ids}
            if chat:
                item["message"] = {"role": "assistant", "content": c.text.text}
                item["logprobs"] = choice_chat_logprobs(_decode(state), c, c.token_ids, c.entries)
            else:
                item |= {"text": _echo_text(state, c) + c.text.text,
                         "logprobs": choice_completion_logprobs(_decode(state), c, c.token_ids, c.entries, first=True)}
            if c.prompt_entries is not None and not c.echo:
                item["prompt_logprobs"] = prompt_logprobs_json(_decode(state), c.prompt_entries)
            out.append(item)
        return {"id": rid, "object": kind, "created": created, "model": state.model_name, "choices": out,
                "usage": _usage(choices)}

    # a full or stopped engine answers with a status before the stream starts
    if not state.front.alive:
        raise BadRequest("the engine is not running", status=503, kind="server_error")
    if state.front.full:
        raise BadRequest("the server is full; try again later", status=429, kind="rate_limit_error")
    queue: asyncio.Queue = asyncio.Queue()  # (choice, text or the BadRequest that ends the stream, ids, reason)

    def on_text(c: Choice, text: str, token_ids: list[int], entries: list):
        queue.put_nowait((c, text, token_ids, c.finish_reason, entries))

    async def run(c: Choice):
        try:
            await run_choice(state, c, on_text)
        except BadRequest as e:  # the stream ends with an error event (what OpenAI's clients raise on)
            queue.put_nowait((c, e, [], None, []))

    def chunk(c: Choice, text: str, token_ids: list[int], finish_reason: str | None, first: bool,
              entries: list) -> str:
        if chat:
            delta = ({"role": "assistant", "content": text} if first else {"content": text})
            item = {"index": c.index, "delta": delta, "logprobs": choice_chat_logprobs(_decode(state), c, token_ids, entries)}
        else:
            item = {"index": c.index, "text": (_echo_text(state, c) if first else "") + text,
                    "logprobs": choice_completion_logprobs(_decode(state), c, token_ids, entries, first)}
        item |= {"finish_reason": finish_reason, "token_ids": token_ids}
        if finish_reason and c.error:
            item["error"] = c.error
        obj = {"id": rid, "object": kind + (".chunk" if chat else ""), "created": created,
               "model": state.model_name, "choices": [item]}
        return f"data: {json.dumps(obj)}\n\n"

    async def events():
        tasks = [asyncio.create_task(run(c)) for c in choices]
        started: set[int] = set()
        try:
            left = len(choices)
            while left:
                items = [await queue.get()]
                while not queue.empty():  # everything that is ready goes out in one write
                    items.append(queue.get_nowait())
                out = []
                for c, text, token_ids, finish_reason, entries in items:
                    if isinstance(text, BadRequest):
                        out.append(f"data: {json.dumps(error_body(str(text), text.kind, text.param, str(text.status)))}\n\n")
                        left = 0
                        break
                    out.append(chunk(c, text, token_ids, finish_reason, c.index not in started, entries))
                    started.add(c.index)
                    left -= finish_reason is not None
                yield "".join(out)
            if body.stream_options and body.stream_options.include_usage:
                usage = {"id": rid, "object": kind + (".chunk" if chat else ""), "created": created,
                         "model": state.model_name, "choices": [], "usage": _usage(choices)}
                yield f"data: {json.dumps(usage)}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # the client left, or an error ended the stream: abort what runs
            cancel_tasks(tasks)

    return StreamingResponse(events(), media_type="text/event-stream")


def _decode(state: ServerState):
    """One token's (or a prompt's) text; empty without a tokenizer."""
    return state.tokenizer.decode if state.tokenizer else (lambda ids: "")  # noqa: E731


def _echo_text(state: ServerState, c: Choice) -> str:
    return _decode(state)(c.prompt_ids) if c.echo else ""


def cancel_tasks(tasks: list[asyncio.Task]) -> None:
    """Cancel the tasks of a request's choices; what they end with is retrieved, so nothing is logged."""
    for t in tasks:
        t.cancel()
        t.add_done_callback(lambda t: t.cancelled() or t.exception())
