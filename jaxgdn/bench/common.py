"""Shared pieces of the benchmarks: environment record, result files, timing, measured machine rates."""

from __future__ import annotations

import datetime
import json
import platform
import statistics
import time
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent.parent.parent / "bench" / "results"


def environment() -> dict:
    """Device, versions and date for every result file."""
    import jax
    import jaxlib

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(jax.devices()[0].device_kind),
        "num_devices": jax.device_count(),
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    for name in ("torch", "transformers", "triton", "fla", "jax_triton"):
        try:
            env[name] = __import__(name).__version__
        except Exception:
            env[name] = None
    return env


def write_result(name: str, payload: dict, path: Path | None = None) -> Path:
    """Write payload as JSON to path, default bench/results/<name>_<backend>_<date>.json."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d")
    path = path or RESULTS_DIR / f"{name}_{payload['env']['backend']}_{stamp}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


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
