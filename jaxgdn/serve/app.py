"""The OpenAI-compatible HTTP app (FastAPI) over an AsyncEngine.

Endpoints: /v1/completions and /v1/chat/completions (stream=true: server-sent events), /v1/models, /health,
/metrics (Prometheus text), /tokenize, /detokenize, /tokenizer_info (vLLM's). A prefill role serves /v1/prefill
instead of the OpenAI endpoints: a prompt in, its Handoff's bytes out. A decode role given a prefill URL fetches each
prompt's Handoff from there, so it serves the one OpenAI endpoint of a PD deployment (as vLLM's disaggregated proxy
does). How a request is served and answered: responses.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException

from ..engine.pd import Handoff
from ..engine.request import SamplingParams
from ..engine.workers import needs_prefill
from .inputs import BodyLimit, check_text_fits, encode_text, prompt_ids
from .metrics import prometheus_text
from .protocol import BadRequest, ChatRequest, CompletionRequest, SamplingFields, error_body
from .responses import Choice, cancel_tasks, generate, respond, until_done_or_gone
from .server_state import ServerState
from .text import TextStream, render_chat
from .tokenize_routes import add_tokenizer_routes

__all__ = ["ServerState", "build_app"]
logger = logging.getLogger("jaxgdn.serve")


def build_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if state.role == "decode" and state.prefill_url:
            import httpx

            state.http = httpx.AsyncClient(base_url=state.prefill_url, timeout=None)
        if state.role == "decode":
            state.staging = asyncio.Semaphore(max(1, state.front.engine.role.staged_handoffs))
        watchdog = asyncio.create_task(_watch_engine(state)) if state.on_engine_death is not None else None
        yield
        if watchdog is not None:
            watchdog.cancel()
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

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        """Forget every cached prefix (vLLM's route); pages held by running requests stay theirs."""
        if not await asyncio.to_thread(state.front.reset_prefix_cache):
            raise BadRequest("the engine is not running", status=503, kind="server_error")
        return {"status": "ok"}

    add_tokenizer_routes(app, state)

    if state.role == "prefill":
        @app.post("/v1/prefill")
        async def prefill(request: Request):
            """{"prompt_token_ids": [...], "sampling_params": {...}} -> the request's Handoff bytes."""
            try:
                body = await request.json()
                ids = [int(t) for t in body["prompt_token_ids"]]
                sp = SamplingParams.from_dict(body.get("sampling_params", {}))
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                raise BadRequest(f"bad prefill request: {e!r}") from None
            _check(state, ids, sp)
            if not needs_prefill(ids):
                raise BadRequest("nothing to prefill: a prompt of one token goes straight to the decode server",
                                 "prompt_token_ids")
            task = asyncio.create_task(_handoff_bytes(state, ids, sp))
            try:
                if not await until_done_or_gone([task], request):  # its decode server gave up or died: abort
                    return Response(status_code=499)
            finally:
                cancel_tasks([task])
            return Response(task.result(), media_type="application/octet-stream")
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
            problem = state.front.engine.role.check(h)
            if problem:
                raise BadRequest(problem)
            decode = state.tokenizer.decode if state.tokenizer else None
            c = Choice(0, list(h.prompt_token_ids), h.sampling_params, TextStream(decode), handoff=h)
            return await respond(state, SamplingFields(), [c], chat=False)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompts = await prompt_ids(state.tokenizer, state.max_model_len, body.prompt)
        choices = _choices(state, body, prompts, 16)
        return await respond(state, body, choices, chat=False, http_request=request)

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
        return await respond(state, body, choices, chat=True, http_request=request)

    return app


async def _watch_engine(state: ServerState, period: float = 0.5) -> None:
    """Once the engine stops on its own (its requests in flight have failed), log why and call on_engine_death,
    which ends the server so a supervisor restarts it."""
    while state.front.alive or state.front.closing:
        await asyncio.sleep(period)
    state.engine_died = True
    logger.error("the engine stopped (%s); its requests in flight failed; the server exits so that a supervisor "
                 "can restart it", state.front.error)
    state.on_engine_death()


async def _handoff_bytes(state: ServerState, ids: list[int], sp: SamplingParams) -> bytes:
    async for delta in generate(state, ids, sp):
        if delta.handoff is not None:
            return delta.handoff.to_bytes()
        if delta.finished:
            raise BadRequest(delta.error or f"prefill ended: {delta.finish_reason}", status=500, kind="server_error")
    raise BadRequest("prefill ended without a handoff", status=500, kind="server_error")


# ------------------------------------------------------------------------------------------ requests
def _check(state: ServerState, ids: list[int], sp: SamplingParams) -> None:
    problem = state.front.validator.validate(ids, sp)
    if problem:
        field = problem.split(":")[0] if problem.startswith("logit_bias") else None
        raise BadRequest(problem, field or ("prompt" if "prompt" in problem or "token" in problem else None))


def _choices(state: ServerState, body: SamplingFields, prompts: list[list[int]],
             default_max_tokens: int | None) -> list[Choice]:
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
            choices.append(Choice(p * body.n + j, ids, sp, TextStream(decode, body.stop_strings),
                                   echo=bool(getattr(body, "echo", False)), score_only=body.scores_prompt_only))
    return choices
