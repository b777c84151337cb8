"""Probe: launch settings of the three chunked-GDN kernels (`gdn_chunked_pallas`) at one long prompt of the
0.8B (B=1, T=8192, 16 heads, dk = dv = 128, bf16 inputs), where they took 10.7 ms of a 35 ms prefill step.

    python bench/probes/gdn_chunk_configs.py OUT.json      # on the H200 (PYTHONPATH=.:tests); CPU: correctness only

Each run sets all three kernels at once (prep warps, scan dv tile and warps, output dv tile and warps,
cycling through the lists independently) and the profile gives each kernel's device time, so one run
times three settings. Rows: the settings, µs per call of each kernel, max |o - o_default|.
"""

import itertools
import json
import sys

import jax
import jax.numpy as jnp

from jaxgdn.bench.common import environment, probe_row, profile_calls, random_gdn_inputs
from pallas_kernels.gdn_pallas import gdn_chunked_pallas

PREP_WARPS = (4, 2, 8)
SCAN = ((16, 4), (32, 4), (64, 4), (16, 2), (32, 2), (64, 8), (16, 8), (32, 8), (128, 8))  # (block_v, warps)
OUTPUT = ((64, 4), (32, 4), (128, 8), (64, 8), (32, 2), (128, 4))  # (block_v_out, warps)


def kernel_us(f, *args):
    top = profile_calls(f, *args)["top"]
    return {name: round(us, 1) for name, us, _ in top if name in ("_prep_kernel", "_scan_kernel", "_output_kernel")}


def main(out_path=None):
    on_gpu = jax.default_backend() == "gpu"
    B, T, H, d = (1, 8192, 16, 128) if on_gpu else (1, 128, 2, 16)
    q, k, v, g, beta = random_gdn_inputs(B, T, H, d)
    ref, _ = jax.jit(gdn_chunked_pallas)(q, k, v, g, beta)
    rows = []
    n = len(SCAN) if on_gpu else 2
    for i, (pw, (bv, sw), (bvo, ow)) in enumerate(zip(itertools.cycle(PREP_WARPS), SCAN, itertools.cycle(OUTPUT))):
        if i >= n:
            break
        bv, bvo = min(bv, d), min(bvo, d)
        f = jax.jit(lambda *a, bv=bv, bvo=bvo, w=(pw, sw, ow): gdn_chunked_pallas(*a, block_v=bv, block_v_out=bvo, warps=w))

        def measure(f=f):
            o, _ = f(q, k, v, g, beta)
            row = {"error": float(jnp.abs(o - ref).max())}
            return {**row, "us": kernel_us(f, q, k, v, g, beta)} if on_gpu else row

        rows.append(probe_row({"prep_warps": pw, "scan": [bv, sw], "output": [bvo, ow]}, measure))
    if out_path:
        with open(out_path, "w") as f:
            json.dump({"benchmark": "gdn-chunk-configs-probe", "shape": [B, T, H, d], "rows": rows,
                       "env": environment()}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
