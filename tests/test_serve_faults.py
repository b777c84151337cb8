"""Faults of real server processes, as production meets them. A PD pair's prefill server stalled (SIGSTOP), killed
mid-load (SIGKILL) and replaced at the same URL; its decode server killed mid-load; the engine process of a plain
server killed. What a client sees in each is an OpenAI-shaped error within a deadline (never a hang), the survivors
keep serving, and nothing stays held."""

import asyncio
import json
import os
import signal
import threading
import time

import httpx
import psutil
import pytest
from servers import free_port, serve_processes

from jaxgdn import task
from jaxgdn.bench.soak import parse_metrics

pytestmark = pytest.mark.xdist_group("serve_faults")
MODEL = "qwen35-tiny-arith"
ARGS = ["--max-num-seqs", "16", "--max-num-batched-tokens", "128", "--max-model-len", "1024", "--dtype", "float32",
        "--no-precompile", "--served-model-name", MODEL]
SHOTS = tuple((p.question, p.solution) for p in task.take("train", 2))
PROMPTS = [task.format_prompt(p.question, SHOTS) for p in task.take("test", 24)]  # ~700 tokens: prefill takes steps
HELD = ("requests_running", "requests_waiting", "kv_pages_used", "gdn_slots_used")


def metrics(url: str) -> dict:
    return parse_metrics(httpx.get(url + "/metrics", timeout=10).text)


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.1)
    return value


def idle(url: str, timeout: float = 30) -> dict:
    """The server's metrics once no request runs, waits or holds a page or slot."""
    def quiet():
        m = metrics(url)
        return None if any(m.get(k) for k in HELD) else m
    return wait_for(quiet, timeout, f"{url} holds requests' state")


def completion(prompt, max_tokens: int = 8, **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}


def assert_openai_error(r: httpx.Response, status: int, kind: str) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["type"] == kind and error["message"], error
    return error


def stream_error(url: str, body: dict) -> dict:
    """How a stream ends in error: an error event (a request refused before its first token: OpenAI's clients raise
    on it), or a choice finished with reason "error" and its message."""
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                return obj["error"]
            for choice in obj["choices"]:
                if choice["finish_reason"] == "error":
                    return {"message": choice["error"], "code": None}
    raise AssertionError("the stream ended without an error")


def warm_up(prefill_url: str) -> None:
    """Prefill every prompt once on the prefill server itself, so that its programs are compiled (--no-precompile)
    before a decode server's --prefill-timeout counts."""
    from jaxgdn.generate import default_checkpoint
    from jaxgdn.model.tokenizer import load_tokenizer

    tok = load_tokenizer(default_checkpoint())

    async def run():
        async with httpx.AsyncClient(base_url=prefill_url, timeout=300) as client:
            answers = await asyncio.gather(*(client.post("/v1/prefill", json={
                "prompt_token_ids": tok.encode(p), "sampling_params": {"temperature": 0, "max_tokens": 4}})
                for p in PROMPTS))
        assert all(r.status_code == 200 for r in answers)
    asyncio.run(run())


