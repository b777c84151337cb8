"""Probe: what a CUDA graph's launch costs the host and the GPU when XLA must update it before the launch
(a buffer it uses moved) against when nothing moved. A jitted chain of N kernels (each a pass over a
[rows, 1024] fp32 array, kept apart by optimization barriers, ~N x 10 µs of GPU work) runs as XLA's command
buffer, three ways:

  fresh_io      a new input buffer each call and a new output (the engine's steps: the input is a fresh
                device copy, the result a fresh buffer)
  fixed_input   the same input buffer each call, a new output
  fixed_io      the same input buffer, and the output written into a donated buffer handed back each call
                (aliased, so it keeps its address): no buffer of the graph moves

Per way: host µs of the call (launch), wall µs of one call from idle (launch + run + sync), and device µs a
call back to back. If "fixed_io" launches much faster and its wall time is nearer the device time, the
engine's step should keep every buffer of its graph at a fixed address.

    python bench/probes/graph_launch.py OUT.json [N [elementwise|gemm]]   # on the H200; CPU: runs, no graphs

r29 ran the elementwise chain only (graph-launch-probe-{120,480}-r29): fixed_io launched in 0.08 / 0.18 ms, but
the engine's step with every buffer pinned (prefill-io-new-r29, prefill-io-skiptemp-r29) still took ~1.9 ms
to launch. "gemm" puts library GEMM nodes in the chain, the next suspect for that difference.
"""

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxgdn.bench.common import environment


def chain(n: int, kind: str):
    """kind "elementwise": each link a pass over x; "gemm": each link x[64, 1024] @ w[1024, 1024] in bf16
    (a library GEMM node, as the engine's weight products are), w a constant of the program."""
    w = jnp.eye(1024, dtype=jnp.bfloat16) if kind == "gemm" else None

    def f(x, out):
        y = x
        for i in range(n):
            if kind == "gemm":
                y = jax.lax.optimization_barrier(jnp.dot(y.reshape(64, -1).astype(jnp.bfloat16), w).astype(y.dtype)
                                                 .reshape(y.shape) + 1e-3 * i)
            else:
                y = jax.lax.optimization_barrier(y * 1.0001 + 1e-3 * i)
        return out.at[:].set(y)

    return f


def main(out_path=None, n=480, kind="elementwise"):
    rows_n = (1 << 20 if jax.default_backend() == "gpu" else 1 << 10) if kind == "elementwise" else 64 * 1024
    x_host = np.ones((rows_n,), np.float32)
    f = jax.jit(chain(n, kind), donate_argnums=(1,))
    rows = []
    for way in ("fresh_io", "fixed_input", "fixed_io", "fresh_io"):
        x_fixed = jax.device_put(x_host)
        out = jax.device_put(np.zeros_like(x_host))

        def call():
            nonlocal out
            x = jax.device_put(x_host) if way == "fresh_io" else x_fixed
            if way == "fixed_io":
                out = f(x, out)
                return out
            return f(x, jax.device_put(np.zeros_like(x_host)) if way == "fresh_io" else jnp.zeros_like(x_fixed))

        for _ in range(3):
            jax.block_until_ready(call())
        launch, wall = [], []
        for _ in range(15):
            t0 = time.perf_counter()
            r = call()
            t1 = time.perf_counter()
            jax.block_until_ready(r)
            t2 = time.perf_counter()
            launch.append((t1 - t0) * 1e6)
            wall.append((t2 - t0) * 1e6)
        t0 = time.perf_counter()
        for _ in range(15):
            r = call()
        jax.block_until_ready(r)
        device = (time.perf_counter() - t0) / 15 * 1e6
        row = {"way": way, "kind": kind, "kernels": n, "launch_us": round(float(np.median(launch)), 1),
               "wall_us": round(float(np.median(wall)), 1), "back_to_back_us": round(device, 1)}
        print(row, flush=True)
        rows.append(row)
    if out_path:
        with open(out_path, "w") as fh:
            json.dump({"benchmark": "graph-launch-probe", "rows": rows, "env": environment()}, fh, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None, int(sys.argv[2]) if len(sys.argv) > 2 else 480,
         sys.argv[3] if len(sys.argv) > 3 else "elementwise")
