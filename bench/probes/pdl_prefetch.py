"""Probe: do decode-shaped weight products stream faster when each kernel loads its weights *before* it waits
for the kernel ahead of it (programmatic dependent launch, PDL)?

    python bench/probes/pdl_prefetch.py OUT.json      # on the H200 (PYTHONPATH=.); CPU: a correctness pass only

Why: at batch 1 the trunk's products stream ~1 GB a step at ~2.4 TB/s (r30), where one long stream reaches
~4 TB/s: each product is a few microseconds, and the DRAM pipeline drains and refills between kernels. XLA
launches every kernel with PDL but puts `griddepcontrol.wait` at the kernel's entry and never triggers its
dependents early (openxla/xla#38544), so a product's weight loads start only after the kernel ahead has
finished. A product's weights do not depend on the kernel ahead; only its input vector does. Here each GEMV
kernel (Pallas Triton, y = W x, one [BN, K] weight tile a program) can
  - `trigger`: `griddepcontrol.launch_dependents` at its start, so the next kernel's programs may become
    resident while this one runs;
  - `prefetch`: load its weight tile, then `griddepcontrol.wait`, then load x (its address depends on the
    wait's result, so it cannot move above it).
Forms: `xla` (jnp.dot chain), `plain` (no PDL instructions), `wait` (trigger + wait, then every load: XLA's
order), `prefetch` (trigger + weight loads + wait + x), `prefetch_notrigger`. A timed call chains `PAIRS`
pairs of products 1024 -> 4096 -> 1024 on distinct weights (>> the 50 MB L2, so cold); the wall time per call
of back-to-back calls (the queue stays full) gives microseconds per product and TB/s of weight bytes.
"""

import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxgdn.bench.common import environment, profile_calls
from pallas_kernels.common import triton_params

f32 = jnp.float32
HIDDEN, WIDE = 1024, 4096
PAIRS = int(os.environ.get("PDL_PROBE_PAIRS", 24))  # 48 products of 8 MiB: 384 MiB a call
FORMS = ("xla", "plain", "wait", "prefetch", "prefetch_notrigger")


def _asm_token(asm: str, *tokens):
    """Run `asm` once a thread after the int32 scalars `tokens` exist; returns an opaque int32 0 (data-depend on
    it to order loads after the asm: the lowering marks the asm pure, so only data dependencies order it)."""
    from jax.experimental.pallas import triton as plt

    # Triton has no 0-d tensors: the asm runs on [1]-shaped operands, reduced back to a scalar
    constraints = "=r" + ",r" * len(tokens)
    [out] = plt.elementwise_inline_asm(f"{asm}\n\tmov.u32 $0, 0;", args=[jnp.full((1,), t, jnp.int32) for t in tokens],
                                       constraints=constraints, pack=1,
                                       result_shape_dtypes=[jax.ShapeDtypeStruct((1,), jnp.int32)])
    return jnp.max(out)


def _gemv_kernel(x_ref, w_ref, o_ref, *, form, use_asm):
    """One program: o[BN] = w[BN, K] . x[K] (fp32 accumulate); x_ref [K], w_ref [BN, K] block, o_ref [BN]."""
    bn, k = w_ref.shape
    tokens = []  # int32 scalars the next asm waits for
    if use_asm and form in ("wait", "prefetch"):
        tokens.append(_asm_token("griddepcontrol.launch_dependents;", pl.program_id(0)))
    token = 0  # the offset x (and w, in `wait`) is read at: 0, data-dependent on the wait when there is one
    if form.startswith("prefetch"):
        w = w_ref[...].astype(f32)
        if use_asm:
            # a value of the weight tile feeds the wait, so the tile's loads are issued ahead of it
            token = _asm_token("griddepcontrol.wait;", *tokens, (jnp.max(w) > 3.0e38).astype(jnp.int32))
        x = x_ref[pl.ds(token, k)].astype(f32)
    else:
        if use_asm and form == "wait":
            token = _asm_token("griddepcontrol.wait;", *tokens)
        x = x_ref[pl.ds(token, k)].astype(f32)
        w = w_ref[pl.ds(token, bn), :].astype(f32)
    o_ref[...] = jnp.sum(w * x[None, :], axis=1).astype(o_ref.dtype)


