"""What the HTTP routes share: the engine front, the model's name and tokenizer, the role and its limits."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Callable

from ..model.tokenizer import Tokenizer
from .async_engine import AsyncEngine
from .inputs import default_max_request_bytes


@dataclasses.dataclass
class ServerState:
    """What the routes share. role: "both" (a plain or one-process PD engine), "prefill" or "decode";
    prefill_url: where a decode role fetches handoffs (None: it prefills itself); prefill_timeout: seconds it waits
    for one (None: as long as the request may run). request_timeout: seconds before a request is aborted (None:
    never). on_engine_death: called once if the engine stops on its own (the server's exit). max_request_bytes: a larger body is refused (413) before it is
    parsed (None: `default_max_request_bytes`)."""

    front: AsyncEngine
    model_name: str
    tokenizer: Tokenizer | None
    role: str = "both"
    prefill_url: str | None = None
    request_timeout: float | None = None
    prefill_timeout: float | None = None
    shutdown_abort: bool = True
    max_request_bytes: int | None = None
    http: object = None  # httpx.AsyncClient of a decode role with a prefill_url
    staging: asyncio.Semaphore | None = None  # a decode role's handoffs on the device ahead of their import
    on_engine_death: Callable[[], None] | None = None
    engine_died: bool = False  # the engine stopped on its own (a failed step, its process killed)

    @property
    def max_model_len(self) -> int:
        return self.front.validator.ecfg.max_model_len

    def body_limit(self) -> int:
        if self.max_request_bytes is not None:
            return self.max_request_bytes
        return default_max_request_bytes(self.max_model_len, self.tokenizer.max_token_bytes if self.tokenizer else None)
