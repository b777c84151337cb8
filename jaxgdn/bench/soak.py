"""`bench soak`: hours of realistic HTTP traffic against real server processes, and proof that nothing leaks.

It starts `python -m jaxgdn.serve` (or, with --pd, a prefill and a decode server), sends greedy probe requests,
finds the server's capacity with a closed-loop probe of the traffic mix (soak_traffic.py), then sends that mix
as Poisson arrivals at --load times the capacity for --minutes, sampling every server's /metrics and the resident
memory of its processes. Once traffic stops it checks that no request is left, that requests hold no KV page or
GDN slot (what stays in use is the prefix cache's), that the probes give the same tokens as at the start, and that
POST /reset_prefix_cache returns every page and snapshot; runs of 10 minutes or more also check that RSS grew at
most 5% after minute 5. The verdict is in the JSON (`passed`), and the command exits 1 when it fails.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from .common import percentiles
from .soak_traffic import Mix, Traffic, probe_requests, send

RSS_BASE_S = 300  # RSS growth is measured from this point of the traffic on (start-up and warm-up excluded)
RSS_GROWTH_LIMIT = 0.05
DRAIN_S = 120  # how long the servers get to return to idle once the last response is in
HOLDINGS = ("running", "waiting", "kv_pages_used", "slots_used")  # zero once idle: what requests hold


@dataclasses.dataclass
class Server:
    role: str
    url: str
    proc: subprocess.Popen
    log: Path


def start_servers(model: str, server_args: list[str], pd: bool, logdir: Path, start_timeout: float) -> list[Server]:
    """The server (or PD pair) on free ports, once /health answers on each."""
    import httpx

    from ..serve.__main__ import parse_args

    parse_args(["--model", model, *server_args])  # bad --server-args fail here, with serve's message
    ports = [_free_port() for _ in range(2 if pd else 1)]
    roles = [("prefill", ["--role", "prefill"]), ("decode", ["--role", "decode", "--prefill-url",
                                                            f"http://127.0.0.1:{ports[0]}"])] if pd else [("both", [])]
    servers = []
    for (role, extra), port in zip(roles, ports):
        log = logdir / f"{role}.log"
        proc = subprocess.Popen([sys.executable, "-m", "jaxgdn.serve", "--model", model, "--port", str(port),
                                 "--log-level", "warning", *extra, *server_args],
                                stdout=log.open("w"), stderr=subprocess.STDOUT)
        servers.append(Server(role, f"http://127.0.0.1:{port}", proc, log))
    deadline = time.monotonic() + start_timeout
    for s in servers:
        while True:
            if s.proc.poll() is not None:
                stop_servers(servers)
                raise RuntimeError(f"the {s.role} server exited with {s.proc.returncode}:\n{s.log.read_text()[-3000:]}")
            try:
                if httpx.get(s.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                stop_servers(servers)
                raise RuntimeError(f"the {s.role} server was not healthy after {start_timeout:g} s")
            time.sleep(0.5)
    return servers


def stop_servers(servers: list[Server]) -> None:
    for s in servers:
        s.proc.terminate()
    for s in servers:
        try:
            s.proc.wait(60)
        except subprocess.TimeoutExpired:
            s.proc.kill()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name without jaxgdn_ (and _total): value}; a reason label joins the name after ':'."""
    out = {}
    for line in text.splitlines():
        if not line.startswith("jaxgdn_") or "_created" in line.split(" ")[0]:
            continue
        key, value = line.rsplit(" ", 1)
        name = key.split("{")[0].removeprefix("jaxgdn_").removesuffix("_total")
        if 'reason="' in key:
            name += ":" + key.split('reason="')[1].split('"')[0]
        out[name] = float(value)
    return out


def rss_mb(servers: list[Server]) -> float:
    """Resident memory of the servers' processes and their children (the engine process), in MB."""
    import psutil

    total = 0
    for s in servers:
        try:
            proc = psutil.Process(s.proc.pid)
            for p in [proc, *proc.children(recursive=True)]:
                total += p.memory_info().rss
        except psutil.Error:  # a process gone between the listing and the reading
            pass
    return total / 2**20


async def _metrics(client, servers: list[Server]) -> dict[str, dict]:
    """Each server's /metrics; {"unreachable": 1.0} for one that does not answer."""
    out = {}
    for s in servers:
        try:
            out[s.role] = parse_metrics((await client.get(s.url + "/metrics", timeout=30)).text)
        except Exception:  # noqa: BLE001 - a dead server is a finding, not a crash of the benchmark
            out[s.role] = {"unreachable": 1.0}
    return out


async def _sampler(client, servers: list[Server], t0: float, interval: float, samples: list) -> None:
    while True:
        metrics = await _metrics(client, servers)
        if not any("unreachable" in m for m in metrics.values()):  # a missed sample is a gap in the plot
            samples.append({"t": round(time.perf_counter() - t0, 2), "rss_mb": round(rss_mb(servers), 1),
                            "servers": {role: {k: m.get(k, 0.0) for k in SAMPLED} for role, m in metrics.items()}})
        await asyncio.sleep(interval)


