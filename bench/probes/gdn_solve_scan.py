"""Probe: the chunked GDN's prep solve and chunk-state scan in the forms fla's kernels use, against ours and
fla's kernels one by one, at the 0.8B's prefill shapes (16 heads, dk = dv = 128, bf16 inputs).

    python bench/probes/gdn_solve_scan.py OUT.json [ROUND]   # on the H200 (PYTHONPATH=.:tests, fla carried);
                                                           # CPU: errors only. ROUND 1 or 2 (default)

Forms (each a setting of `gdn_chunked_pallas` and its kernels):
- `prep-T`: the diagonal blocks' forward substitution on A_iiᵀ (`_unit_lower_inverse_t`): each row of A is
  read by a reduction whose result needs no layout change before the next (fla reads it from memory).
- `split`: the scan's state as two [64, BV] halves, W and Kd loaded per half, as fla's h kernel holds it.
- `stagesN`: the scan without the hand-written prefetch, Triton's loop pipelining N stages deep (fla's
  autotuner picks 2-4); `prefetch`: the hand-written prefetch forced on, `noprefetch` forced off; `bvN` the
  scan's dv tile; `wN` warps.
- round 2, `prep-rolled`: the diagonal blocks' substitution as a loop, not unrolled; `prep-tf32`: the block
  combination's [16, 16] products on TF32 tensor cores (fla's choice) instead of exact fp32 FMA.
Each row: µs per call of each kernel (JAX's profiler) and max |o - o_ref| against the XLA chunked form in
fp32. fla's rows (after all of ours: CUPTI takes one subscriber) give each of its kernels from torch's
profiler, on the same inputs.
"""

import functools
import json
import sys

import jax
import jax.numpy as jnp

import pallas_kernels.gdn_pallas as gp
from jaxgdn.bench.common import (environment, ensure_triton_cache_dir, gdn_probe_shapes, probe_row, profile_calls,
                                 random_gdn_inputs, torch_kernel_us)
from pallas_kernels.gdn import gdn_chunked

f32 = jnp.float32
_PREP, _SCAN = gp._prep_kernel, gp._scan_kernel

# Round 1 (bench/results/gdn-solve-scan-probe-r1_gpu_20261202.json) and round 2, chosen from round 1's numbers.
# name -> (prep kernel options, scan kernel options, gdn_chunked_pallas options)
ROUND1 = {
    "base": ({}, {}, {}),
    "prep-T": ({"transposed_solve": True}, {}, {}),
    "split": ({}, {"split_k": True}, {}),
    "split-noprefetch": ({}, {"split_k": True, "prefetch": False}, {}),
    "prefetch": ({}, {"prefetch": True}, {}),
    "noprefetch-stages1": ({}, {"prefetch": False}, {"scan_stages": 1}),
    "noprefetch-stages3": ({}, {"prefetch": False}, {"scan_stages": 3}),
    "noprefetch-stages4": ({}, {"prefetch": False}, {"scan_stages": 4}),
    "split-noprefetch-stages3": ({}, {"split_k": True, "prefetch": False}, {"scan_stages": 3}),
    "prefetch-bv32-w2": ({}, {"prefetch": True}, {"block_v": 32, "warps": (2, 2, 4)}),
    "split-prefetch-bv32": ({}, {"split_k": True, "prefetch": True}, {"block_v": 32}),
    "scan-w2": ({}, {}, {"warps": (2, 2, 4)}),
    "prep-T-w4": ({"transposed_solve": True}, {}, {"warps": (4, 4, 4)}),
    "prep-T+split": ({"transposed_solve": True}, {"split_k": True}, {}),
}
ROUND2 = {
    "base": ({}, {}, {}),
    "prep-rolled": ({"rolled_solve": True}, {}, {}),
    "prep-tf32": ({"tf32_merge": True}, {}, {}),
    "prep-rolled-tf32": ({"rolled_solve": True, "tf32_merge": True}, {}, {}),
    "prep-rolled-tf32-w1": ({"rolled_solve": True, "tf32_merge": True}, {}, {"warps": (1, 4, 4)}),
    "prep-rolled-tf32-w4": ({"rolled_solve": True, "tf32_merge": True}, {}, {"warps": (4, 4, 4)}),
    "noprefetch-stages3": ({}, {"prefetch": False}, {"scan_stages": 3}),
    "prefetch-stages3": ({}, {"prefetch": True}, {"scan_stages": 3}),
    "noprefetch-bv32-stages3": ({}, {"prefetch": False}, {"scan_stages": 3, "block_v": 32}),
    "noprefetch-bv32-stages4": ({}, {"prefetch": False}, {"scan_stages": 4, "block_v": 32}),
    "noprefetch-bv64-stages3": ({}, {"prefetch": False}, {"scan_stages": 3, "block_v": 64}),
    "noprefetch-bv16-stages3": ({}, {"prefetch": False}, {"scan_stages": 3, "block_v": 16}),
}
ROUNDS = {"1": ROUND1, "2": ROUND2}


