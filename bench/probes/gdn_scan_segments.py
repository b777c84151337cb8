"""Probe: the segmented chunk-state scan of `gdn_chunked_pallas` (`segments=`, dv tile `block_v`) against
the one-walk scan, at the kernel table's prefill shapes (16 heads, dk = dv = 128, bf16 inputs).

    python bench/probes/gdn_scan_segments.py OUT.json   # on the H200 (PYTHONPATH=.:tests); CPU: correctness only

One long row is latency-bound in the scan (each program walks every chunk in sequence); cut into G
segments, the walks run side by side after a transfer pass (`_transfer_kernel`). Rows: shape, setting,
device µs per call of each kernel (profiler), and the relative error of o and the final state against
the fp32 XLA chunked form, beside the one-walk scan's. Inputs decay weakly (g ~ -0.01 softplus(N(0, 1))
a token), so the state carries across segments and a wrong composition shows in the error.
"""

import json
import sys

import jax
import jax.numpy as jnp

from jaxgdn.bench.common import environment, probe_row, profile_calls, random_gdn_inputs
from pallas_kernels.gdn import gdn_chunked
from pallas_kernels.gdn_pallas import _scan_tiling, gdn_chunked_pallas

KERNELS = ("_prep_kernel", "_transfer_kernel", "_scan_kernel", "_output_kernel")
SETTINGS = ((None, 1), (None, None), (64, 2), (64, 4), (64, 8), (64, 16), (64, 32), (32, 4), (32, 8), (32, 16),
            (128, 8), (128, 16))  # (block_v, segments); (None, None) is the default rule


def main(out_path=None):
    gpu = jax.default_backend() == "gpu"
    shapes = ((1, 4096), (1, 8192), (1, 16384), (8, 2048)) if gpu else ((1, 640),)
    H, d = (16, 128) if gpu else (2, 32)
    rows = []
    for B, T in shapes:
        q, k, v, g, beta = random_gdn_inputs(B, T, H, d)
        g = 0.01 * g
        with jax.default_matmul_precision("highest"):
            o_ref, s_ref = jax.jit(gdn_chunked)(*(x.astype(jnp.float32) for x in (q, k, v)), g, beta)
        rel = lambda a, b: float(jnp.abs(a.astype(jnp.float32) - b).max() / jnp.abs(b).max())  # noqa: E731
        for block_v, segments in SETTINGS if gpu else SETTINGS[:4]:
            f = jax.jit(lambda *a, bv=block_v, sg=segments: gdn_chunked_pallas(*a, block_v=bv, segments=sg))

            def measure(f=f):
                o, s = f(q, k, v, g, beta)
                row = {"err_o": rel(o, o_ref), "err_state": rel(s, s_ref)}
                if gpu:
                    top = profile_calls(f, q, k, v, g, beta)["top"]
                    us = {n: round(t, 1) for n, t, _ in top if n in KERNELS}
                    row.update(us=us, total_us=round(sum(us.values()), 1))
                return row

            chosen = _scan_tiling(d, B * H, -(-T // 64), block_v, segments)
            rows.append(probe_row({"B": B, "T": T, "block_v": block_v, "segments": segments, "tiling": chosen},
                                  measure))
    if out_path:
        with open(out_path, "w") as f:
            json.dump({"benchmark": "gdn-scan-segments-probe", "heads": H, "head_dim": d, "rows": rows,
                       "env": environment()}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
