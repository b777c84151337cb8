"""Probe: decode-shaped weight products with cold weights (not in L2), as they are inside the model.

    python bench/probes/cold_products.py OUT.json [M ...]   # on the H200 (PYTHONPATH=.); CPU: correctness only
    PROBE_XLA_ONLY=1 XLA_FLAGS=... python bench/probes/cold_products.py OUT.json

`gemv.py` timed one product repeated on the same weights, which then sit in the H200's 50 MB L2: its XLA
times (3.1-4.3 TB/s) were L2 reads. Here each timed call runs COPIES products of one shape on distinct
weight matrices (COPIES x the matrix >> L2), as the model's layers do, and the device time of the
call over COPIES is the cold time per product. Columns: `xla_us` XLA's choice (autotuned Triton GEMM or
cuBLAS), `pallas_<BN>x<BK>w<warps>s<stages>k<split>` (us, relative error) `gemv.py`'s Pallas kernel.
"""

import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
from gemv import pallas_gemv  # bench/probes is sys.path[0] when this runs as a script

from jaxgdn.bench.common import environment, profile_calls

f32 = jnp.float32
COPIES = 16
# (BN, BK, warps, stages, split)
CONFIGS = ((32, 128, 4, 3, 1), (64, 64, 4, 4, 1), (64, 128, 4, 3, 1), (64, 128, 4, 4, 1), (32, 256, 4, 3, 1),
           (64, 128, 8, 4, 1), (128, 64, 4, 4, 1), (32, 128, 4, 4, 2), (64, 128, 4, 3, 2), (32, 128, 4, 3, 4),
           (64, 128, 4, 3, 4), (32, 64, 4, 4, 7), (64, 64, 4, 4, 7))
SHAPES = ((8224, 1024), (7168, 1024), (1024, 3584), (1024, 2048), (5120, 1024))  # [N out, K in] of the 0.8B


def cold_us(product, x, ws, iters=10):
    """Device microseconds per product of `product(x, w)` over the COPIES matrices ws, from
    a profiler trace (all kernels of the call, so split-K sums and pads count); ws: COPIES arrays [N, K]."""
    def chain(x, ws):
        # The barrier makes product i+1 wait for product i: unchained, XLA merges the products that share
        # x into one over concatenated weights, which times a weight copy instead.
        ys = []
        for w in ws:
            y = product(x, w)
            x, y = jax.lax.optimization_barrier((x, y))
            ys.append(y)
        return ys

    summary = profile_calls(jax.jit(chain), x, ws, iters=iters, divide_by=iters * len(ws))
    return round(summary["busy_us"], 3), summary["top"][:3]


def main(out_path=None, ms=(64,)):
    interpret = jax.default_backend() != "gpu"
    xla_only = bool(os.environ.get("PROBE_XLA_ONLY"))
    key = jax.random.PRNGKey(0)
    shapes = [(64, 256)] if interpret else SHAPES
    copies = 2 if interpret else COPIES
    rows = []
    for N, K in shapes:
        ws = [jax.random.normal(jax.random.fold_in(key, i), (N, K), jnp.bfloat16) for i in range(copies)]
        for M in (3,) if interpret else ms:
            x = jax.random.normal(key, (M, K), jnp.bfloat16)
            ref = jnp.dot(x, ws[0].T, preferred_element_type=f32)
            row = {"N": N, "K": K, "M": M}
            if not interpret:
                row["xla_us"], row["xla_top"] = cold_us(lambda x, w: jnp.dot(x, w.T), x, ws)
            for BN, BK, warps, stages, split in () if xla_only else CONFIGS:
                if N % BN or K % (BK * split):
                    continue
                name = f"pallas_{BN}x{BK}w{warps}s{stages}k{split}"
                product = functools.partial(pallas_gemv, BN=BN, BK=BK, warps=warps, stages=stages, split=split,
                                            interpret=interpret)
                try:
                    got = product(x, ws[0])
                    err = float(jnp.abs(got.astype(f32) - ref).max() / jnp.abs(ref).max())
                    us = None if interpret else cold_us(product, x, ws)[0]
                    row[name] = (us, round(err, 4))
                except Exception as e:  # noqa: BLE001 - a config that does not lower is a result too
                    row[name] = repr(e)[:120]
            rows.append(row)
            timed = {k: v[0] for k, v in row.items() if k.startswith("pallas") and isinstance(v, tuple) and v[0]}
            best = sorted(timed, key=timed.get)[:3]
            gb = N * K * 2 / 1e9
            rate = lambda us: round(gb / us * 1e3, 2) if us else None  # noqa: E731 - TB/s of weight bytes
            print(f"N{N} K{K} M{M}: xla {row.get('xla_us')} us ({rate(row.get('xla_us'))} TB/s); best pallas "
                  + ", ".join(f"{b} {timed[b]} us ({rate(timed[b])} TB/s)" for b in best), flush=True)
    if out_path:
        with open(out_path, "w") as f:
            json.dump({"benchmark": "cold-products-probe", "copies": copies, "rows": rows, "env": environment()}, f,
                      indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None, tuple(int(m) for m in sys.argv[2:]) or (64,))
