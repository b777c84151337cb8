"""Probe: decode-shaped weight products (x [M, K] @ w[N, K].T, M = 1..64) as a Mosaic GPU kernel that streams
the weight through shared memory with TMA and multiplies on wgmma, against XLA's choice, with cold weights.

    python bench/probes/skinny_mosaic.py OUT.json [M ...]      # on the H200 (PYTHONPATH=.); needs Mosaic GPU
    PROBE_SWIGLU=1 python bench/probes/skinny_mosaic.py OUT.json 64   # the MLP's gate/up + SiLU * up only

Why: inside a batch-64 decode step the trunk's weight products run at 0.9-2 TB/s (r30 inventory: gate/up 7.4 us
for 14.7 MB, in_proj 9.0 for 16.8 MB), at batch 1 at ~2.4 TB/s, where the LM head's product reaches 4.3 TB/s;
r7/r8 tried XLA's Triton GEMMs, cuBLAS and Pallas-Triton GEMVs (`cold_products.py`): none passed ~2.4 TB/s
cold. A kernel that keeps `stages` TMA loads of weight tiles in flight per CTA is the form that reaches HBM
bandwidth on Hopper; this measures whether it does at these sizes.

Two layouts, both "acc[A rows, B rows] += A_tile [., tk] . B_tile [., tk].T" on K-major tiles:
- `rows` (M = 64): A = x [64, tk] (the whole x, re-read from L2 by every CTA), B = a [tn, tk] weight tile;
  the CTA owns output columns [tn] -> out [M, N].
- `swap` (M <= 8, padded to 8): A = a [64, tk] weight tile, B = x [8, tk]; acc [64, 8] is y.T's tile ->
  out [N, 8], whose column 0..M-1 is the product (the transpose is a reshape at M = 1).
Grid (N / tile, k_split): k_split > 1 writes fp32 partials [k_split, ...] summed by XLA after the kernel
(counted in the timing). Each timed call chains COPIES products on distinct weights (cold, >> the 50 MB L2).
"""

import functools
import json
import os
import sys
import traceback

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from cold_products import cold_us  # noqa: E402  (bench/probes is on the path when run as a script)

from jaxgdn.bench.common import environment  # noqa: E402
from pallas_kernels import swiglu_mosaic  # noqa: E402

f32 = jnp.float32
SHAPES = ((8224, 1024), (7168, 1024), (1024, 3584), (1024, 2048), (5120, 1024))  # [N out, K in] of the 0.8B


