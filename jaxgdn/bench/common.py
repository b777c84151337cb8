"""Shared pieces of the benchmarks: timing, measured machine rates, profiles."""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time

import numpy as np


def time_calls(call, sync, iters: int = 20, repeats: int = 5, warmup: int = 2) -> float:
    """Milliseconds per call of `call()` issued back to back (launch overhead included, as a server sees
    it); `sync(out)` waits for the device. Median over `repeats` runs of `iters` calls."""
    out = None
    for _ in range(warmup):
        out = call()
    sync(out)
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = call()
        sync(out)
        runs.append((time.perf_counter() - t0) / iters * 1e3)
    return statistics.median(runs)


def time_jax(fn, *args, **kw) -> float:
    import jax

    return time_calls(lambda: fn(*args), jax.block_until_ready, **kw)


def time_torch(fn, *args, **kw) -> float:
    import torch

    return time_calls(lambda: fn(*args), lambda _: torch.cuda.synchronize(), **kw)


def measured_bandwidth_gbs(num_bytes: int = 1 << 30) -> float:
    """GB/s of an elementwise JAX pass (read + write) over a num_bytes bf16 array on the default device."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((num_bytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda a: a * 2 + 1)
    ms = time_jax(f, x, iters=10)
    return 2 * num_bytes / (ms * 1e-3) / 1e9


def measured_matmul_tflops(n: int = 8192) -> float:
    """bf16 TFLOP/s of an n x n x n JAX matmul with fp32 accumulation on the default device."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), jnp.bfloat16)
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    ms = time_jax(f, a, a, iters=10)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def load_trace(trace_dir: str):
    """The newest `jax.profiler.trace(..., create_perfetto_trace=True)` capture under trace_dir as (complete
    events, pid -> process name, (pid, tid) -> thread name); None when there is none."""
    import glob
    import gzip
    import os

    files = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True))
    if not files:
        return None
    data = json.load(gzip.open(files[-1]))
    events = data["traceEvents"] if isinstance(data, dict) else data
    meta = [e for e in events if e.get("ph") == "M"]
    processes = {e.get("pid"): e.get("args", {}).get("name", "") for e in meta if e.get("name") == "process_name"}
    threads = {(e.get("pid"), e.get("tid")): e.get("args", {}).get("name", "") for e in meta
               if e.get("name") == "thread_name"}
    return [e for e in events if e.get("ph") == "X"], processes, threads


def gpu_pids(processes: dict) -> set:
    """The trace processes that are GPU streams."""
    return {pid for pid, name in processes.items() if "GPU" in name or "/device:" in name}


def profile_summary(trace_dir: str, divide_by: int = 1, top: int = 40, host_top: int = 25) -> dict:
    """Summarise a `jax.profiler.trace(trace_dir, create_perfetto_trace=True)` capture: per device
    process (GPU streams when there are any, else the host), total busy time and the kernels that took it,
    in microseconds per `divide_by` (e.g. per step). With GPU streams, `host` lists the host-side runtime
    events (launches, command-buffer updates, transfers; nested events each count) the same way."""
    import collections

    loaded = load_trace(trace_dir)
    if loaded is None:
        return {"error": f"no perfetto trace under {trace_dir}"}
    events, names, _ = loaded
    device_pids = gpu_pids(names)
    keep = device_pids or set(names)
    per_kernel: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    host: collections.Counter = collections.Counter()
    host_counts: collections.Counter = collections.Counter()
    start, end = float("inf"), 0.0
    for e in events:
        if e.get("pid") in keep:
            per_kernel[e["name"]] += e.get("dur", 0)
            counts[e["name"]] += 1
            start, end = min(start, e["ts"]), max(end, e["ts"] + e.get("dur", 0))
        elif device_pids and not e["name"].startswith("$"):  # "$file:line fn" are Python frames
            host[e["name"]] += e.get("dur", 0)
            host_counts[e["name"]] += 1
    summary = {
        "processes": sorted(names[p] for p in keep),
        # span minus busy is time the device sat idle between kernels (launch overhead, host waits)
        "span_us": max(end - start, 0.0) / divide_by,
        "busy_us": sum(per_kernel.values()) / divide_by,
        "events": sum(counts.values()) / divide_by,
        "top": [[name, us / divide_by, counts[name] / divide_by] for name, us in per_kernel.most_common(top)],
    }
    if host:
        summary["host"] = [[name, us / divide_by, host_counts[name] / divide_by]
                           for name, us in host.most_common(host_top)]
    return summary


