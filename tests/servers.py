"""Servers for the serving tests: the OpenAI app in a thread of the test process, or `python -m jaxgdn.serve`
processes; each on 127.0.0.1 with a free port, stopped by the test, every wait bounded."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import subprocess
import sys
import tempfile
import threading
import time
import typing
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_in_thread(model: str, config, name: str, **llm_kwargs):
    """(base URL, ServerState) of the app over LLM(model, config) served by uvicorn in a thread."""
    import uvicorn

    from jaxgdn.llm import LLM
    from jaxgdn.serve.app import ServerState, build_app
    from jaxgdn.serve.async_engine import AsyncEngine

    llm = LLM(model, config, **llm_kwargs)
    state = ServerState(front=AsyncEngine(llm.engine, llm.prefill_worker).start(), model_name=name,
                        tokenizer=llm.tokenizer)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(state), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", state
    finally:
        server.should_exit = True
        thread.join(60)


@dataclasses.dataclass
class ServerProcess:
    url: str
    proc: subprocess.Popen
    log: typing.IO

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()


@contextlib.contextmanager
def serve_processes(*arg_lists: list[str], start_timeout: float = 300, handles: bool = False):
    """Start `python -m jaxgdn.serve ARGS` for each argument list (on a free port unless ARGS has --port); yield
    their base URLs (handles: their ServerProcess) once every /health answers; stop them (SIGTERM, then kill) at
    the end. A process that dies early fails with its log."""
    procs, urls, logs = [], [], []
    try:
        for args in arg_lists:
            port = int(args[args.index("--port") + 1]) if "--port" in args else free_port()
            log = tempfile.TemporaryFile("w+")
            procs.append(subprocess.Popen([sys.executable, "-m", "jaxgdn.serve", *args, "--port", str(port),
                                           "--log-level", "warning"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
            urls.append(f"http://127.0.0.1:{port}")
            logs.append(log)
        deadline = time.monotonic() + start_timeout
        for proc, url, log in zip(procs, urls, logs):
            while True:
                if proc.poll() is not None:
                    log.seek(0)
                    raise AssertionError(f"server {url} exited with {proc.returncode}:\n{log.read()[-3000:]}")
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, f"server {url} not healthy after {start_timeout} s"
                time.sleep(0.2)
        yield [ServerProcess(*x) for x in zip(urls, procs, logs)] if handles else urls
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        for log in logs:
            log.close()


def drained(front, timeout: float = 10.0) -> dict:
    """The AsyncEngine's snapshot once no request runs or waits and no page or slot is in use (the engine thread
    publishes it after the step that ends the last request), or the last one seen after timeout seconds."""
    deadline = time.monotonic() + timeout
    while True:
        snap = front.snapshot
        busy = snap["running"] or snap["waiting"] or snap["kv_pages_used"] or snap["slots_used"]
        if not busy or time.monotonic() > deadline:
            return snap
        time.sleep(0.02)



def aborts_after(front, count: int, timeout: float = 20.0) -> int:
    """The engine's count of aborted requests once it reaches `count` (aborts are counted when the engine thread
    next steps, after the server noticed the client gone), or the last one seen after timeout seconds."""
    deadline = time.monotonic() + timeout
    while True:
        seen = drained(front).get("finished_abort", 0)
        if seen >= count or time.monotonic() > deadline:
            return seen
        time.sleep(0.05)


async def hang_up_after(stream, chunks: int) -> None:
    """Read `chunks` chunks of an openai client's stream, then hang up."""
    n = 0
    async for _ in stream:
        n += 1
        if n == chunks:
            break
    await stream.close()