SAMPLED = ("requests_running", "requests_waiting", "kv_pages_used", "kv_pages_cached", "gdn_slots_used",
           "gdn_snapshots_used", "generation_tokens", "prefix_cache_hits", "prefix_cache_evicted_pages")


async def _capacity(client, traffic: Traffic, concurrency: int, seconds: float, outcomes: list) -> float:
    """Requests a second the server completes under a closed loop of `concurrency` clients sending the mix,
    counted over the probe's last two thirds (the first fills the batch)."""
    t0 = time.perf_counter()
    start, stop_at = t0 + seconds / 3, t0 + seconds
    finished: list[float] = []

    async def worker():
        while time.perf_counter() < stop_at:
            outcomes.append(await send(client, traffic.next()))
            finished.append(time.perf_counter())
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return max(1, sum(start <= t <= stop_at for t in finished)) / (stop_at - start)


async def _poisson(client, traffic: Traffic, rate: float, seconds: float, seed: int) -> list[dict]:
    from tqdm import tqdm

    rng = np.random.default_rng(seed)
    tasks, t0, at = [], time.perf_counter(), 0.0
    errors = 0
    bar = tqdm(total=int(seconds), unit="s", desc="traffic", mininterval=5)

    async def timed(req, at):
        nonlocal errors
        out = await send(client, req)
        out["t"] = round(at, 3)
        errors += out["status"] == "error"
        return out
    while True:
        at += rng.exponential(1 / rate)
        if at > seconds:
            break
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        tasks.append(asyncio.create_task(timed(traffic.next(), at)))
        bar.update(int(at) - bar.n)
        bar.set_postfix(sent=len(tasks), errors=errors, refresh=False)
    bar.update(bar.total - bar.n)
    bar.close()
    return list(await asyncio.gather(*tasks))


async def _probe(client, model: str) -> list:
    """Each greedy probe's tokens (its error message if it failed)."""
    outs = await asyncio.gather(*(send(client, r) for r in probe_requests(model)))
    return [o["token_ids"][0] if o["status"] == "ok" else o["error"] for o in outs]


async def _idle(client, servers: list[Server], timeout: float) -> dict[str, dict]:
    """Every server's metrics once no request runs, waits or holds a page or slot (or after timeout seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = await _metrics(client, servers)
        busy = any(m.get(_name(k), 0) or "unreachable" in m for m in metrics.values() for k in HOLDINGS)
        if not busy or time.monotonic() > deadline:
            return metrics
        await asyncio.sleep(0.5)


async def _reset(client, server: Server) -> int | None:
    """POST /reset_prefix_cache's status (None: no answer)."""
    try:
        return (await client.post(server.url + "/reset_prefix_cache", timeout=60)).status_code
    except Exception:  # noqa: BLE001 - recorded in the verdict
        return None


def _name(key: str) -> str:
    return {"running": "requests_running", "waiting": "requests_waiting", "slots_used": "gdn_slots_used"}.get(key, key)


def _rss_growth(samples: list[dict], traffic_start: float, minutes: float) -> dict:
    """Mean RSS over minute 5 of the traffic and over its last minute (single samples swing with the batch), and
    the growth between (None below 10 minutes)."""
    if minutes < 10:
        return {"base_mb": None, "end_mb": None, "growth": None, "ok": None}
    start, end_t = traffic_start + RSS_BASE_S, traffic_start + minutes * 60
    base = float(np.mean([s["rss_mb"] for s in samples if start <= s["t"] < start + 60]))
    end = float(np.mean([s["rss_mb"] for s in samples if end_t - 60 <= s["t"] <= end_t]))
    peak = max(s["rss_mb"] for s in samples if start <= s["t"] <= end_t)
    growth = end / base - 1
    return {"base_mb": base, "end_mb": end, "peak_mb": peak, "growth": growth, "ok": growth <= RSS_GROWTH_LIMIT}


async def _soak(args, servers: list[Server], model: str) -> dict:
    import httpx

    samples: list[dict] = []
    t0 = time.perf_counter()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=servers[-1].url, timeout=args.request_timeout, limits=limits) as client:
        sampler = asyncio.create_task(_sampler(client, servers, t0, args.sample_interval, samples))
        probes_start = await _probe(client, model)
        traffic = Traffic(model, args.seed, Mix())
        probe_outcomes: list[dict] = []
        if args.rate:
            capacity, rate = None, args.rate
        else:
            capacity = await _capacity(client, traffic, args.concurrency, args.probe_seconds, probe_outcomes)
            rate = args.load * capacity
            print(f"capacity {capacity:.2f} requests/s (closed loop of {args.concurrency})", flush=True)
        print(f"sending {rate:.2f} requests/s for {args.minutes:g} min", flush=True)
        traffic_start = time.perf_counter() - t0
        outcomes = await _poisson(client, traffic, rate, args.minutes * 60, args.seed + 1)
        traffic_end = time.perf_counter() - t0
        end_state = await _idle(client, servers, DRAIN_S)
        probes_end = await _probe(client, model)
        await _idle(client, servers, DRAIN_S)
        resets = [await _reset(client, s) for s in servers]
        after_reset = await _metrics(client, servers)
        await asyncio.sleep(args.sample_interval)
        sampler.cancel()
    up = all(s.proc.poll() is None for s in servers) and not any(
        "unreachable" in m for m in [*end_state.values(), *after_reset.values()])
    return _report(args, samples, outcomes, probe_outcomes, capacity, rate, (traffic_start, traffic_end),
                   end_state, resets, after_reset, probes_start, probes_end, up)


