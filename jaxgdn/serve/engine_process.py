"""The engine in a process of its own, as vLLM's engine core: the server's HTTP work (parsing, tokenizing,
detokenizing, JSON, one write per stream chunk) then never takes the GIL from the thread that steps the engine.

The engine process builds the LLM and steps it behind an AsyncEngine; the API process talks to it over a pipe:
requests and aborts one way, one message a step the other way with every request's new tokens (and the
engine's gauges for /metrics). `EngineClient` is the API process's side, with the AsyncEngine interface the
routes use (generate, alive, full, snapshot, validator, shutdown).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import multiprocessing
import signal
import threading
from typing import AsyncIterator

from ..engine.config import EngineConfig
from ..engine.request import SamplingParams, validate_request
from .deltas import Delta, EngineDead, EngineFull, call_on, fill_queues, stream_deltas

logger = logging.getLogger("jaxgdn.serve")
GAUGE_PERIOD_S = 0.5  # an idle engine still refreshes /metrics this often


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the API process checks a request against (the engine's validate() without the engine)."""

    ecfg: EngineConfig
    vocab_size: int

    def validate(self, ids: list[int], params: SamplingParams) -> str | None:
        return validate_request(ids, params, self.vocab_size, self.ecfg.max_model_len)


# ---------------------------------------------------------------------------------------------- engine process
def _engine_main(conn, model: str, config: EngineConfig, log_level: str) -> None:
    """The engine process: build the LLM, say "ready" (or "failed"), then serve the pipe's commands until
    "stop" or the API process is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the API process, which stops us
    logging.getLogger("jaxgdn").setLevel(log_level.upper())
    from ..llm import LLM
    from .async_engine import AsyncEngine

    try:
        llm = LLM(model, config)
    except Exception as e:  # noqa: BLE001 - the API process reports it and exits
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    outbox: list[tuple] = []
    lock, wake, send_lock = threading.Lock(), threading.Event(), threading.Lock()
    front = AsyncEngine(llm.engine, llm.prefill_worker, max_waiting=1 << 30, on_emit=wake.set).start()

    def send(message) -> None:
        with send_lock:
            conn.send(message)

    handles: dict[int, int] = {}  # the API process's handle -> the AsyncEngine's, while the request lives

    def sink(handle: int):
        def put(delta: Delta) -> None:
            with lock:
                outbox.append((handle, delta.token_ids, delta.finish_reason, delta.error, delta.num_cached_tokens,
                               delta.logprobs, delta.prompt_logprobs))
            if delta.finished:
                handles.pop(handle, None)
        return put

    def sender() -> None:  # one message a step: every request's new tokens, the gauges, whether the engine lives
        last = None
        while True:
            wake.wait(GAUGE_PERIOD_S)
            wake.clear()
            with lock:
                batch = outbox[:]
                outbox.clear()
            if batch or front.snapshot is not last or not front.alive:
                last = front.snapshot
                try:
                    send(("deltas", batch, last, front.alive, repr(front.error) if front.error else None))
                except OSError:  # the API process is gone
                    return

    threading.Thread(target=sender, name="jaxgdn-engine-sender", daemon=True).start()
    send(("ready", Limits(llm.config, llm.model_config.vocab_size)))
    while True:
        try:
            cmd = conn.recv()
        except (EOFError, OSError):
            front.shutdown(abort=True)
            return
        if cmd[0] == "add":
            _, handle, ids, params = cmd
            try:
                handles[handle] = front.submit(ids, params, sink(handle))
            except EngineDead as e:
                sink(handle)(Delta([], "error", error=str(e)))
                wake.set()
        elif cmd[0] == "abort":
            if cmd[1] in handles:
                front.abort(handles.pop(cmd[1]))
        elif cmd[0] == "reset":
            done = front.reset_prefix_cache()
            send(("reset", cmd[1], done, front.snapshot))
        else:  # ("stop", abort): the requests in flight get their last deltas before we go
            front.shutdown(abort=cmd[1], timeout=None)  # the engine thread has ended: no delta comes after these
            with lock:
                batch = outbox[:]
                outbox.clear()
            send(("deltas", batch, front.snapshot, False, None))
            send(("stopped",))
            return


# ---------------------------------------------------------------------------------------------- API process
class EngineClient:
    """The API process's side of the engine process (the AsyncEngine interface of the routes). Starting it
    builds the engine there (compiling every step program) and returns once it is ready; a configuration that
    cannot be built raises ValueError with the engine's message."""

    def __init__(self, model: str, config: EngineConfig, *, max_waiting: int = 4096,
                 log_level: str = "info"):
        ctx = multiprocessing.get_context("spawn")  # JAX and threads do not survive a fork
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_engine_main, args=(child, model, config, log_level),
                                   name="jaxgdn-engine", daemon=True)
        self.process.start()
        child.close()
        try:
            message = self._conn.recv()
        except EOFError:
            self.process.join(5)
            raise RuntimeError(f"the engine process exited during start-up (code {self.process.exitcode})") from None
        if message[0] == "failed":
            self.process.join(30)
            raise ValueError(message[1])
        self.validator: Limits = message[1]
        self.max_waiting = max_waiting
        self.snapshot: dict = {}
        self.error: str | None = None
        self.closing = False
        self._alive = True
        self._streams: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._send_lock = threading.Lock()
        self._stopped = threading.Event()
        self._resets: dict[int, tuple[threading.Event, list]] = {}  # reset_prefix_cache calls awaiting the answer
        self._reader = threading.Thread(target=self._read, name="jaxgdn-engine-reader", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self._alive and not self._stopped.is_set() and self.process.is_alive()

    @property
    def full(self) -> bool:
        """max_waiting requests wait beyond a full running batch: generate refuses more."""
        return len(self._streams) >= self.max_waiting + self.validator.ecfg.max_num_seqs

    def _send(self, message) -> None:
        with self._send_lock:
            self._conn.send(message)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, handoff=None,
                       timeout: float | None = None) -> AsyncIterator[Delta]:
        """As AsyncEngine.generate (handoffs are for a decode role, which runs its engine in-process)."""
        if handoff is not None:
            raise ValueError("the engine process serves prompts, not handoffs")
        if not self.alive or self.closing:
            raise EngineDead(f"the engine is not running ({self.error})" if self.error else "the engine is not running")
        if self.full:
            raise EngineFull(f"{len(self._streams)} requests in the server; try again later")
        handle, deltas = next(self._ids), asyncio.Queue()
        self._streams[handle] = (asyncio.get_running_loop(), deltas)
        try:
            self._send(("add", handle, list(prompt_token_ids), params))
        except OSError:
            self._streams.pop(handle, None)
            raise EngineDead("the engine process is gone") from None
        stream = stream_deltas(deltas, lambda: self._abort(handle), timeout)
        try:
            async for delta in stream:
                yield delta
        finally:
            await stream.aclose()

    def reset_prefix_cache(self, timeout: float = 60.0) -> bool:
        """AsyncEngine.reset_prefix_cache, in the engine process."""
        if not self.alive:
            return False
        token, answer = next(self._ids), (threading.Event(), [])
        self._resets[token] = answer
        try:
            self._send(("reset", token))
        except OSError:
            return False
        answered = answer[0].wait(timeout)
        self._resets.pop(token, None)
        return answered and answer[1][0]

    def _abort(self, handle: int) -> None:
        if handle in self._streams:
            try:
                self._send(("abort", handle))
            except OSError:
                pass

    def _read(self) -> None:
        """The reader thread: each step's deltas to their requests' event loops, one call a loop."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                self.process.join(5)  # its exit code, once it is reaped
                self._fail(f"the engine process exited (code {self.process.exitcode})")
                return
            if message[0] == "stopped":
                self._stopped.set()
                self._fail("the server is shutting down", reason="abort")
                return
            if message[0] == "reset":
                _, token, done, self.snapshot = message
                event, answer = self._resets.get(token, (None, []))
                if event is not None:
                    answer.append(done)
                    event.set()
                continue
            _, batch, self.snapshot, alive, error = message
            batches: dict[asyncio.AbstractEventLoop, list] = {}
            for handle, token_ids, finish_reason, err, cached, logprobs, prompt_logprobs in batch:
                stream = self._streams.pop(handle, None) if finish_reason else self._streams.get(handle)
                if stream is not None:
                    delta = Delta(token_ids, finish_reason, error=err, num_cached_tokens=cached, logprobs=logprobs,
                                  prompt_logprobs=prompt_logprobs)
                    batches.setdefault(stream[0], []).append((stream[1], delta))
            for loop, items in batches.items():
                call_on(loop, fill_queues, items)
            if not alive and not self.closing:
                self._fail(f"engine failure: {error}")
                return

    def _fail(self, error: str, reason: str = "error") -> None:
        """The engine is gone: every live request gets its last delta."""
        self._alive, self.error = False, self.error or error
        for event, answer in list(self._resets.values()):
            answer.append(False)
            event.set()
        for handle in list(self._streams):
            loop, queue = self._streams.pop(handle)
            call_on(loop, queue.put_nowait, Delta([], reason, error=error))

    def shutdown(self, abort: bool = True, timeout: float | None = 30.0) -> None:
        """Stop the engine process: abort the requests in flight (each gets its last delta), or with abort=False
        finish them first."""
        self.closing = True
        if self.process.is_alive():
            try:
                self._send(("stop", abort))
                self._stopped.wait(timeout)
            except OSError:
                pass
            self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
