"""Probe: the 0.8B MLP's gate/up product with SiLU(gate) * up in the GEMM's epilogue
(`pallas_kernels/swiglu_mosaic.py`, Mosaic GPU) against XLA's cuBLAS product + multiply pass, at prompt sizes.

    python bench/probes/swiglu_mosaic.py OUT.json [TOKENS ...]    # on the H200 (PYTHONPATH=.)

First the "_cold" rows: each form over 8 distinct weights in one program, so each layer's weight comes from
HBM as in the model (r34: the kernel took ~182 us a layer in the engine's step against 171.6 here warm).
Then rows: form, tokens, device µs per call (busy, the profiler's), its kernels, TFLOP/s of the gate/up product,
max |y - y_xla| against the XLA form (both in bf16). The XLA form is compiled with Triton GEMMs off, as
the engine's prompt steps are (`runner.LIBRARY_GEMM_OPTIONS`). Also JAX's own Hopper matmul example at
the same shape (no epilogue), to tell the kernel's GEMM speed from its epilogue's cost.
"""

import dataclasses
import json
import sys
import traceback

import jax
import jax.numpy as jnp

from jaxgdn.bench.common import environment, probe_row, profile_calls
from pallas_kernels.swiglu_mosaic import SwigluTiles, swiglu_product

HIDDEN, INTER = 1024, 3584
LIBRARY_GEMMS = {"xla_gpu_enable_triton_gemm": False}


def xla_form(x, w):
    gate, up = jnp.split(jnp.einsum("ti,oi->to", x, w), 2, axis=-1)
    return jax.nn.silu(gate) * up


COLD_LAYERS = 8  # distinct weights in the cold rows: 8 x 14.7 MB, more than the H200's 50 MB L2


def cold_rows(tokens, forms):
    """Each form run over COLD_LAYERS distinct weights in one program, as the model's layers run (the weight
    comes from HBM, not L2): device µs per layer."""
    keys = jax.random.split(jax.random.PRNGKey(tokens + 1), 2)
    x = jax.random.normal(keys[0], (tokens, HIDDEN), jnp.bfloat16)
    ws = (jax.random.normal(keys[1], (COLD_LAYERS, 2 * INTER, HIDDEN), jnp.float32) * HIDDEN**-0.5).astype(jnp.bfloat16)
    rows = []
    for name, form, options in forms:
        f = jax.jit(lambda x, ws, form=form: tuple(form(x, ws[i]) for i in range(COLD_LAYERS)),
                    compiler_options=options)

        def measure(f=f):
            prof = profile_calls(f, x, ws, divide_by=10 * COLD_LAYERS)
            return {"busy_us_per_layer": round(prof["busy_us"], 1),
                    "kernels": [[n[:60], round(us, 1)] for n, us, _ in prof["top"][:3]]}

        rows.append(probe_row({"form": name + "_cold", "tokens": tokens}, measure))
    return rows


def main(out_path, token_counts=(8192, 2048)):
    rows = cold_rows(token_counts[0], [
        ("xla_cublas_then_multiply", xla_form, LIBRARY_GEMMS),
        ("mosaic_swiglu", lambda x, w: swiglu_product(x, w), None),
        ("mosaic_swiglu_no_cluster", lambda x, w: swiglu_product(x, w, SwigluTiles(cluster=1)), None)])
    # r34's first two calls also tried keeping one step's wgmmas in flight (tiles released a step later) and
    # 128-deep k tiles, both slower (swiglu-mosaic-probe-r34b); that knob is gone from the kernel
    # (r34e also walked the tiles column block first: no faster, knob removed)
    tile_sets = [SwigluTiles(), SwigluTiles(cluster=1), SwigluTiles(stages=3),
                 SwigluTiles(cluster=1, approx_math=False), SwigluTiles(tm=128, tn=64, cluster=1)]
    for tokens in token_counts:
        keys = jax.random.split(jax.random.PRNGKey(tokens), 2)
        x = jax.random.normal(keys[0], (tokens, HIDDEN), jnp.bfloat16)
        w = (jax.random.normal(keys[1], (2 * INTER, HIDDEN), jnp.float32) * HIDDEN**-0.5).astype(jnp.bfloat16)
        flops = 2 * tokens * HIDDEN * 2 * INTER
        xla = jax.jit(xla_form, compiler_options=LIBRARY_GEMMS)
        ref = xla(x, w).astype(jnp.float32)

        def timed(f, *args, check=True):
            row = {}
            if check:
                y = f(*args).astype(jnp.float32)
                row["max_err"] = float(jnp.abs(y - ref).max())
                row["max_ref"] = float(jnp.abs(ref).max())
            prof = profile_calls(f, *args)
            row["busy_us"] = round(prof["busy_us"], 1)
            row["tflops"] = round(flops / prof["busy_us"] / 1e6, 1)
            row["kernels"] = [[n[:60], round(us, 1)] for n, us, _ in prof["top"][:4]]
            return row

        rows.append(probe_row({"form": "xla_cublas_then_multiply", "tokens": tokens}, lambda: timed(xla, x, w)))
        plain = jax.jit(lambda x, w: jnp.einsum("ti,oi->to", x, w), compiler_options=LIBRARY_GEMMS)
        rows.append(probe_row({"form": "xla_cublas_product_only", "tokens": tokens},
                              lambda: timed(plain, x, w, check=False)))
        for tiles in tile_sets:
            f = jax.jit(lambda x, w, tiles=tiles: swiglu_product(x, w, tiles))
            row = {"form": "mosaic_swiglu", "tokens": tokens, "tiles": dataclasses.asdict(tiles)}
            try:
                row.update(timed(f, x, w))
            except Exception as e:  # noqa: BLE001
                row["failed"] = repr(e)[:400]
                row["traceback"] = traceback.format_exc()[-3000:]
            print({k: v for k, v in row.items() if k != "traceback"}, flush=True)
            rows.append(row)
        try:
            from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

            wt = jnp.asarray(w.T)
            cfg = hm.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4,
                                  grid_minor_dim=hm.MatmulDimension.N, grid_tile_width=4,
                                  wg_dimension=hm.MatmulDimension.N)
            mm = jax.jit(lambda a, b: hm.matmul(a, b, None, cfg))
            rows.append(probe_row({"form": "jax_hopper_matmul_example", "tokens": tokens},
                                  lambda: timed(mm, x, wt, check=False)))
        except Exception as e:  # noqa: BLE001
            rows.append({"form": "jax_hopper_matmul_example", "failed": repr(e)[:400]})
            print(rows[-1], flush=True)
    with open(out_path, "w") as f:
        json.dump({"benchmark": "swiglu-mosaic-probe", "shape": {"hidden": HIDDEN, "intermediate": INTER},
                   "rows": rows, "env": environment()}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], tuple(int(t) for t in sys.argv[2:]) or (8192, 2048))