def gemv(x, w, form: str, programs: int = 128, warps: int = 8, interpret: bool = False):
    """y[N] = w[N, K] @ x[K] in x.dtype through the GEMV kernel above in `form`."""
    n, k = w.shape
    bn = n // programs
    kernel = functools.partial(_gemv_kernel, form=form, use_asm=not interpret)
    return pl.pallas_call(
        kernel, grid=(programs,), interpret=interpret, compiler_params=triton_params(warps, 1),
        in_specs=[pl.BlockSpec((k,), lambda i: (0,)), pl.BlockSpec((bn, k), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((bn,), lambda i: (i,)), out_shape=jax.ShapeDtypeStruct((n,), x.dtype))(x, w)


def chain(x, ws, form, programs=128, warps=8, interpret=False):
    """x [HIDDEN] through the products ws (alternately [WIDE, HIDDEN] and [HIDDEN, WIDE]) -> [HIDDEN]."""
    for w in ws:
        x = jnp.dot(w, x) if form == "xla" else gemv(x, w, form, programs, warps, interpret)
    return x


def wall_us(fn, *args, calls=20, reps=5):
    """Median over `reps` of the wall microseconds per call of `calls` back-to-back calls (after a warm one)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return sorted(times)[len(times) // 2]


def main(out_path=None):
    interpret = jax.default_backend() != "gpu"
    key = jax.random.PRNGKey(0)
    hidden, wide, pairs = (64, 256, 1) if interpret else (HIDDEN, WIDE, PAIRS)
    ws = []
    for i in range(pairs):
        ws.append(jax.random.normal(jax.random.fold_in(key, 2 * i), (wide, hidden), jnp.bfloat16) / hidden ** 0.5)
        ws.append(jax.random.normal(jax.random.fold_in(key, 2 * i + 1), (hidden, wide), jnp.bfloat16) / wide ** 0.5)
    x = jax.random.normal(key, (hidden,), jnp.bfloat16)
    weight_bytes = sum(w.size * 2 for w in ws)
    ref = jax.jit(functools.partial(chain, form="xla"))(x, ws).astype(f32)
    rows = []
    settings = ([(f, 8, 4) for f in FORMS] if interpret  # programs, warps
                else [(f, 128, 8) for f in FORMS] + [(f, 256, 4) for f in FORMS[1:]])
    for form, programs, warps in settings:
        row = {"form": form, "programs": programs, "warps": warps, "products": len(ws),
               "weight_mb_per_call": round(weight_bytes / 1e6, 1)}
        try:
            fn = jax.jit(functools.partial(chain, form=form, programs=programs, warps=warps, interpret=interpret))
            got = fn(x, ws).astype(f32)
            row["max_rel_err"] = float(jnp.abs(got - ref).max() / jnp.abs(ref).max())
            if not interpret:
                us = wall_us(fn, x, ws)
                row["us_per_call"] = round(us, 1)
                row["us_per_product"] = round(us / len(ws), 3)
                row["weight_tb_per_s"] = round(weight_bytes / us / 1e6, 3)
                prof = profile_calls(fn, x, ws, iters=10)
                row["busy_us_per_call"] = round(prof["busy_us"], 1)
                row["span_us_per_call"] = round(prof["span_us"], 1)
        except Exception as e:  # noqa: BLE001 - a form that does not lower is a result too
            row["failed"] = repr(e)[:400]
        print(row, flush=True)
        rows.append(row)
    if out_path:
        with open(out_path, "w") as f:
            json.dump({"probe": "pdl_prefetch", "environment": environment(), "rows": rows}, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
