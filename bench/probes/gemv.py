"""Probe: decode-shaped weight products on the GPU, XLA's choice vs a Pallas (Triton) GEMV, bf16.

    python bench/probes/gemv.py OUT.json          # on the H200 (PYTHONPATH=.); CPU: a correctness pass only
    PROBE_XLA_ONLY=1 XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python bench/probes/gemv.py OUT.json

Shapes are the 0.8B model's [N out, K in] products (GDN in_proj, MLP gate/up and down, out_proj, attention
q/k/v) at M = 1, 8, 64 rows. Times are device microseconds per call read from a profiler trace (timing
Python-dispatched calls measures ~30 us of dispatch, not the kernel). Each call repeats one matrix, which
then sits in the H200's 50 MB L2: these are L2-hot times (XLA's read 3.1-4.3 TB/s); `cold_products.py` times
the same shapes cold, as the model's layers run them. Columns: `xla_us` a plain product,
`xla_norm_us` the in-model form (an RMSNorm of x ahead of it, which XLA may fuse), `pallas_<BN>x<BK>w<warps>
s<stages>k<split>` (us, relative error) the GEMV kernel below with BN output rows per program, BK-wide K
blocks and K split over `split` programs (partial sums added after)."""

import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxgdn.bench.common import profile_calls
from pallas_kernels.common import triton_params

f32 = jnp.float32
CONFIGS = ((16, 256, 4, 3, 1), (32, 256, 4, 3, 1), (64, 128, 4, 3, 1), (16, 512, 4, 4, 1),
           (16, 256, 4, 3, 2), (16, 256, 4, 3, 4), (32, 256, 4, 3, 4), (16, 128, 4, 4, 8))


def _gemv_kernel(x_ref, w_ref, o_ref, *, BN, BK, k_per_program):
    """Program (n, s): rows n*BN.. of the output over K block s; x [Mp, K], w [N, K], o [split, Mp, N] fp32."""
    rows = pl.ds(pl.program_id(0) * BN, BN)
    k0 = pl.program_id(1) * k_per_program

    def body(i, acc):
        w = w_ref[rows, pl.ds(k0 + i * BK, BK)]
        x = x_ref[:, pl.ds(k0 + i * BK, BK)]
        return acc + jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=f32)

    acc = jax.lax.fori_loop(0, k_per_program // BK, body, jnp.zeros((x_ref.shape[0], BN), f32))
    o_ref[pl.program_id(1), :, rows] = acc


def pallas_gemv(x, w, BN, BK, warps, stages, split=1, interpret=False):
    """x [M, K] @ w[N, K]ᵀ -> [M, N] in x.dtype; M is padded to 16 rows (the smallest Triton dot)."""
    M, K = x.shape
    N = w.shape[0]
    Mp = max(16, M)
    xp = jnp.pad(x, [(0, Mp - M), (0, 0)])
    kernel = functools.partial(_gemv_kernel, BN=BN, BK=BK, k_per_program=K // split)
    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((split, Mp, N), f32), grid=(N // BN, split),
                         interpret=interpret, compiler_params=triton_params(warps, stages))(xp, w)
    return out.sum(0)[:M].astype(x.dtype)


def device_us(fn, *args, iters=50):
    """Device microseconds per call of jit(fn)(*args), from a profiler trace of `iters` calls."""
    return profile_calls(jax.jit(fn), *args, iters=iters)["busy_us"]


def normed_product(x, w):
    """The in-model form: an RMSNorm of x ahead of the product."""
    xf = x.astype(f32)
    xn = (xf * jax.lax.rsqrt((xf * xf).mean(-1, keepdims=True) + 1e-6)).astype(x.dtype)
    return jnp.dot(xn, w.T)


def main(out_path=None):
    interpret = jax.default_backend() != "gpu"
    xla_only = bool(os.environ.get("PROBE_XLA_ONLY"))
    key = jax.random.PRNGKey(0)
    shapes = [(64, 1024)] if interpret else [(8224, 1024), (7168, 1024), (1024, 3584), (1024, 2048), (5120, 1024)]
    rows = []
    for N, K in shapes:
        w = jax.random.normal(key, (N, K), jnp.bfloat16)
        for M in (1, 3) if interpret else (1, 8, 64):
            x = jax.random.normal(key, (M, K), jnp.bfloat16)
            ref = jnp.dot(x, w.T, preferred_element_type=f32)
            row = {"N": N, "K": K, "M": M,
                   "xla_us": None if interpret else device_us(lambda x, w: jnp.dot(x, w.T), x, w),
                   "xla_norm_us": None if interpret else device_us(normed_product, x, w)}
            for BN, BK, warps, stages, split in () if xla_only else CONFIGS:
                if N % BN or K % (BK * split) or (M > 16 and BN < 32):
                    continue
                name = f"pallas_{BN}x{BK}w{warps}s{stages}k{split}"
                try:
                    got = pallas_gemv(x, w, BN, BK, warps, stages, split, interpret=interpret)
                    err = float(jnp.abs(got.astype(f32) - ref).max() / jnp.abs(ref).max())
                    us = None if interpret else device_us(
                        lambda x, w: pallas_gemv(x, w, BN, BK, warps, stages, split), x, w)
                    row[name] = (us, round(err, 4))
                except Exception as e:  # noqa: BLE001 - a config that does not lower is a result too
                    row[name] = repr(e)[:120]
            rows.append(row)
            timed = {k: v[0] for k, v in row.items() if k.startswith("pallas") and isinstance(v, tuple) and v[0]}
            best = min(timed, key=timed.get, default=None)
            gb = N * K * 2 / 1e9
            rate = lambda us: round(gb / us * 1e3, 2) if us else None  # noqa: E731 - TB/s of weight bytes
            print(f"N{N} K{K} M{M}: xla {row['xla_us']} us ({rate(row['xla_us'])} TB/s), norm+xla "
                  f"{row['xla_norm_us']} us, best pallas {best} {timed.get(best)} us ({rate(timed.get(best))} TB/s)",
                  flush=True)
    if out_path:
        with open(out_path, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
