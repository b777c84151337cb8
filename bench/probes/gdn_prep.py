"""Probe: forms of the chunked GDN's prep kernel (γ, (I+A)⁻¹, W, U, Kd per chunk) and scan kernel at the
0.8B's prefill shapes (16 heads, dk = dv = 128, bf16 inputs).

    python bench/probes/gdn_prep.py OUT.json      # on the H200 (PYTHONPATH=.:tests); CPU: correctness only

r9 held the chunk's L2-normed keys, β-scaled keys and β-scaled values as three [64, dk] fp32 lists across the
kernel (about 190 registers a thread at 4 warps, before anything else); the lean form keeps the raw bf16
tiles and folds the norms, β and decays into the [16, 16] tiles. `noinv` is a diagnostic, not a kernel:
the lean form with the diagonal blocks' forward substitution skipped (wrong output), to price that solve.
Each row: the forms, the prep kernel's warps, µs per call of the three kernels, and max |o - o_ref| against
the XLA chunked form in fp32. The results of 2026-12-01 also time the scan's hand-written prefetch, which
Triton's 3-stage loop pipelining replaced (bench/probes/gdn_solve_scan.py in commit 8cc9ca1).
"""

import functools
import json
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

import pallas_kernels.gdn_pallas as gp
from jaxgdn.bench.common import environment, gdn_probe_shapes, probe_row, profile_calls, random_gdn_inputs
from pallas_kernels.gdn import gdn_chunked

f32 = jnp.float32


def _prep_kernel_r9(k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, kscale_ref, gam_ref, *, group, dtype):
    """r9's prep kernel, for comparison: normed keys, β·keys and β·values live as fp32 [SUB, dk] lists (since
    r19 it stores the scan's key scale instead of r9's scaled keys, as the lean form does)."""
    b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    hk = h // group
    nsub = gp.CHUNK // gp.SUB
    ks, kb, vb, gam = [], [], [], []
    offset = jnp.zeros((), f32)
    for i in range(nsub):
        rows = pl.ds(c * gp.CHUNK + i * gp.SUB, gp.SUB)
        k = gp._l2norm(k_ref[b, rows, hk, :].astype(f32))
        beta = beta_ref[b, rows, h]
        g = g_ref[b, rows, h]
        gi = jnp.cumsum(g) + offset
        offset = offset + jnp.sum(g)
        gam_ref[b, rows, h] = gi
        ks.append(k)
        kb.append(k * beta[:, None])
        vb.append(v_ref[b, rows, h, :].astype(f32) * beta[:, None])
        gam.append(gi)
    r = lax.broadcasted_iota(jnp.int32, (gp.SUB, gp.SUB), 0)
    cc = lax.broadcasted_iota(jnp.int32, (gp.SUB, gp.SUB), 1)

    def a_block(i, j):
        diff = gam[i][:, None] - gam[j][None, :]
        if i == j:
            diff = jnp.where(r > cc, diff, -jnp.inf)
        return gp._dot(kb[i], ks[j].T, dtype) * jnp.exp(diff)

    A = {(i, j): a_block(i, j) for i in range(nsub) for j in range(i + 1)}
    inv = {}
    for i in range(nsub):
        inv[i, i] = gp._unit_lower_inverse(A[i, i])
        for j in range(i - 1, -1, -1):
            acc = sum(gp._dot(A[i, m], inv[m, j], f32) for m in range(j, i))
            inv[i, j] = -gp._dot(inv[i, i], acc, f32)
    for i in range(nsub):
        rows = pl.ds(c * gp.CHUNK + i * gp.SUB, gp.SUB)
        u = sum(gp._dot(inv[i, j], vb[j], dtype) for j in range(i + 1))
        w = sum(gp._dot(inv[i, j], kb[j] * jnp.exp(gam[j])[:, None], dtype) for j in range(i + 1))
        u_ref[b, rows, h, :] = u.astype(u_ref.dtype)
        w_ref[b, rows, h, :] = w.astype(w_ref.dtype)
        raw = k_ref[b, rows, hk, :].astype(f32)
        kscale_ref[b, rows, h] = lax.rsqrt(jnp.sum(raw * raw, axis=-1) + 1e-6) * jnp.exp(offset - gam[i])


_LEAN_PREP = gp._prep_kernel


def _prep_kernel_noinv(*refs, group, dtype):
    """Diagnostic: the lean prep kernel with (I + A_ii)⁻¹ replaced by I (output wrong; timing only)."""
    saved = gp._unit_lower_inverse
    gp._unit_lower_inverse = lambda a: (lax.broadcasted_iota(jnp.int32, a.shape, 0)
                                        == lax.broadcasted_iota(jnp.int32, a.shape, 1)).astype(f32)
    try:
        _LEAN_PREP(*refs, group=group, dtype=dtype)
    finally:
        gp._unit_lower_inverse = saved


# (name, prep kernel, prep warps)
FORMS = (("r9", _prep_kernel_r9, 4), ("lean", gp._prep_kernel, 2), ("lean-w1", gp._prep_kernel, 1),
         ("noinv", _prep_kernel_noinv, 2))


def run_form(prep, warps, *args):
    """gdn_chunked_pallas with `prep` as its prep kernel (a module global it looks up when traced)."""
    gp._prep_kernel = prep
    try:
        f = jax.jit(functools.partial(gp.gdn_chunked_pallas, warps=(warps, 4, 4)))
        out = f(*args)
        summary = profile_calls(f, *args) if jax.default_backend() == "gpu" else {"top": []}
    finally:
        gp._prep_kernel = _LEAN_PREP
    return out, {name: round(us, 1) for name, us, _ in summary["top"] if name.startswith("_")}


def main(out_path=None):
    _, shapes, H, d = gdn_probe_shapes()
    rows = []
    for B, T in shapes:
        q, k, v, g, beta = random_gdn_inputs(B, T, H, d, seed=B * T)
        ref, _ = jax.jit(gdn_chunked)(*(x.astype(f32) for x in (q, k, v)), g, beta)
        for name, prep, warps in FORMS:

            def measure(prep=prep, warps=warps):
                (o, _), us = run_form(prep, warps, q, k, v, g, beta)
                return {"us": us, "error": float(jnp.abs(o - ref).max())}

            rows.append(probe_row({"shape": [B, T, H, d], "form": name, "prep_warps": warps}, measure))
    if out_path:
        with open(out_path, "w") as f:
            json.dump({"benchmark": "gdn-prep-probe", "rows": rows, "env": environment()}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
