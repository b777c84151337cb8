"""The OpenAI-compatible HTTP app (FastAPI) over an AsyncEngine.

Endpoints: /v1/completions and /v1/chat/completions (stream=true: server-sent events), /v1/models, /health,
/metrics (Prometheus text), /tokenize, /detokenize, /tokenizer_info (vLLM's). A prefill role serves /v1/prefill
instead of the OpenAI endpoints: a prompt in, its Handoff's bytes out. A decode role given a prefill URL fetches each prompt's Handoff from there, so it
serves the one OpenAI endpoint of a PD deployment (as vLLM's disaggregated proxy does).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ..engine.pd import Handoff
from ..engine.request import SamplingParams
from ..engine.workers import needs_prefill
from ..model.tokenizer import Tokenizer
from .async_engine import AsyncEngine, EngineDead, EngineFull, RequestTimedOut
from .inputs import BodyLimit, check_text_fits, default_max_request_bytes, encode_text, prompt_ids
from .metrics import prometheus_text
from .openai_logprobs import CompletionLogprobs, choice_chat_logprobs, choice_completion_logprobs, prompt_logprobs_json
from .protocol import BadRequest, ChatRequest, CompletionRequest, SamplingFields, error_body
from .text import TextStream, render_chat
from .tokenize_routes import add_tokenizer_routes

logger = logging.getLogger("jaxgdn.serve")


@dataclasses.dataclass
class ServerState:
    """What the routes share. role: "both" (a plain or one-process PD engine), "prefill" or "decode";
    prefill_url: where a decode role fetches handoffs (None: it prefills itself). request_timeout: seconds
    before a request is aborted (None: never). max_request_bytes: a larger body is refused (413) before it is
    parsed (None: `default_max_request_bytes`)."""

    front: AsyncEngine
    model_name: str
    tokenizer: Tokenizer | None
    role: str = "both"
    prefill_url: str | None = None
    request_timeout: float | None = None
    shutdown_abort: bool = True
    max_request_bytes: int | None = None
    http: object = None  # httpx.AsyncClient of a decode role with a prefill_url
    staging: asyncio.Semaphore | None = None  # a decode role's handoffs on the device ahead of their import

    @property
    def max_model_len(self) -> int:
        return self.front.validator.ecfg.max_model_len

    def body_limit(self) -> int:
        if self.max_request_bytes is not None:
            return self.max_request_bytes
        return default_max_request_bytes(self.max_model_len, self.tokenizer.max_token_bytes if self.tokenizer else None)


@dataclasses.dataclass
class _Choice:
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


def build_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if state.role == "decode" and state.prefill_url:
            import httpx

            state.http = httpx.AsyncClient(base_url=state.prefill_url, timeout=None)
        if state.role == "decode":
            state.staging = asyncio.Semaphore(max(1, state.front.engine.role.staged_handoffs))
        yield
        # uvicorn has let the open requests finish (or its graceful timeout ran out): abort the rest
        state.front.shutdown(abort=state.shutdown_abort)
        if state.http is not None:
            await state.http.aclose()

    app = FastAPI(title="jaxgdn", lifespan=lifespan)
    app.state.jaxgdn = state
    app.add_middleware(BodyLimit, limit=state.body_limit)

    @app.exception_handler(BadRequest)
    async def _bad_request(_, e: BadRequest):
        return JSONResponse(error_body(str(e), e.kind, e.param), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return JSONResponse(error_body(f"{where or 'body'}: {first.get('msg', 'invalid request')}", param=where),
                            status_code=400)

    @app.exception_handler(HTTPException)
    async def _http_error(_, e: HTTPException):  # a body that does not parse, an unknown route, a wrong method
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(e.detail), kind), status_code=e.status_code, headers=e.headers)

    @app.get("/health")
    async def health():
        if not state.front.alive:
            return JSONResponse({"status": "dead", "error": repr(state.front.error)}, status_code=503)
        return {"status": "ok", "role": state.role}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(state.front.snapshot, state.role),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        ecfg = state.front.validator.ecfg
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": 0,
                                            "owned_by": "jaxgdn", "max_model_len": ecfg.max_model_len}]}

    add_tokenizer_routes(app, state)

    if state.role == "prefill":
        @app.post("/v1/prefill")
        async def prefill(request: Request):
            """{"prompt_token_ids": [...], "sampling_params": {...}} -> the request's Handoff bytes."""
            try:
                body = await request.json()
                ids = [int(t) for t in body["prompt_token_ids"]]
                fields = dict(body.get("sampling_params", {}))
                sp = SamplingParams(**{**fields, "stop_token_ids": tuple(fields.get("stop_token_ids", ()))})
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                raise BadRequest(f"bad prefill request: {e!r}") from None
            _check(state, ids, sp)
            if len(ids) < 2:
                raise BadRequest("nothing to prefill: a prompt of one token goes straight to the decode server",
                                 "prompt_token_ids")
            async for delta in _generate(state, ids, sp):
                if delta.handoff is not None:
                    return Response(delta.handoff.to_bytes(), media_type="application/octet-stream")
                if delta.finished:
                    raise BadRequest(delta.error or f"prefill ended: {delta.finish_reason}", status=500,
                                     kind="server_error")
        return app

    if state.role == "decode":
        @app.post("/v1/handoff")
        async def handoff(request: Request):
            """A prefilled request pushed as Handoff bytes (a prefill server's /v1/prefill answer): its
            completion, with the sampling parameters the handoff carries."""
            try:
                h = Handoff.from_bytes(await request.body())
            except ValueError as e:
                raise BadRequest(f"bad handoff: {e}") from None
            problem = state.front.engine.check(h)
            if problem:
                raise BadRequest(problem)
            decode = state.tokenizer.decode if state.tokenizer else None
            c = _Choice(0, list(h.prompt_token_ids), h.sampling_params, TextStream(decode), handoff=h)
            return await _respond(state, SamplingFields(), [c], chat=False)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompts = await prompt_ids(state.tokenizer, state.max_model_len, body.prompt)
        choices = _choices(state, body, prompts, 16)
        return await _respond(state, body, choices, chat=False, http_request=request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        tok = state.tokenizer
        if tok is None or not tok.chat_template:
            raise BadRequest(f"model {state.model_name} has no chat template (chat_template.jinja); use /v1/completions")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        check_text_fits(tok, state.max_model_len, sum(len(m["content"]) for m in messages), "messages")
        try:  # a long conversation renders off the event loop
            text = await asyncio.to_thread(render_chat, tok.chat_template, messages)
        except BadRequest:
            raise
        except Exception as e:  # noqa: BLE001 - a template error is the request's
            raise BadRequest(f"chat template failed on these messages: {e}", "messages") from None
        if body.max_completion_tokens and not body.max_tokens:
            body.max_tokens = body.max_completion_tokens
        ids = await encode_text(tok, state.max_model_len, text, "messages")
        choices = _choices(state, body, [ids], None)
        return await _respond(state, body, choices, chat=True, http_request=request)

    return app


# ------------------------------------------------------------------------------------------ requests
def _check(state: ServerState, ids: list[int], sp: SamplingParams) -> None:
    problem = state.front.validator.validate(ids, sp)
    if problem:
        field = problem.split(":")[0] if problem.startswith("logit_bias") else None
        raise BadRequest(problem, field or ("prompt" if "prompt" in problem or "token" in problem else None))


def _choices(state: ServerState, body: SamplingFields, prompts: list[list[int]],
             default_max_tokens: int | None) -> list[_Choice]:
    if body.model is not None and body.model != state.model_name:
        raise BadRequest(f"model {body.model!r} is not served here; this server serves {state.model_name!r}",
                         "model", kind="invalid_request_error")
    body.check_unsupported()
    max_len = state.front.validator.ecfg.max_model_len
    decode = state.tokenizer.decode if state.tokenizer else None
    choices = []
    for p, ids in enumerate(prompts):
        room = max(1, max_len - len(ids))
        if body.max_tokens is not None and len(ids) < max_len < len(ids) + body.max_tokens:  # vLLM's rule
            raise BadRequest(f"this model's maximum context length is {max_len} tokens; the prompt has "
                             f"{len(ids)} and max_tokens asks for {body.max_tokens} more", "max_tokens")
        for j in range(body.n):
            sp = body.sampling_params(j, min(default_max_tokens or room, room))
            _check(state, ids, sp)
            choices.append(_Choice(p * body.n + j, ids, sp, TextStream(decode, body.stop_strings),
                                   echo=bool(getattr(body, "echo", False)), score_only=body.scores_prompt_only))
    return choices


async def _generate(state: ServerState, ids: list[int], sp: SamplingParams, handoff: Handoff | None = None
                    ) -> AsyncIterator:
    """The request's deltas; a decode role with a prefill URL fetches the prompt's handoff first."""
    if handoff is not None:
        ids = None
    elif state.http is not None and needs_prefill(ids):
        import httpx

        try:
            r = await state.http.post("/v1/prefill", json={"prompt_token_ids": ids,
                                                           "sampling_params": dataclasses.asdict(sp)})
        except httpx.HTTPError as e:
            raise BadRequest(f"prefill server {state.prefill_url} unreachable: {e!r}", status=502,
                             kind="server_error") from None
        if r.status_code != 200:
            raise BadRequest(f"prefill server: {r.text}", status=502, kind="server_error")
        try:
            handoff = Handoff.from_bytes(r.content)
        except ValueError as e:
            raise BadRequest(f"prefill server sent a bad handoff: {e}", status=502, kind="server_error") from None
        ids = None
    staged = False
    try:
        if handoff is not None and state.staging is not None:
            await state.staging.acquire()
            staged = True
            await _stage(state, handoff)
        async for delta in state.front.generate(ids, sp, handoff=handoff, timeout=state.request_timeout):
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


async def _stage(state: ServerState, handoff: Handoff) -> None:
    """Copy a decode role's handoff to the device off the event loop and the engine thread (its pages padded to the
    import program's bucket), so the engine thread only imports it. A handoff the engine cannot import is left as it
    is: its request fails there with the reason."""
    engine = state.front.engine
    if engine.check(handoff) is not None:
        return
    pages = handoff.num_pages(engine.ecfg.kv_page_size)
    arrays = await asyncio.to_thread(engine.copies.stage, handoff.arrays, pages)
    for name, array in zip(Handoff.ARRAYS, arrays):
        setattr(handoff, name, array)
    handoff.valid_pages = pages


async def _run_choice(state: ServerState, c: _Choice, on_text=None) -> None:
    """Run one choice to its end, calling on_text(choice, text, token_ids) for what it may send as it goes;
    a stop string ends it early (finish_reason "stop")."""
    gen = _generate(state, c.prompt_ids, c.params, c.handoff)
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


def _usage(choices: list[_Choice]) -> dict:
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


async def _respond(state: ServerState, body: SamplingFields, choices: list[_Choice], chat: bool,
                   http_request: Request | None = None):
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created, kind = int(time.time()), "chat.completion" if chat else "text_completion"
    if not body.stream:
        tasks = [asyncio.create_task(_run_choice(state, c)) for c in choices]
        try:
            pending = set(tasks)
            while pending:
                done, pending = await asyncio.wait(pending, timeout=0.25, return_when=asyncio.FIRST_EXCEPTION)
                for t in done:
                    t.result()  # a refused choice (429, 408, 502) raises its BadRequest here
                if pending and http_request is not None and await http_request.is_disconnected():
                    logger.info("%s: the client hung up; its %d choice(s) are aborted", rid, len(pending))
                    return Response(status_code=499)  # nobody reads it; every choice is aborted below
        finally:  # the client gone, a choice refused or the handler cancelled: every choice stops
            _cancel(tasks)
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

    def on_text(c: _Choice, text: str, token_ids: list[int], entries: list):
        queue.put_nowait((c, text, token_ids, c.finish_reason, entries))

    async def run(c: _Choice):
        try:
            await _run_choice(state, c, on_text)
        except BadRequest as e:  # the stream ends with an error event (what OpenAI's clients raise on)
            queue.put_nowait((c, e, [], None, []))

    def chunk(c: _Choice, text: str, token_ids: list[int], finish_reason: str | None, first: bool,
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
            _cancel(tasks)

    return StreamingResponse(events(), media_type="text/event-stream")


def _decode(state: ServerState):
    """One token's (or a prompt's) text; empty without a tokenizer."""
    return state.tokenizer.decode if state.tokenizer else (lambda ids: "")  # noqa: E731


def _echo_text(state: ServerState, c: _Choice) -> str:
    return _decode(state)(c.prompt_ids) if c.echo else ""


def _cancel(tasks: list[asyncio.Task]) -> None:
    """Cancel the tasks of a request's choices; what they end with is retrieved, so nothing is logged."""
    for t in tasks:
        t.cancel()
        t.add_done_callback(lambda t: t.cancelled() or t.exception())
