"""AsyncEngine: one thread steps the engine continuously; requests are added and aborted from any thread or
asyncio task, and each request's new tokens are pushed to it after every step.

Setups: a plain engine; PD in one process (handoffs routed on the engine thread); a prefill role (requests end
in a Handoff); a decode role (fed Handoffs another process prefilled). Only the engine thread touches an engine.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import queue
import threading
import time
from typing import AsyncIterator, Callable

from ..engine.compile_times import CompileEvents
from ..engine.llm_engine import LLMEngine
from ..engine.pd import Handoff
from ..engine.request import PLACEHOLDER_TOKEN, SamplingParams
from ..engine.workers import DecodeRole, needs_prefill, step_pair
from .deltas import Delta, EngineDead, EngineFull, RequestTimedOut, call_on, fill_queues, stream_deltas

__all__ = ["AsyncEngine", "Delta", "EngineDead", "EngineFull", "RequestTimedOut"]

logger = logging.getLogger("jaxgdn.serve")


@dataclasses.dataclass(eq=False)
class _Stream:
    """A request's consumer: a callback run on the engine thread (sink), or an asyncio queue of an event loop,
    filled by one call on that loop per step for all of the loop's requests."""

    sink: Callable[[Delta], None] | None = None
    loop: asyncio.AbstractEventLoop | None = None
    queue: asyncio.Queue | None = None
    engine: LLMEngine | None = None  # where the request is now (a PD request moves from prefill to decode)
    rid: int = -1
    sent: int = 0  # output tokens already pushed


