"""`bench serve --http URL`: the serving benchmark against a running server (`python -m jaxgdn.serve` or any
OpenAI-compatible one), like vLLM's benchmark_serving and with its client, aiohttp (httpx parses an SSE stream
several times slower, enough to load the client at a GPU's rates): the same seeded workload as `bench serve`,
sent as streaming /v1/completions requests with token-id prompts (ignore_eos, greedy), at --request-rate
(Poisson) with at most --max-concurrency in flight. TTFT is the first streamed token's arrival, ITL the gaps
between streamed chunks, TPOT (last - first) / (tokens - 1) per request; output tokens are counted from the
server's token ids (jaxgdn's `token_ids` extension) where it sends them, else one per chunk."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np

from .common import percentiles
from .serve import _tokenizer, _vocab, make_requests


async def _one(session, url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    times, tokens, error = [], 0, None
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                return {"error": f"HTTP {r.status}: {(await r.text())[:200]}"}
            async for raw in r.content:  # one SSE line at a time
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                n = len(choice["token_ids"]) if "token_ids" in choice else int(bool(choice.get("text")))
                if n:
                    times.append(time.perf_counter())
                    tokens += n
    except Exception as e:  # noqa: BLE001 - a failed request is counted, the run goes on
        error = f"{type(e).__name__}: {e!r} after {tokens} tokens, {time.perf_counter() - t0:.1f} s"
    return {"start": t0, "times": times, "tokens": tokens, "error": error}


async def _run(args, requests) -> dict:
    import aiohttp

    url = args.http.rstrip("/")
    connector = aiohttp.TCPConnector(limit=args.max_concurrency or 0)  # 0: no limit
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        async with session.get(url + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        metrics_before = await _metrics(session, url)
        rng = np.random.default_rng(args.seed)
        gaps = rng.exponential(1 / args.request_rate, len(requests)) if args.request_rate > 0 else np.zeros(len(requests))
        gate = asyncio.Semaphore(args.max_concurrency or len(requests))
        t0 = time.perf_counter()

        async def send(delay: float, prompt, max_tokens):
            await asyncio.sleep(delay)
            async with gate:
                return await _one(session, url, model, prompt, max_tokens)

        results = await asyncio.gather(*(send(float(d), p, o) for d, (p, o) in zip(np.cumsum(gaps) - gaps[0], requests)))
        wall = time.perf_counter() - t0
        metrics_after = await _metrics(session, url)
    ttft, tpot, itl = [], [], []
    for r in results:
        if r.get("times"):
            ttft.append((r["times"][0] - r["start"]) * 1e3)
            if r["tokens"] > 1:
                tpot.append((r["times"][-1] - r["times"][0]) / (r["tokens"] - 1) * 1e3)
            itl += list(np.diff(r["times"]) * 1e3)
    prompt_tokens = sum(len(p) for p, _ in requests)
    output_tokens = sum(r.get("tokens", 0) for r in results)
    errors = [r["error"] for r in results if r.get("error")]
    return {"model": model, "wall_s": wall, "requests": len(requests), "errors": len(errors), "first_errors": errors[:3],
            "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
            "total_tokens_per_s": (prompt_tokens + output_tokens) / wall, "output_tokens_per_s": output_tokens / wall,
            "ttft_ms": percentiles(ttft), "tpot_ms": percentiles(tpot), "itl_ms": percentiles(itl),
            "compiles_after_startup": _metric(metrics_after, "jaxgdn_compiles_after_startup"),
            "server_generation_tokens": _metric(metrics_after, "jaxgdn_generation_tokens_total")
            - _metric(metrics_before, "jaxgdn_generation_tokens_total")}


async def _metrics(session, url: str) -> str:
    async with session.get(url + "/metrics") as r:
        return await r.text()


def _metric(text: str, name: str) -> float | None:
    """A metric's value in Prometheus text (the first sample), or None (a server without it)."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def bench_serve_http(args) -> dict:
    if args.dataset == "multiturn":
        raise SystemExit("bench serve --http: --dataset multiturn is served in-process only")
    requests = make_requests(args, _vocab(args), _tokenizer(args))
    runs = {}
    for name in ("first", "second")[: 1 + args.http_repeat]:
        runs[name] = asyncio.run(_run(args, requests))
        r = runs[name]
        print(f"{name}: {r['wall_s']:.2f} s, {r['total_tokens_per_s']:.0f} tok/s total, {r['output_tokens_per_s']:.0f} "
              f"out; TTFT p50 {r['ttft_ms']['p50']:.1f} ms, TPOT p50 {r['tpot_ms']['p50']:.2f} ms, ITL p50 "
              f"{r['itl_ms']['p50']:.2f} ms; {r['errors']} errors; compiles after start-up "
              f"{r['compiles_after_startup']}", flush=True)
    return {"benchmark": "serve-http", "url": args.http, "model": args.model, "dataset": args.dataset,
            "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
            "request_rate": args.request_rate, "max_concurrency": args.max_concurrency, "seed": args.seed,
            **runs}
