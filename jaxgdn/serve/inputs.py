"""What the server does to a request's bytes before the engine sees them, off the event loop or bounded: a
body-size limit enforced before parsing, texts that cannot fit refused before tokenizing, tokenizing in a
worker thread."""

from __future__ import annotations

import asyncio
import json
from typing import Callable

from starlette.exceptions import HTTPException

from ..model.tokenizer import Tokenizer
from .protocol import BadRequest, error_body


def default_max_request_bytes(max_model_len: int, max_token_bytes: int | None) -> int:
    """Room for a batch of 16 prompts of max_model_len tokens as JSON (with escapes), at least 1 MiB: parsing
    a body holds the event loop, so one far beyond what can fit is refused unread."""
    return max(1 << 20, 16 * max_model_len * max(max_token_bytes or 0, 16))


class BodyLimit:
    """ASGI middleware: a request body past `limit()` bytes gets 413 in OpenAI's shape before anything parses
    it (a Content-Length over it at once, else as soon as that many bytes arrived). Handoff bytes are exempt."""

    def __init__(self, app, limit: Callable[[], int], exempt: tuple[str, ...] = ("/v1/handoff",)):
        self.app, self.limit, self.exempt = app, limit, exempt

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.exempt:
            return await self.app(scope, receive, send)
        limit = self.limit()
        too_large = f"request body larger than {limit} bytes (the server's --max-request-bytes)"
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > limit:
            body = json.dumps(error_body(too_large)).encode()
            await send({"type": "http.response.start", "status": 413,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
            return await send({"type": "http.response.body", "body": body})
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:  # the route's body read raises it; the HTTPException handler answers
                raise HTTPException(413, too_large)
            return message

        await self.app(scope, counted, send)


def check_text_fits(tokenizer: Tokenizer | None, max_len: int, num_chars: int, param: str) -> None:
    """Refuse, before tokenizing, a text too long to fit max_model_len whatever its tokens (each token stands
    for at most `max_token_bytes` bytes, and a character for at least one)."""
    per_token = tokenizer.max_token_bytes if tokenizer else None
    if per_token and num_chars > max_len * per_token:
        raise BadRequest(f"{param}: {num_chars} characters are more tokens than max_model_len {max_len} holds "
                         f"(a token of this model covers at most {per_token} bytes)", param)


async def encode_text(tokenizer: Tokenizer | None, max_len: int, text: str, param: str) -> list[int]:
    """The token ids of a text, tokenized in a worker thread (the tokenizer releases the GIL), so a long prompt
    never stalls the event loop; a text that cannot fit, or is not valid Unicode, is refused first."""
    if tokenizer is None:
        raise BadRequest("this model has no tokenizer; send token ids as the prompt", param)
    check_text_fits(tokenizer, max_len, len(text), param)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate ("\ud800") that JSON escapes can carry
        raise BadRequest(f"{param} is not valid Unicode: {e.reason} at character {e.start}", param) from None
    ids = await asyncio.to_thread(tokenizer.encode, text)
    if len(ids) >= max_len:  # said before any per-token work on the event loop
        raise BadRequest(f"prompt of {len(ids)} tokens leaves no room under max_model_len {max_len}", param)
    return ids


async def prompt_ids(tokenizer: Tokenizer | None, max_len: int, prompt) -> list[list[int]]:
    """The token ids of each prompt of a completion request (text needs the model's tokenizer)."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise BadRequest("prompt is empty", "prompt")
    return [await encode_text(tokenizer, max_len, p, "prompt") if isinstance(p, str) else [int(t) for t in p]
            for p in prompt]
