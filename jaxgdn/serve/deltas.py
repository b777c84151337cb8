"""What a request's consumer gets from an engine front (AsyncEngine, or EngineClient of the engine process): its
Deltas, the errors that refuse it, and the async iteration with its timeout."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import AsyncIterator, Callable

from ..engine.pd import Handoff
from ..engine.request import RequestOutput


@dataclasses.dataclass
class Delta:
    """What one request produced since its last delta. The last delta of a request has finish_reason set
    ("stop", "length", "abort", "error" with `error`, or "handoff" with `handoff` in a prefill role) and the
    whole `output`."""

    token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None
    handoff: Handoff | None = None
    output: RequestOutput | None = None
    num_cached_tokens: int = 0  # of its prompt, found in the prefix cache
    logprobs: list | None = None  # with SamplingParams.logprobs: the raw entry of each of token_ids (logprobs.py)
    prompt_logprobs: list | None = None  # with SamplingParams.prompt_logprobs: the prompt's, in the first delta

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def then(self, later: "Delta") -> "Delta":
        """This delta followed by a later one of the same request, as one."""
        logprobs = None if self.logprobs is None and later.logprobs is None else (
            (self.logprobs or []) + (later.logprobs or []))
        return Delta(self.token_ids + later.token_ids, later.finish_reason, later.error, later.handoff, later.output,
                     max(self.num_cached_tokens, later.num_cached_tokens), logprobs,
                     self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs)


class RequestTimedOut(RuntimeError):
    """A request ran past its timeout and was aborted."""


class EngineDead(RuntimeError):
    """The engine thread stopped (shut down, or a step raised): no request can be served."""


class EngineFull(RuntimeError):
    """The server holds max_waiting requests beyond its running ones: refuse (HTTP 429) rather than queue."""


async def stream_deltas(deltas: asyncio.Queue, abort: Callable[[], None], timeout: float | None) -> AsyncIterator[Delta]:
    """A request's deltas from the queue its engine fills, the last one finished; what piled up while the
    consumer was busy comes as one delta. Leaving early calls abort(); past timeout seconds it aborts, yields
    the tokens made meanwhile (unfinished) and raises RequestTimedOut."""
    finished = False
    try:
        async with asyncio.timeout(timeout):
            while not finished:
                delta = await deltas.get()
                while not delta.finished and not deltas.empty():
                    delta = delta.then(deltas.get_nowait())
                finished = delta.finished
                yield delta
    except TimeoutError:
        abort()
        produced: list[int] = []
        while not finished:  # the abort's last delta carries what was produced
            delta = await deltas.get()
            finished = delta.finished
            produced += delta.token_ids
        if produced:
            yield Delta(produced)
        raise RequestTimedOut(f"the request ran past the server's --request-timeout of {timeout:g} s") from None
    finally:
        if not finished:
            abort()


def fill_queues(items: list[tuple[asyncio.Queue, Delta]]) -> None:
    for q, delta in items:
        q.put_nowait(delta)


def call_on(loop: asyncio.AbstractEventLoop, fn, arg) -> None:
    try:
        loop.call_soon_threadsafe(fn, arg)
    except RuntimeError:  # the loop is closed: nobody waits for these deltas any more
        pass