class AsyncEngine:
    """prefill: an engine with a PrefillRole (PD in one process with `engine` one with a DecodeRole; a prefill role
    alone); engine: an LLMEngine (any role). max_waiting: requests queued beyond the running ones before
    `submit` refuses more (EngineFull). on_emit: called on the engine thread after each step's deltas."""

    def __init__(self, engine: LLMEngine | None = None, prefill: LLMEngine | None = None, *,
                 max_waiting: int = 4096, on_emit: Callable[[], None] | None = None):
        if engine is None and prefill is None:
            raise ValueError("AsyncEngine needs an engine, a prefill worker, or both")
        if prefill is not None and engine is not None and not isinstance(engine.role, DecodeRole):
            raise ValueError("PD in one process needs a decode engine beside the prefill engine")
        self.engine, self.prefill, self.max_waiting = engine, prefill, max_waiting
        self.on_emit = on_emit  # called on the engine thread after each step's deltas went out
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[int, _Stream] = {}  # the live requests, by handle
        self._ids = itertools.count()
        self._pending = 0  # submitted, not yet finished (read from other threads for admission)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.stopped = False
        self.closing = False  # shutdown() called: no new requests
        self.counters = collections.Counter()  # prompt/generation tokens, finished requests by reason
        self._recent: collections.deque[tuple[float, int]] = collections.deque()  # (time, tokens) for tokens/s
        self.snapshot: dict = {}
        self.compile_events = CompileEvents()

    @property
    def engines(self) -> list[LLMEngine]:
        return [e for e in (self.prefill, self.engine) if e is not None]

    @property
    def validator(self) -> LLMEngine:
        """The engine whose validate() judges a request (same model and limits on both PD sides)."""
        return self.engine or self.prefill  # type: ignore[return-value]

    # ------------------------------------------------------------------------------------ any thread
    def start(self) -> "AsyncEngine":
        self.compile_events.start()  # the engines' start-up is over: any compile from here on is counted
        self._thread = threading.Thread(target=self._run, name="jaxgdn-engine", daemon=True)
        self._thread.start()
        self._publish()
        return self

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self.stopped

    def submit(self, prompt_token_ids: list[int] | None, params: SamplingParams, sink: Callable[[Delta], None],
               handoff: Handoff | None = None) -> int:
        """Queue a request (token ids, or a prefilled Handoff for a decode role); sink gets its deltas on the
        engine thread. Returns a handle for abort(). Raises EngineFull or EngineDead instead of queueing."""
        return self._submit(prompt_token_ids, params, _Stream(sink), handoff)

    def _submit(self, prompt_token_ids, params, stream: _Stream, handoff) -> int:
        if not self.alive or self.closing:
            raise EngineDead(f"the engine is not running ({self.error!r})" if self.error else "the engine is not running")
        with self._lock:
            if self.full:
                raise EngineFull(f"{self._pending} requests in the server; try again later")
            self._pending += 1
        handle = next(self._ids)
        self._inbox.put(("add", handle, stream, prompt_token_ids, params, handoff))
        return handle

    @property
    def full(self) -> bool:
        """max_waiting requests wait beyond a full running batch: submit refuses more."""
        return self._pending >= self.max_waiting + self.validator.ecfg.max_num_seqs

    def reset_prefix_cache(self, timeout: float = 60.0) -> bool:
        """Forget every cached prefix (on the engine thread, between steps); True once done, False if the engine
        is not running or did not get to it within timeout seconds."""
        if not self.alive:
            return False
        done = threading.Event()
        self._inbox.put(("reset", done))
        return done.wait(timeout)

    def abort(self, handle: int) -> None:
        """Finish the request now (finish_reason "abort"); its pages and slot are free on the next step."""
        self._inbox.put(("abort", handle))

    def shutdown(self, abort: bool = True, timeout: float | None = 30.0) -> None:
        """Stop the engine thread: abort the requests in flight (each gets its last delta), or with
        abort=False finish them first."""
        if self._thread is None:
            return
        self.closing = True
        self._inbox.put(("stop", abort))
        self._thread.join(timeout)

    async def generate(self, prompt_token_ids: list[int] | None, params: SamplingParams,
                       handoff: Handoff | None = None, timeout: float | None = None) -> AsyncIterator[Delta]:
        """The request's deltas as an async iterator, the last one finished. Leaving the iteration early
        (client gone, task cancelled) aborts the request; running past timeout seconds aborts it too, yields
        the tokens it made meanwhile (unfinished) and raises RequestTimedOut."""
        deltas: asyncio.Queue[Delta] = asyncio.Queue()
        handle = self._submit(prompt_token_ids, params, _Stream(loop=asyncio.get_running_loop(), queue=deltas), handoff)
        stream = stream_deltas(deltas, lambda: self.abort(handle), timeout)
        try:
            async for delta in stream:
                yield delta
        finally:  # closed early: the abort goes out now, not when the inner generator is collected
            await stream.aclose()

    # ------------------------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            stopping = None
            while True:
                busy = any(e.has_unfinished for e in self.engines)
                for cmd in self._commands(block=not busy and stopping is None):
                    if cmd[0] == "stop":
                        stopping = cmd[1]
                    else:
                        self._handle(cmd)
                if stopping is not None:
                    if stopping:
                        for handle in list(self._streams):
                            self._abort(handle)
                    if not any(e.has_unfinished for e in self.engines):
                        self._emit()
                        break
                self._step()
                self._emit()
                self._publish()
        except BaseException as e:  # a step failed: every request gets an error, the server reports unhealthy
            logger.exception("engine thread failed")
            self.error = e
            for s in self._streams.values():
                self._safe_sink(s, Delta([], "error", error=f"engine failure: {e!r}"))
            self._streams.clear()
        finally:
            self.stopped = True
            self.compile_events.stop()
            for e in self.engines:
                try:
                    e.flush()
                except Exception:  # noqa: BLE001 - a failed engine has nothing more to give
                    pass
            # requests that arrived after the loop ended
            while True:
                try:
                    cmd = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if cmd[0] == "add":
                    self._finished("abort")
                    self._safe_sink(cmd[2], Delta([], "abort", error="the server is shutting down"))

    def _commands(self, block: bool):
        """Every queued command; when block, wait for the first."""
        if block:
            for e in self.engines:
                e.flush()  # the launch of requests that all finished
            yield self._inbox.get()
        while True:
            try:
                yield self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd: tuple) -> None:
        if cmd[0] == "abort":
            self._abort(cmd[1])
            return
        if cmd[0] == "reset":
            for e in self.engines:
                e.reset_prefix_cache()
            self._publish()
            cmd[1].set()
            return
        _, handle, s, ids, params, handoff = cmd
        self._streams[handle] = s
        if handoff is not None:  # a decode role: the prompt's state arrives prefilled
            s.engine, s.rid = self.engine, self.engine.role.submit(handoff)
        elif self.prefill is not None and needs_prefill(ids, self.prefill.validate(ids, params)):
            s.engine, s.rid = self.prefill, self.prefill.role.submit(ids, params)
        elif self.engine is not None:  # also a 1-token or bad prompt under PD: nothing to prefill / fail there
            s.engine, s.rid = self.engine, self.engine.add_request(ids, params)
        else:  # a prefill role takes prompts it can prefill only (its route checks); anything else fails here
            error = self.prefill.validate(ids, params) or "nothing to prefill (a prompt of one token)"
            s.engine, s.rid = self.prefill, self.prefill.add_request(ids, params, error=error)
        req = s.engine.requests[s.rid]
        if req.error is None:
            self.counters["prompt_tokens"] += len(req.prompt_token_ids)

    def _abort(self, handle: int) -> None:
        s = self._streams.get(handle)
        if s is not None:
            s.engine.abort_request(s.rid)

    def _step(self) -> None:
        if self.prefill is not None and self.engine is not None:  # PD in one process
            step_pair(self.prefill, self.engine, self._route)
        elif self.prefill is not None:  # a prefill role (an idle engine's step schedules nothing)
            self.prefill.step()
            self._route(self.prefill.role.pop_handoffs())
        elif self.engine.has_unfinished:
            self.engine.step()

    def _route(self, handoffs: list[Handoff]) -> None:
        """Finished prompts of the prefill worker: to the decode worker in this process, or (a prefill role) out."""
        by_rid = {s.rid: (h, s) for h, s in self._streams.items() if s.engine is self.prefill} if handoffs else {}
        for handoff in handoffs:
            handle, s = by_rid[handoff.request_id]
            self.prefill.forget(s.rid)
            if self.engine is not None:  # PD in one process: the decode worker takes it on
                s.engine, s.rid = self.engine, self.engine.role.submit(handoff)
            else:  # a prefill role: gathered here, on the engine thread, for the route to send as bytes
                del self._streams[handle]
                self._finished("handoff")
                self._safe_sink(s, Delta([], "handoff", handoff=handoff.export()))

    def _emit(self) -> None:
        """Push every live request's new tokens; the last delta of the requests that finished. An event loop's
        requests get theirs in one call on that loop (one wake-up a step, not one a request)."""
        now, produced = time.perf_counter(), 0
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for handle, s in list(self._streams.items()):
            req = s.engine.requests[s.rid]
            out, end = req.output_token_ids, s.sent
            while end < len(out) and out[end] != PLACEHOLDER_TOKEN:  # async: values still on the device
                end += 1
            new, scores = out[s.sent:end], _scores(req, s.sent, end)
            s.sent = end
            produced += len(new)
            if req.finish_reason is not None:
                del self._streams[handle]
                output = s.engine.output(s.rid)
                s.engine.forget(s.rid)
                self._finished(req.finish_reason)
                self._safe_sink(s, Delta(new, req.finish_reason, error=req.error, output=output,
                                         num_cached_tokens=output.num_cached_tokens, **scores), batches)
            elif new:
                self._safe_sink(s, Delta(new, num_cached_tokens=req.num_cached_tokens or 0, **scores), batches)
        for loop, items in batches.items():
            call_on(loop, fill_queues, items)
        if self.on_emit is not None:
            self.on_emit()
        self.counters["generation_tokens"] += produced
        if produced:
            self._recent.append((now, produced))

    def _finished(self, reason: str) -> None:
        self.counters[f"finished_{reason}"] += 1
        with self._lock:
            self._pending -= 1

    @staticmethod
    def _safe_sink(s: _Stream, delta: Delta, batches: dict | None = None) -> None:
        if s.queue is not None:
            if batches is None:
                call_on(s.loop, s.queue.put_nowait, delta)
            else:
                batches.setdefault(s.loop, []).append((s.queue, delta))
            return
        try:
            s.sink(delta)
        except Exception:  # noqa: BLE001 - one client's callback never stops the engine
            logger.exception("a request's sink raised; its delta is dropped")

    def _publish(self, window: float = 10.0) -> None:
        """A snapshot of the engine's gauges for other threads (/metrics); tokens/s over the last window s."""
        now = time.perf_counter()
        while self._recent and self._recent[0][0] < now - window:
            self._recent.popleft()
        usage = collections.Counter()
        for e in self.engines:
            usage.update(e.usage())
        main = self.engine or self.prefill
        spec = main.update.spec_counters.metrics()
        self.snapshot = {
            **usage, **self.counters,
            "generation_tokens_per_s": sum(n for _, n in self._recent) / window,
            "compiles_after_startup": sum(e.compiles_after_startup for e in self.engines),
            "xla_compiles_after_startup": self.compile_events.count,
            "num_steps": sum(e.num_steps for e in self.engines),
            "spec_drafted": spec["num_drafted"], "spec_accepted": spec["num_accepted"],
            "prefix_cache_queries": main.prefix.stats.queries, "prefix_cache_hits": main.prefix.stats.hits,
            "prefix_cache_evicted_pages": main.prefix.pages.num_evicted,
        }


def _scores(req, start: int, end: int) -> dict:
    """Delta's logprobs fields for output tokens [start, end) of a request: their entries, and with the first
    delta the prompt's."""
    sp = req.sampling_params
    out = {}
    if sp.logprobs is not None:
        out["logprobs"] = req.sampled_logprobs[start:end]
    if sp.prompt_logprobs is not None and start == 0:
        out["prompt_logprobs"] = req.prompt_logprobs
    return out