def profile_calls(fn, *args, iters: int = 10, divide_by: int | None = None) -> dict:
    """`profile_summary` of `iters` back-to-back calls of the jitted `fn(*args)` after one untimed call
    (compile, warm-up): device busy time and top kernels per call (or per `divide_by` units)."""
    import shutil

    import jax

    jax.block_until_ready(fn(*args))
    trace_dir = tempfile.mkdtemp()
    try:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(iters):
                out = fn(*args)
            jax.block_until_ready(out)
        return profile_summary(trace_dir, divide_by=divide_by or iters)
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)


def torch_kernel_us(call, iters: int = 10) -> dict:
    """Device microseconds per `call()` of each CUDA kernel it launches (torch's profiler, after one warm
    call), name -> µs. Run it after every JAX profile of the process: once torch's profiler has held CUPTI,
    JAX's can no longer subscribe (CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            call()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t:
            out[e.key[:80]] = t / iters
    return out


def probe_row(row: dict, measure, quiet: tuple[str, ...] = ()) -> dict:
    """A probe's row for one form or setting: `row` updated with measure()'s dict, or with the error as
    row["failed"] when the form does not compile (a result too); printed without the `quiet` keys, and
    returned."""
    try:
        row.update(measure())
    except Exception as e:  # noqa: BLE001
        row["failed"] = repr(e)[:300]
    print({k: v for k, v in row.items() if k not in quiet}, flush=True)
    return row


def random_gdn_inputs(B: int, T: int, H: int, d: int, seed: int = 0):
    """q, k, v [B, T, H, d] bf16 and g (log decay <= 0), beta [B, T, H] fp32, for kernel probes."""
    import jax
    import jax.numpy as jnp

    key = jax.random.split(jax.random.PRNGKey(seed), 5)
    q, k, v = (jax.random.normal(kk, (B, T, H, d), jnp.bfloat16) for kk in key[:3])
    g = -jax.nn.softplus(jax.random.normal(key[3], (B, T, H), jnp.float32))
    beta = jax.nn.sigmoid(jax.random.normal(key[4], (B, T, H), jnp.float32))
    return q, k, v, g, beta


def gdn_probe_shapes() -> tuple[bool, tuple[tuple[int, int], ...], int, int]:
    """(on a GPU, ((B, T), ...), heads, head dim) of the GDN kernel probes: the 0.8B's prefill shapes
    1x8192 and 8x1024 with 16 heads of 128 on a GPU; one small shape elsewhere (correctness only)."""
    from pallas_kernels.common import on_gpu

    gpu = on_gpu()
    return (gpu, ((1, 8192), (8, 1024)), 16, 128) if gpu else (gpu, ((1, 128),), 2, 32)


# where the bench CLI points $TRITON_CACHE_DIR when it is unset
DEFAULT_TRITON_CACHE_DIR = os.path.join(tempfile.gettempdir(), "triton")


def ensure_triton_cache_dir(directory: str = DEFAULT_TRITON_CACHE_DIR) -> None:
    """fla's autotuner needs Triton's cache dir; on the H200 it came up empty inside the benchmark processes
    (bench prefill/decode's peers, bench kernels) although TRITON_CACHE_DIR was exported (cause not
    found). Point the knob at a real directory."""
    try:
        from triton import knobs

        if not knobs.cache.dir:
            knobs.cache.dir = directory
    except Exception:  # noqa: BLE001  (older Triton without knobs: the environment variable is enough)
        pass


def percentiles(values: list[float]) -> dict:
    """p50, p99 and mean of values (None each when there are none)."""
    if not values:
        return {"p50": None, "p99": None, "mean": None}
    a = np.asarray(values)
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)), "mean": float(a.mean())}
