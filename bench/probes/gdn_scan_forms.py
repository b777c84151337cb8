"""Probe: forms of the chunked GDN's prep and scan kernels at the long-row shapes, beside fla's kernels one by one.

    python bench/probes/gdn_scan_forms.py OUT.json      # on the H200 (PYTHONPATH=/tmp/site:.:tests); CPU: errors only

At one row the scan is the serial part: 128 programs (16 heads x 8 dv tiles) walk every chunk in turn, and
the chunk-state kernel was 191 µs of a layer's 434 at 8192 tokens. `wy` is the committed form (two
matmuls on the serial chain: V' = U - W S, then S <- e^γ S + KdᵀV'); `transition` regroups the same
update as S <- e^γ S - (KdᵀW) S + KdᵀU with the next chunk's KdᵀW formed while this chunk's update runs
(one matmul on the chain; first run: 547 µs against wy's 376 at 1x16384, rejected). `kd_t` stores Kd
transposed ([B, Hv, dk, T]) so the scan loads Kdᵀ as a tile instead of transposing it in registers every
chunk. `split` divides the prep kernel as fla does: `_solve_kernel` (γ and (I+A)⁻¹, stored as a whole
[64, 64] tile) and `_wu_kernel` (W and U as [64, 64] x [64, d] products) instead of [16, 16] blocks.
Rows: shape, form, µs per call of each of our kernels, end-to-end ms, max |o - o_ref| against the XLA
chunked form in fp32; then fla 0.6.0's `chunk_gated_delta_rule` on the same inputs: end-to-end ms and
µs per call of each of its kernels (torch profiler, run after all of ours: once torch's profiler has
run, JAX's can no longer subscribe to CUPTI in that process).
"""

import functools

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxgdn.bench.common import (ensure_triton_cache_dir, environment, probe_row, profile_calls, random_gdn_inputs,
                                 time_jax, time_torch)
from pallas_kernels.gdn import gdn_chunked
import pallas_kernels.gdn_pallas as gp
from jax import lax
from jax.experimental import pallas as pl

f32 = jnp.float32
SHAPES = ((1, 16384), (1, 8192), (8, 2048))
# (name, scan form, prep form, Kd transposed, scan warps)
FORMS = (("wy", "wy", "fused", False, 4), ("wy+kd_t", "wy", "fused", True, 4), ("split", "wy", "split", False, 4),
         ("split+kd_t", "wy", "split", True, 4), ("split+kd_t-w8", "wy", "split", True, 8))


def _scan_transition_kernel(w_ref, u_ref, kd_ref, gam_ref, s0_ref, h_ref, vn_ref, sT_ref, *, N, BV, dtype, prefetch,
                            kd_t=False):
    """The transition form (rejected): S <- e^{γ_last} S - P S + Bm, P = KdᵀW [dk, dk], Bm = KdᵀU [dk, BV]
    of chunk n+1 formed while chunk n's update runs; V' = U - W S off the chain."""
    assert not kd_t
    b, h, iv = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(iv * BV, BV)

    def load(n):
        rows = pl.ds(n * gp.CHUNK, gp.CHUNK)
        w, u, kd = w_ref[b, rows, h, :], u_ref[b, rows, h, cols], kd_ref[b, rows, h, :]
        kdt = kd.T
        return (w, u, gp._dot(kdt, w, dtype).astype(dtype), gp._dot(kdt, u, dtype),
                gam_ref[b, n * gp.CHUNK + gp.CHUNK - 1, h])

    def chunk(n, carry):
        S, (w, u, p, bm, g_last) = carry
        ahead = load(jnp.minimum(n + 1, N - 1))
        h_ref[b, n, h, :, cols] = S.astype(h_ref.dtype)
        vn_ref[b, pl.ds(n * gp.CHUNK, gp.CHUNK), h, cols] = (u.astype(f32) - gp._dot(w, S, dtype)).astype(vn_ref.dtype)
        return S * jnp.exp(g_last) + bm - gp._dot(p, S, dtype), ahead

    sT_ref[b, h, :, cols] = lax.fori_loop(0, N, chunk, (s0_ref[b, h, :, cols].astype(f32), load(0)))[0]


def compiled_form(scan_form, args, **kw):
    """(jitted gdn_chunked_pallas(**kw), its output on args), traced with the transition scan patched in
    when scan_form says so (the patch must be live while the function traces)."""
    saved = gp._scan_kernel
    if scan_form == "transition":
        gp._scan_kernel = _scan_transition_kernel
    try:
        f = jax.jit(functools.partial(gp.gdn_chunked_pallas, **kw))
        return f, f(*args)
    finally:
        gp._scan_kernel = saved


def fla_kernel_us(call, iters: int = 10) -> dict:
    """µs per call of each CUDA kernel fla launches in `call()` (torch profiler, after a warm call)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            call()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t:
            out[e.key[:80]] = round(t / iters, 1)
    return dict(sorted(out.items(), key=lambda kv: -kv[1])[:12])


def main(out_path=None):
    gpu = jax.default_backend() == "gpu"
    shapes, H, d = (SHAPES, 16, 128) if gpu else (((1, 256),), 2, 32)
    rows = []

    def save():
        if out_path:
            with open(out_path, "w") as f:
                json.dump({"benchmark": "gdn-scan-forms-probe", "rows": rows, "env": environment()}, f, indent=1)

    inputs = {(B, T): random_gdn_inputs(B, T, H, d, seed=B * T) for B, T in shapes}
    for (B, T), args in inputs.items():
        ref, _ = jax.jit(gdn_chunked)(*(x.astype(f32) for x in args[:3]), *args[3:])
        for name, scan_form, prep_form, kd_t, warps in FORMS:

            def measure(scan_form=scan_form, prep_form=prep_form, kd_t=kd_t, warps=warps):
                f, (o, _) = compiled_form(scan_form, args, prep_form=prep_form, kd_transposed=kd_t,
                                          warps=(2, warps, 4))
                row = {"error": float(jnp.abs(o - ref).max())}
                if gpu:
                    row["ms"] = time_jax(f, *args)
                    row["us"] = {n: round(us, 1) for n, us, _ in profile_calls(f, *args)["top"] if n.startswith("_")}
                return row

            rows.append(probe_row({"shape": [B, T, H, d], "form": name, "scan_warps": warps}, measure))
            save()
    for (B, T), (q, k, v, g, beta) in inputs.items() if gpu else ():

        def measure_fla(q=q, k=k, v=v, g=g, beta=beta):
            import torch
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule

            ensure_triton_cache_dir()
            tq, tk, tv = (torch.tensor(np.asarray(x.astype(f32)), device="cuda").bfloat16() for x in (q, k, v))
            tg = torch.tensor(np.asarray(g), device="cuda")
            tb = torch.tensor(np.asarray(beta), device="cuda").bfloat16()

            def call():
                with torch.no_grad():
                    return chunk_gated_delta_rule(tq, tk, tv, g=tg, beta=tb, output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True)

            return {"ms": time_torch(call, iters=20), "us": fla_kernel_us(call)}

        rows.append(probe_row({"shape": [B, T, H, d], "form": "fla"}, measure_fla))
        save()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