def _kernel(x_gmem, w_gmem, o_gmem, *, swap, tile, tk, stages, k_split):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    ni, ki = lax.axis_index("n"), lax.axis_index("k")
    mx, k = x_gmem.shape
    k_per = k // k_split
    dtype = x_gmem.dtype
    transforms = swiglu_mosaic._transforms(tk, dtype)  # the swizzled tiling wgmma reads
    spec = lambda rows: plgpu.BlockSpec((rows, tk), lambda kk: (0, kk), transforms=transforms)  # noqa: E731
    x_part = x_gmem.at[:, pl.ds(ki * k_per, k_per)]
    w_part = w_gmem.at[pl.ds(ni * tile, tile), pl.ds(ki * k_per, k_per)]
    acc_shape = (tile, mx) if swap else (mx, tile)
    out_tile = o_gmem.at[ki, pl.ds(ni * tile, tile)] if swap else o_gmem.at[ki, :, pl.ds(ni * tile, tile)]

    @functools.partial(pl.run_scoped, acc=plgpu.ACC(acc_shape, f32), out_smem=plgpu.SMEM(acc_shape, o_gmem.dtype))
    def _scope(acc, out_smem):
        def step(_, x_smem, w_smem):
            if swap:
                plgpu.wgmma(acc, w_smem, plgpu.transpose_ref(x_smem, (1, 0)))
            else:
                plgpu.wgmma(acc, x_smem, plgpu.transpose_ref(w_smem, (1, 0)))
            plgpu.wgmma_wait(0)  # the slot is released when the step returns

        plgpu.emit_pipeline(step, grid=(k_per // tk,), in_specs=[spec(mx), spec(tile)],
                            max_concurrent_steps=stages)(x_part, w_part)
        out_smem[...] = acc[...].astype(o_gmem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_tile)
        plgpu.wait_smem_to_gmem(0)


def mosaic_skinny_product(x, w, *, swap=False, tile=64, tk=64, stages=4, k_split=1):
    """x [M, K] @ w [N, K].T -> [M, N] in x.dtype. swap: M <= 8 (x padded to 8 rows), tile = 64 weight rows a
    CTA; else M = 64, tile = the CTA's output columns."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    m, k = x.shape
    n = w.shape[0]
    mx = 8 if swap else m
    if (swap and m > 8) or (not swap and m != 64) or n % tile or k % (tk * k_split):
        raise ValueError(f"shape {x.shape} x {w.shape} does not fit swap={swap} tile={tile} tk={tk} k{k_split}")
    xp = jnp.pad(x, ((0, mx - m), (0, 0))) if mx != m else x
    out_dtype = f32 if k_split > 1 else x.dtype
    out_shape = (k_split, n, mx) if swap else (k_split, mx, n)
    call = plgpu.kernel(
        functools.partial(_kernel, swap=swap, tile=tile, tk=tk, stages=stages, k_split=k_split),
        out_type=jax.ShapeDtypeStruct(out_shape, out_dtype), grid=(n // tile, k_split), grid_names=("n", "k"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    parts = call(xp, w)
    y = parts[0] if k_split == 1 else parts.sum(0).astype(x.dtype)
    return y[:, :m].T if swap else y


# (swap, tile, tk, stages, k_split)
CONFIGS_64 = ((False, 64, 64, 4, 1), (False, 32, 64, 4, 1), (False, 64, 64, 6, 1), (False, 64, 128, 3, 1),
              (False, 32, 64, 4, 2), (False, 64, 64, 4, 2))
CONFIGS_SMALL = ((True, 64, 64, 4, 1), (True, 64, 128, 4, 1), (True, 64, 64, 8, 1), (True, 64, 64, 4, 2),
                 (True, 64, 128, 4, 2))


def swiglu_rows(ms, key):
    """The MLP's fused gate/up product with SiLU(gate) * up at decode sizes: XLA's form (the product, then the
    pass) against `swiglu_mosaic.swiglu_product_small`, cold (16 distinct 0.8B weights chained)."""
    width, k = 3584, 1024
    ws = [jax.random.normal(jax.random.fold_in(key, i), (2 * width, k), jnp.bfloat16) * 0.03 for i in range(16)]

    def xla(x, w):
        gate, up = jnp.split(jnp.dot(x, w.T), 2, axis=-1)
        return jax.nn.silu(gate) * up

    for m in ms:
        x = jax.random.normal(key, (m, k), jnp.bfloat16)
        ref = xla(x, ws[0]).astype(f32)
        row = {"form": "swiglu", "M": m, "MB": round(2 * width * k * 2 / 1e6, 2), "xla_us": cold_us(xla, x, ws)[0]}
        try:
            got = jax.jit(swiglu_mosaic.swiglu_product_small)(x, ws[0]).astype(f32)
            err = float(jnp.abs(got - ref).max() / jnp.abs(ref).max())
            row["small_kernel"] = (cold_us(swiglu_mosaic.swiglu_product_small, x, ws)[0], round(err, 4))
        except Exception:  # noqa: BLE001
            row["small_kernel"] = traceback.format_exc()[-600:]
        print(json.dumps(row), flush=True)
        yield row


def main(out_path=None, ms=(1, 8, 64)):
    key = jax.random.PRNGKey(0)
    rows = []
    payload = {"benchmark": "skinny-mosaic-probe", "rows": rows, "env": environment()}

    def save(row):  # after every row: a cut call keeps what it measured
        rows.append(row)
        if out_path:
            with open(out_path, "w") as f:
                json.dump(payload, f, indent=1)

    if os.environ.get("PROBE_SWIGLU"):
        for row in swiglu_rows(ms, key):
            save(row)
        return
    for n, k in SHAPES:
        ws = [jax.random.normal(jax.random.fold_in(key, i), (n, k), jnp.bfloat16) for i in range(16)]
        for m in ms:
            x = jax.random.normal(key, (m, k), jnp.bfloat16)
            ref = jnp.dot(x.astype(f32), ws[0].astype(f32).T)
            row = {"N": n, "K": k, "M": m, "MB": round(n * k * 2 / 1e6, 2)}
            row["xla_us"] = cold_us(lambda x, w: jnp.dot(x, w.T), x, ws)[0]
            for swap, tile, tk, stages, split in CONFIGS_SMALL if m <= 8 else CONFIGS_64:
                if n % tile or k % (tk * split):
                    continue
                name = f"{'swap' if swap else 'rows'}_{tile}x{tk}s{stages}k{split}"
                product = functools.partial(mosaic_skinny_product, swap=swap, tile=tile, tk=tk, stages=stages,
                                            k_split=split)
                try:
                    got = jax.jit(product)(x, ws[0]).astype(f32)
                    err = float(jnp.abs(got - ref).max() / jnp.abs(ref).max())
                    row[name] = (cold_us(product, x, ws)[0], round(err, 4))
                except Exception:  # noqa: BLE001 - a config that does not lower is a result too
                    row[name] = traceback.format_exc()[-600:]
                    print(name, row[name], flush=True)
            timed = {kk: v[0] for kk, v in row.items() if isinstance(v, tuple)}
            best = min(timed, key=timed.get) if timed else None
            if best:
                row["best"] = best
                row["best_tb_s"] = round(n * k * 2 / timed[best] / 1e6, 2)
            row["xla_tb_s"] = round(n * k * 2 / row["xla_us"] / 1e6, 2)
            print(json.dumps({kk: v for kk, v in row.items() if not isinstance(v, str)}), flush=True)
            save(row)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None,
         tuple(int(a) for a in sys.argv[2:]) or (1, 8, 64))
