"""Probe: the GDN layer's gated RMS norm fused into the chunked kernel's output kernel (`gdn_chunked_pallas(...,
gate=(z, weight, eps))`) against the kernel's fp32 output normed by XLA afterwards (`norms.gated_rms_norm`,
the engine's path), at the 0.8B's prefill shapes (16 heads, dk = dv = 128, bf16).

    python bench/probes/gdn_output_norm.py OUT.json      # on the H200 (PYTHONPATH=.:tests); CPU: correctness only

The fused form saves the fp32 output's write and read (64 MB each at 8192 tokens) and a kernel; it forces
whole-head output tiles. Rows: shape, form, device µs per call (all kernels), the output kernel's and the
norm's µs, max |y - y_xla|.
"""

import json
import sys

import jax
import jax.numpy as jnp

from jaxgdn.bench.common import environment, gdn_probe_shapes, probe_row, profile_calls, random_gdn_inputs
from jaxgdn.model.norms import gated_rms_norm
from pallas_kernels.gdn_pallas import gdn_chunked_pallas

EPS = 1e-6


def xla_norm(q, k, v, g, beta, z, weight):
    o, _ = gdn_chunked_pallas(q, k, v, g, beta)
    return gated_rms_norm(o.astype(z.dtype), z, weight, EPS, z.dtype)


def fused_norm(q, k, v, g, beta, z, weight):
    return gdn_chunked_pallas(q, k, v, g, beta, gate=(z, weight, EPS))[0]


def main(out_path=None):
    on_gpu, shapes, H, d = gdn_probe_shapes()
    rows = []
    for B, T in shapes:
        args = random_gdn_inputs(B, T, H, d, seed=T)
        z = jax.random.normal(jax.random.PRNGKey(1), (B, T, H, d), jnp.bfloat16)
        weight = 1 + 0.1 * jax.random.normal(jax.random.PRNGKey(2), (d,), jnp.float32)
        ref = jax.jit(xla_norm)(*args, z, weight).astype(jnp.float32)
        for name, f in (("xla_norm", xla_norm), ("fused", fused_norm)):

            def measure(f=jax.jit(f)):
                row = {"error": float(jnp.abs(f(*args, z, weight).astype(jnp.float32) - ref).max())}
                if on_gpu:
                    summary = profile_calls(f, *args, z, weight)
                    row["busy_us"] = round(summary["busy_us"], 1)
                    row["top"] = [(n, round(us, 1)) for n, us, _ in summary["top"][:6]]
                return row

            rows.append(probe_row({"shape": [B, T, H, d], "form": name}, measure))
    if out_path:
        with open(out_path, "w") as f:
            json.dump({"benchmark": "gdn-output-norm-probe", "rows": rows, "env": environment()}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
