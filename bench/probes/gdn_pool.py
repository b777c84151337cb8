"""Probe: the GDN pool kernel (`gdn_recurrent_pooled`, the engine's recurrence for steps of > 16 rows) by its
program shape, against an XLA pass that reads and writes the same fp32 state bytes.

    python bench/probes/gdn_pool.py OUT.json [BATCH ...]   # on the H200 (PYTHONPATH=.); CPU: a run check only

At batch 64 the pool kernel is ~0.69 ms of the 0.8B decode step (18 layers, each row's 1 MB fp32 state read
and written at ~3.5 TB/s), the largest kernel there. Forms: `bv<BV>-w<W>` the kernel with a dv tile of BV
columns on W warps, `-ef` with evict-first hints on the state's load and stores (the engine's default:
`_value_block`'s tile, `pool_warps(T)`, hints on; r26 chose the last two by this probe); `copy-bv<BV>-w<W>` a Pallas kernel of the same grid that only scales the state tile
in place (what the tiling alone gets); `xla-scale` the state pool scaled in place by XLA (read + write of
the same bytes: the bandwidth a plain pass gets). T = 1 rows (decode) and T = 2 and 4 verify rows (a
checkpoint per position, W = T). Each call chains LAYERS distinct pools, donated, as a
step's layers run, so the states are cold (not in the 50 MB L2); device us per layer from a profiler trace.
"""

import functools
import json
import os
import shutil
import sys
import tempfile

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxgdn.bench.common import environment, profile_summary
from pallas_kernels.common import interpret_default, on_gpu, triton_params
from pallas_kernels.gdn_pallas import _value_block, gdn_recurrent_pooled, pool_warps

Hk, Hv, dk, dv = 16, 16, 128, 128
f32 = jnp.float32


def _copy_kernel(slot_ref, pool_in, pool_ref, *, BV):
    b, h, iv = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    at = (slot_ref[b], 0, h, slice(None), pl.ds(iv * BV, BV))
    pool_ref[at] = pool_ref[at] * 0.999


def pallas_scale(pool, slots, bv, warps):
    """The pool kernel's grid and state tiles with no recurrence: each row's state scaled in place."""
    B, (_, W, Hv, dk, dv) = slots.shape[0], pool.shape
    return pl.pallas_call(
        functools.partial(_copy_kernel, BV=bv), out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        grid=(B, Hv, dv // bv), input_output_aliases={1: 0}, interpret=interpret_default(None),
        compiler_params=triton_params(warps))(slots, pool)


def parse(form):
    """'bv64-w4-ef' -> (kind, bv, warps, evict_first); xla-scale -> ('xla', 0, 0, False)."""
    if form == "xla-scale":
        return "xla", 0, 0, False
    parts = form.split("-")
    kind = "copy" if parts[0] == "copy" else "kernel"
    bv = next(int(x[2:]) for x in parts if x.startswith("bv"))
    warps = next(int(x[1:]) for x in parts if x.startswith("w"))
    return kind, bv, warps, "ef" in parts


def chained(form, layers, T, qkv, g, beta, rows, pools):
    """The form over `layers` pools, one after another on the stream. pools: tuple of [S, W, Hv, dk, dv]."""
    outs, new = [], []
    kind, bv, w, ef = parse(form)
    for pool in pools:
        if kind != "kernel":
            new.append(pool * 0.999 if kind == "xla" else pallas_scale(pool, rows[0], bv, w))
            continue
        o, pool = gdn_recurrent_pooled(qkv, g, beta, pool, *rows, num_warps=w, block_v=bv, evict_first=ef)
        outs.append(o)
        new.append(pool)
    return outs, tuple(new)


def state_bytes(B, T, verify, form):
    """fp32 state bytes a layer must move: one read, one write (T writes for a verify row), per row."""
    tile = B * Hv * dk * dv * 4
    if form == "xla-scale":
        return 2 * (B + 1) * (T if verify else 1) * Hv * dk * dv * 4
    if form.startswith("copy"):
        return 2 * tile
    return tile * (1 + (T if verify else 1))


def time_form(form, layers, T, args, pools, iters=10):
    fn = jax.jit(functools.partial(chained, form, layers, T), donate_argnums=(4,))
    _, pools = fn(*args, pools)
    jax.block_until_ready(pools)
    trace_dir = tempfile.mkdtemp()
    try:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(iters):
                _, pools = fn(*args, pools)
            jax.block_until_ready(pools)
        return profile_summary(trace_dir, divide_by=iters * layers), pools
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)


def main(out_path, batches=(32, 64, 128)):
    gpu = on_gpu()
    forms = os.environ.get("PROBE_FORMS", "").split() or (
        ["xla-scale", "copy-bv64-w4", "copy-bv128-w4", "copy-bv64-w2"]
        + [f"bv{bv}-w{w}" for bv in (32, 64, 128) for w in (2, 4, 8)] + ["bv64-w4-ef", "bv64-w2-ef"]
        if gpu else ["bv64-w4", "bv32-w2-ef", "copy-bv64-w4", "xla-scale"])
    result = {"benchmark": "gdn-pool-probe", "rows": [], "env": environment(),
              "timing": "device us per layer from a profiler trace of chained layers (distinct donated pools)"}
    key = jax.random.PRNGKey(0)
    for B in batches if gpu else (2,):
        for T, verify in ((1, False), (2, True), (4, True)):
            W = T if verify else 1
            pool_mb = (B + 1) * W * Hv * dk * dv * 4 / 1e6
            layers = max(2, min(8, int(600 // pool_mb))) if gpu else 2
            ks = jax.random.split(key, 4)
            qkv = jax.random.normal(ks[0], (B, T, 2 * Hk * dk + Hv * dv), f32).astype(jnp.bfloat16)
            g = -jax.nn.softplus(jax.random.normal(ks[1], (B, T, Hv)))
            beta = jax.nn.sigmoid(jax.random.normal(ks[2], (B, T, Hv)))
            rows = (jnp.arange(1, B + 1, dtype=jnp.int32), jnp.zeros(B, jnp.int32), jnp.zeros(B, jnp.int32),
                    jnp.full(B, int(verify), jnp.int32))
            for form in forms:
                pools = tuple(0.1 * jax.random.normal(jax.random.fold_in(ks[3], i), (B + 1, W, Hv, dk, dv), f32)
                              for i in range(layers))
                if not gpu:
                    jax.block_until_ready(jax.jit(functools.partial(chained, form, layers, T))(qkv, g, beta, rows, pools))
                    print(f"B {B} T {T} {form}: ran")
                    continue
                prof, pools = time_form(form, layers, T, (qkv, g, beta, rows), pools)
                del pools
                us = prof["busy_us"]
                row = {"batch": B, "T": T, "verify": verify, "form": form, "layers_chained": layers,
                       "default_form": form == f"bv{_value_block(dv, B * Hv)}-w{pool_warps(T)}-ef", "us_per_layer": us,
                       "state_MB": state_bytes(B, T, verify, form) / 1e6,
                       "TB_per_s": state_bytes(B, T, verify, form) / us / 1e6, "top_kernels": prof.get("top", [])[:3]}
                result["rows"].append(row)
                print(f"B {B:3d} T {T} {form:10s} {us:7.2f} us/layer {row['TB_per_s']:5.2f} TB/s"
                      f"{'  (default)' if row['default_form'] else ''}", flush=True)
                if out_path:
                    with open(out_path, "w") as f:
                        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None, tuple(int(b) for b in sys.argv[2:]) or (32, 64, 128))