def _report(args, samples, outcomes, probe_outcomes, capacity, rate, window, end_state, resets, after_reset,
            probes_start, probes_end, servers_up: bool) -> dict:
    every = probe_outcomes + outcomes
    errors = [o for o in every if o["status"] == "error"]
    ok = [o for o in outcomes if o["status"] == "ok"]
    features: dict[str, int] = {}
    for o in outcomes:
        for f in o["features"]:
            features[f] = features.get(f, 0) + 1
    server_errors = sum(v for m in end_state.values() for k, v in m.items() if k == "requests_finished:error")
    leaks = {role: {k: m.get(_name(k), 0) for k in HOLDINGS} for role, m in end_state.items()}
    held = {role: {"kv_pages_cached": m.get("kv_pages_cached", 0), "snapshots": m.get("gdn_snapshots_used", 0),
                   "evicted_pages": m.get("prefix_cache_evicted_pages", 0), "prefix_hit_tokens": m.get("prefix_cache_hits", 0)}
            for role, m in end_state.items()}
    reset = {role: {k: m.get(k, 0) for k in ("kv_pages_used", "kv_pages_cached", "gdn_slots_used", "gdn_snapshots_used")}
             for role, m in after_reset.items()}
    rss = _rss_growth(samples, window[0], args.minutes)
    verdict = {
        "servers_up_to_the_end": servers_up,
        "no_unexpected_errors": not errors and not server_errors,
        "requests_hold_nothing_at_the_end": not any(v for m in leaks.values() for v in m.values()),
        "reset_returns_everything": all(code == 200 for code in resets) and not any(
            v for m in reset.values() for v in m.values()),
        "probes_identical": probes_start == probes_end and all(isinstance(t, list) for t in probes_start),
        "rss_growth_within_5pct": rss["ok"],
    }
    span = window[1] - window[0]
    return {
        "benchmark": "soak",
        "config": {"minutes": args.minutes, "pd": args.pd, "server_args": args.server_args,
                   "load": None if args.rate else args.load,
                   "seed": args.seed, "concurrency": args.concurrency, "probe_seconds": args.probe_seconds,
                   "mix": dataclasses.asdict(Mix())},
        "capacity_requests_per_s": capacity, "rate_requests_per_s": rate,
        "requests": {"sent": len(outcomes), "ok": len(ok), "hung_up": sum(o["status"] == "hung_up" for o in outcomes),
                     "errors": len(errors), "server_errors": server_errors, "capacity_probe": len(probe_outcomes)},
        "features": features,
        "first_errors": [o["error"] for o in errors[:20]],
        "latency_s": percentiles([o["latency"] for o in ok]),
        "ttft_s": percentiles([o["ttft"] for o in ok if "ttft" in o]),
        "output_tokens": sum(o["tokens"] for o in outcomes),
        "output_tokens_per_s": sum(o["tokens"] for o in outcomes) / span,
        "end_state": {"held_by_requests": leaks, "held_by_prefix_cache": held}, "after_reset": reset,
        "rss": rss, "probes": {"start": probes_start, "end": probes_end},
        "verdict": verdict, "passed": all(v is not False for v in verdict.values()),
        "traffic_window_s": list(window), "samples": samples,
    }


def bench_soak(args) -> dict:
    from ..generate import default_checkpoint

    model = args.model or str(default_checkpoint())
    server_args = shlex.split(args.server_args)
    args.concurrency = args.concurrency or _max_num_seqs(server_args)
    with tempfile.TemporaryDirectory(prefix="jaxgdn-soak-") as logdir:
        t = time.perf_counter()
        servers = start_servers(model, server_args, args.pd, Path(logdir), args.start_timeout)
        startup = time.perf_counter() - t
        try:
            payload = asyncio.run(_soak(args, servers, Path(model).name))
        finally:
            stop_servers(servers)
    payload["startup_s"] = startup
    _print_summary(payload)
    return payload


def _max_num_seqs(server_args: list[str]) -> int:
    from ..serve.__main__ import parse_args

    return parse_args(server_args).max_num_seqs


def _print_summary(p: dict) -> None:
    r = p["requests"]
    print(f"{r['sent']} requests: {r['ok']} ok, {r['hung_up']} hung up by the client, {r['errors']} errors "
          f"({r['server_errors']} on the servers); {p['output_tokens_per_s']:.1f} output tokens/s; "
          f"latency p50 {p['latency_s']['p50'] or 0:.2f} s, p99 {p['latency_s']['p99'] or 0:.2f} s")
    for e in p["first_errors"][:5]:
        print("  error:", e)
    for name, ok in p["verdict"].items():
        print(f"  {name}: {'n/a' if ok is None else 'yes' if ok else 'NO'}")
    print("passed" if p["passed"] else "FAILED")