def test_prefill_server_stalled_killed_and_replaced():
    prefill_port = free_port()
    prefill_url = f"http://127.0.0.1:{prefill_port}"
    prefill_args = ["--role", "prefill", "--port", str(prefill_port), *ARGS]
    with serve_processes(prefill_args, ["--role", "decode", "--prefill-url", prefill_url, "--prefill-timeout", "10",
                                        *ARGS], handles=True) as (prefill, decode):
        url = decode.url
        warm_up(prefill.url)
        before = httpx.post(url + "/v1/completions", json=completion(PROMPTS[0]), timeout=120)
        assert before.status_code == 200, before.text

        # stalled: a request gets a timeout error, not a hang; resumed, the prefill server drops what nobody awaits
        os.kill(prefill.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            streamed = []
            stream = threading.Thread(target=lambda: streamed.append(stream_error(url, completion(PROMPTS[2]))))
            stream.start()
            error = assert_openai_error(httpx.post(url + "/v1/completions", json=completion(PROMPTS[1]), timeout=60),
                                        504, "timeout_error")
            stream.join(60)
            assert time.monotonic() - t0 < 30 and "prefill server" in error["message"]
            assert streamed[0]["code"] == "504"
        finally:
            os.kill(prefill.proc.pid, signal.SIGCONT)
        idle(prefill.url)

        # killed mid-load: every request waiting on a handoff fails fast with 502; the decode server serves on
        async def load_then_kill():
            async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                tasks = [asyncio.create_task(client.post("/v1/completions", json=completion(p, 4))) for p in PROMPTS]
                while not (await asyncio.to_thread(metrics, prefill.url)).get("requests_running"):
                    await asyncio.sleep(0.05)
                prefill.proc.kill()
                killed = time.monotonic()
                answers = await asyncio.wait_for(asyncio.gather(*tasks), 60)
                return answers, time.monotonic() - killed
        answers, waited = asyncio.run(load_then_kill())
        failed = [r for r in answers if r.status_code != 200]
        assert failed and waited < 30
        for r in failed:
            assert "prefill server" in assert_openai_error(r, 502, "server_error")["message"]
        assert assert_openai_error(httpx.post(url + "/v1/completions", json=completion(PROMPTS[3]), timeout=60),
                                   502, "server_error")
        assert stream_error(url, completion(PROMPTS[3]))["code"] == "502"
        one_token = httpx.post(url + "/v1/completions", json=completion([5]), timeout=60)  # needs no prefill
        assert one_token.status_code == 200 and one_token.json()["choices"][0]["token_ids"]
        assert httpx.get(url + "/health", timeout=10).status_code == 200

        # a new prefill server at the same URL: traffic recovers, same tokens, no restart of the decode server
        with serve_processes(prefill_args):
            again = httpx.post(url + "/v1/completions", json=completion(PROMPTS[0]), timeout=120)
            assert again.status_code == 200, again.text
            assert again.json()["choices"][0]["token_ids"] == before.json()["choices"][0]["token_ids"]
            assert decode.proc.poll() is None
            idle(url)


def test_decode_server_killed_mid_load_frees_the_prefill_server():
    prefill_port = free_port()
    prefill_url = f"http://127.0.0.1:{prefill_port}"
    with serve_processes(["--role", "prefill", "--port", str(prefill_port), *ARGS],
                         ["--role", "decode", "--prefill-url", prefill_url, *ARGS], handles=True) as (prefill, decode):
        async def load():
            async with httpx.AsyncClient(base_url=decode.url, timeout=120) as client:
                await asyncio.gather(*(client.post("/v1/completions", json=completion(p, 4)) for p in PROMPTS * 3),
                                     return_exceptions=True)
        threading.Thread(target=lambda: asyncio.run(load()), daemon=True).start()
        wait_for(lambda: metrics(prefill.url).get("requests_waiting"), 120, "prefill queue")
        decode.proc.kill()
        # the prompts its dead client waited for are aborted, not prefilled for nobody
        m = idle(prefill.url, 20)
        assert m["requests_finished:abort"] > 0
        assert httpx.get(prefill.url + "/health", timeout=10).status_code == 200


def test_engine_process_death_fails_requests_and_exits_the_server():
    with serve_processes(ARGS, handles=True) as (server,):
        url = server.url
        assert httpx.post(url + "/v1/completions", json=completion(PROMPTS[0]), timeout=120).status_code == 200
        cached = idle(url)
        assert cached["kv_pages_cached"] > 0 and cached["gdn_snapshots_used"] > 0
        assert httpx.post(url + "/reset_prefix_cache", timeout=60).json() == {"status": "ok"}
        m = metrics(url)
        assert m["kv_pages_cached"] == m["gdn_snapshots_used"] == m["kv_pages_used"] == 0

        errors = []
        stream = threading.Thread(target=lambda: errors.append(stream_error(url, completion(
            PROMPTS[1], 200, ignore_eos=True))), daemon=True)
        stream.start()
        wait_for(lambda: metrics(url).get("requests_running"), 60, "a running request")
        engine = next(p for p in psutil.Process(server.proc.pid).children()
                      if "resource_tracker" not in " ".join(p.cmdline()))
        engine.kill()
        health, deadline = [], time.monotonic() + 60
        while server.proc.poll() is None and time.monotonic() < deadline:  # until it exits, never healthy
            try:
                health.append(httpx.get(url + "/health", timeout=5).status_code)
            except httpx.HTTPError:
                health.append(None)
            time.sleep(0.1)
        stream.join(10)
        assert errors and "engine" in errors[0]["message"]
        assert server.proc.wait(30) == 1 and 200 not in health[1:]
        assert "the engine stopped" in server.output()
