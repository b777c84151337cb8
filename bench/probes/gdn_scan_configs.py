"""Probe: the chunked GDN's chunk-state scan (`_scan_kernel`, the one sequential kernel) under several
launch settings, beside fla 0.6.0's kernels in the same process (and fla's autotuned choice for its h
kernel). o is bf16 on both sides. r20 also timed the state split in 64-row halves as fla's h kernel holds
it (forms "split2", "bv32-w4-split2", "bv32-w2-split2-s4": gdn_chunked_pallas(scan_k_split=2) in commit
adb2871, removed since: slower at every shape, bench/results/gdn-scan-configs-probe_gpu_20261202.json).

    python bench/probes/gdn_scan_configs.py OUT.json    # on the H200 (PYTHONPATH=.); CPU: correctness only

Rows: (shape, form) with each of our kernels' device µs per call and their sum, max |o - o_default|;
then one fla row per shape, its kernels by name (torch's profiler, after every JAX profile). The JSON is
rewritten after every row, so a call cut by its time limit keeps what it measured.
"""

import functools
import json
import sys

import jax
import jax.numpy as jnp

from jaxgdn.bench.common import (ensure_triton_cache_dir, environment, probe_row, profile_calls, random_gdn_inputs,
                                 torch_kernel_us)
from pallas_kernels.common import on_gpu
from pallas_kernels.gdn_pallas import gdn_chunked_pallas

OURS = ("_prep_kernel", "_scan_kernel", "_output_kernel")
# (scan dv tile or None for the default, scan warps, scan pipeline stages or None for the default)
FORMS = {
    "default": (None, 4, None),
    "bv32-w4": (32, 4, 3),
    "bv32-w2": (32, 2, 3),
    "bv16-w2": (16, 2, 3),
}


def main(out_path=None):
    gpu = on_gpu()
    shapes, H, d = (((1, 8192), (1, 4096), (8, 2048)), 16, 128) if gpu else (((1, 128),), 2, 64)
    rows, inputs = [], {}

    def save():
        if out_path:
            with open(out_path, "w") as f:
                json.dump({"benchmark": "gdn-scan-configs-probe", "forms": FORMS, "rows": rows, "env": environment()},
                          f, indent=1)

    for B, T in shapes:
        inputs[B, T] = x = random_gdn_inputs(B, T, H, d)
        ref = None
        for form, (bv, warps, stages) in FORMS.items():
            f = jax.jit(functools.partial(gdn_chunked_pallas, out_dtype=jnp.bfloat16, block_v=bv, warps=(2, warps, 4),
                                          scan_stages=stages))

            def measure(f=f):
                nonlocal ref
                o, _ = f(*x)
                ref = o if ref is None else ref
                row = {"error": float(jnp.abs(o.astype(jnp.float32) - ref.astype(jnp.float32)).max())}
                if gpu:
                    top = profile_calls(f, *x)["top"]
                    row["us"] = {name: round(us, 1) for name, us, _ in top if name in OURS}
                    row["sum_us"] = round(sum(row["us"].values()), 1)
                return row

            rows.append(probe_row({"shape": [B, T, H, d], "form": form}, measure))
            save()
    if gpu:
        try:
            import torch
            from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_kernel_h_blockdim64 as fla_h
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        except ImportError as e:
            print(f"fla unavailable: {e}")
        else:
            ensure_triton_cache_dir()
            for (B, T), x in inputs.items():
                q, k, v, g, beta = (torch.from_dlpack(a) for a in x)
                beta = beta.to(torch.bfloat16)

                def measure(q=q, k=k, v=v, g=g, beta=beta):
                    def call():
                        return chunk_gated_delta_rule(q, k, v, g=g, beta=beta, output_final_state=True,
                                                      use_qk_l2norm_in_kernel=True)

                    with torch.no_grad():
                        us = torch_kernel_us(call)
                    best = getattr(fla_h, "best_config", None)
                    return {"us": {name: round(t, 1) for name, t in us.items()}, "sum_us": round(sum(us.values()), 1),
                            "h_kernel_config": str(best)}

                rows.append(probe_row({"shape": [B, T, H, d], "form": "fla"}, measure))
                save()
    save()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
