"""Probe: the chunked GDN's prep kernel fused (one kernel, W and U from [16, 16] x [16, d] block products)
against split in two as fla does (`_solve_kernel` writes (I+A)⁻¹ as [64, 64] tiles, `_wu_kernel` forms W
and U as whole-chunk [64, 64] x [64, d] products), both without the Kd store of r18 (the scan now scales V'
by n e^{γ_last-γ} and reads the raw keys), at the 0.8B's prefill shapes (16 heads, dk = dv = 128, bf16).

    python bench/probes/gdn_split_prep.py OUT.json [ROUND]   # on the H200 (PYTHONPATH=.:tests, fla carried);
                                                             # CPU: errors only. ROUND 1 or 2 (default)

Forms: `r18` the kernels as of commit da8d20b (bench/probes/_gdn_pallas_r18.py, a copy); `fused` the fused
prep without Kd; `split` the split prep, its inverse stored in bf16 (fla's choice) or `-t32` fp32; `-sN`,
`-wuN` warps of the solve / W-U kernels. Round 2: `-kscale` the scan scales the keys (off its critical path)
instead of V'; `-fold` the output kernel folds the q and k norms into its products as row / column scales
instead of normalizing [64, d] fp32 copies; `-w1` the fused prep on 1 warp. Each row: µs per call of each kernel (JAX's profiler) and max
|o - o_ref| against the XLA chunked form in fp32; fla's rows (after ours: CUPTI takes one subscriber) give
each of its kernels from torch's profiler on the same inputs.
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

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import _gdn_pallas_r18 as r18  # noqa: E402

f32 = jnp.float32
# Round 1 (bench/results/gdn-split-prep-probe-r1_gpu_20261202.json) and round 2, chosen from round 1's numbers.
ROUND1 = {
    "r18": (r18.gdn_chunked_pallas, {}),
    "fused": (gp.gdn_chunked_pallas, {}),
    "split": (gp.gdn_chunked_pallas, {"split_prep": True}),
    "split-t32": (gp.gdn_chunked_pallas, {"split_prep": True, "inverse_dtype": f32}),
    "split-s1": (gp.gdn_chunked_pallas, {"split_prep": True, "split_warps": (1, 4)}),
    "split-s4": (gp.gdn_chunked_pallas, {"split_prep": True, "split_warps": (4, 4)}),
    "split-wu2": (gp.gdn_chunked_pallas, {"split_prep": True, "split_warps": (2, 2)}),
    "split-wu8": (gp.gdn_chunked_pallas, {"split_prep": True, "split_warps": (2, 8)}),
}
ROUND2 = {
    "r18": (r18.gdn_chunked_pallas, {}),
    "fused": (gp.gdn_chunked_pallas, {}),
    "fused-kscale": (gp.gdn_chunked_pallas, {"scale_keys": True}),
    "fused-fold": (gp.gdn_chunked_pallas, {"fold_norms": True}),
    "fused-kscale-fold": (gp.gdn_chunked_pallas, {"scale_keys": True, "fold_norms": True}),
    "fused-w1": (gp.gdn_chunked_pallas, {"warps": (1, 4, 4)}),
    "split-s1": (gp.gdn_chunked_pallas, {"split_prep": True, "split_warps": (1, 4)}),
    "split-s1-fold": (gp.gdn_chunked_pallas, {"split_prep": True, "split_warps": (1, 4), "fold_norms": True}),
}
ROUNDS = {"1": ROUND1, "2": ROUND2}


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
    gpu, shapes, H, d = gdn_probe_shapes()
    rows, inputs = [], []
    for B, T in shapes:
        args = random_gdn_inputs(B, T, H, d, seed=B * T)
        inputs.append((B, T, args))
        ref, _ = jax.jit(gdn_chunked)(*(x.astype(f32) for x in args[:3]), *args[3:])
        for name, (fn, opts) in ROUNDS[round_name].items():

            def measure(fn=fn, opts=opts):
                f = jax.jit(functools.partial(fn, **opts))
                o, _ = f(*args)
                us = profile_calls(f, *args)["top"] if gpu else []
                us = {n: round(t, 1) for n, t, _ in us}
                return {"us": us, "gdn_us": round(sum(us.values()), 1), "error": float(jnp.abs(o - ref).max())}

            rows.append(probe_row({"shape": [B, T, H, d], "form": name}, measure))
    if gpu:
        for B, T, args in inputs:
            rows.append(probe_row({"shape": [B, T, H, d], "form": "fla"}, lambda a=args: {"us": fla_kernels(*a)}))
    if out_path:
        with open(out_path, "w") as f:
            json.dump({"benchmark": "gdn-split-prep-probe", "round": round_name, "rows": rows, "env": environment()}, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:3])