def run_form(prep_opts, scan_opts, call_opts, *args):
    """gdn_chunked_pallas with its prep and scan kernels given `prep_opts` / `scan_opts` (module globals it
    looks up when traced), called with `call_opts`: (outputs, {kernel: µs per call})."""

    def prep(*refs, **kw):
        _PREP(*refs, **{**kw, **prep_opts})

    def scan(*refs, **kw):
        _SCAN(*refs, **{**kw, **scan_opts})

    gp._prep_kernel, gp._scan_kernel = prep, scan
    try:
        f = jax.jit(functools.partial(gp.gdn_chunked_pallas, **call_opts))
        out = f(*args)
        summary = profile_calls(f, *args) if jax.default_backend() == "gpu" else {"top": []}
    finally:
        gp._prep_kernel, gp._scan_kernel = _PREP, _SCAN
    return out, {name: round(us, 1) for name, us, _ in summary["top"]}


def fla_kernels(q, k, v, g, beta) -> dict:
    """fla's chunk_gated_delta_rule on the same inputs (bf16 beta): µs per call of each of its kernels."""
    import numpy as np
    import torch
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    ensure_triton_cache_dir()
    t = lambda x, dt: torch.tensor(np.asarray(x.astype(f32)), device="cuda", dtype=dt)  # noqa: E731
    tq, tk, tv, tb = (t(x, torch.bfloat16) for x in (q, k, v, beta))
    tg = t(g, torch.float32)

    def call():
        return chunk_gated_delta_rule(tq, tk, tv, g=tg, beta=tb, output_final_state=True, use_qk_l2norm_in_kernel=True)

    with torch.no_grad():
        return {name: round(us, 1) for name, us in torch_kernel_us(call).items()}


def main(out_path=None, round_name="2"):
    forms = ROUNDS[round_name]
    gpu, shapes, H, d = gdn_probe_shapes()
    rows, inputs = [], []
    for B, T in shapes:
        q, k, v, g, beta = random_gdn_inputs(B, T, H, d, seed=B * T)
        inputs.append((B, T, (q, k, v, g, beta)))
        ref, _ = jax.jit(gdn_chunked)(*(x.astype(f32) for x in (q, k, v)), g, beta)
        for name, (prep_opts, scan_opts, call_opts) in forms.items():

            def measure(p=prep_opts, s=scan_opts, c=call_opts):
                (o, _), us = run_form(p, s, c, q, k, v, g, beta)
                return {"us": us, "gdn_us": round(sum(us.values()), 1), "error": float(jnp.abs(o - ref).max())}

            rows.append(probe_row({"shape": [B, T, H, d], "form": name}, measure))
    if gpu:
        for B, T, args in inputs:
            rows.append(probe_row({"shape": [B, T, H, d], "form": "fla"}, lambda a=args: {"us": fla_kernels(*a)}))
    if out_path:
        with open(out_path, "w") as f:
            json.dump({"benchmark": "gdn-solve-scan-probe", "round": round_name, "rows": rows, "env": environment()}, f,
                      indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:3]) if len(sys.argv) > 1 else main()
