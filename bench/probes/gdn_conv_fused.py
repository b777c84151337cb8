"""Probe: the GDN layer's conv + chunked kernels at the 0.8B widths (16 + 16 heads of 128, bf16, q‖k‖v read
out of the fused projection's 8224-wide product, the gated norm in the output kernel), two forms:

  conv_kernel  `conv_pallas.causal_conv_prompt` writes q, k, v, then `gdn_chunked_pallas` reads them
               (the engine's form up to r28);
  in_kernel    `gdn_chunked_pallas(conv=conv_input(...))`: the prep kernel convolves k and v (and stores k
               for the scan and output kernels), the output kernel q; chunk 0 from an XLA head.

    python bench/probes/gdn_conv_fused.py OUT.json     # on the H200 (PYTHONPATH=.:tests); CPU: small shapes

Rows: form, shape (B x T), prep warps, device µs per call (busy), its kernels, max |o - o_conv_kernel|.
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxgdn.bench.common import environment, probe_row, profile_calls
from pallas_kernels.common import on_gpu
from pallas_kernels.conv_pallas import causal_conv_prompt
from pallas_kernels.gdn_pallas import OutputGate, conv_input, gdn_chunked_pallas

H, D, WIDTH, KC = 16, 128, 8224, 4


def conv_kernel(x, weight, window, g, beta, s0, norm_w, warps):
    q, k, v = causal_conv_prompt(x, (H * D,) * 3, weight, window)
    B, T = x.shape[:2]
    q, k, v = (a.reshape(B, T, H, D) for a in (q, k, v))
    return gdn_chunked_pallas(q, k, v, g, beta, s0, warps=warps, gate=OutputGate(x, norm_w, 1e-6, 3 * H * D))


def in_kernel(x, weight, window, g, beta, s0, norm_w, warps):
    conv = conv_input(x, weight, window, H, D, D)
    return gdn_chunked_pallas(None, None, None, g, beta, s0, warps=warps, conv=conv,
                              gate=OutputGate(x, norm_w, 1e-6, 3 * H * D))


def main(out_path=None):
    gpu = on_gpu()
    shapes = [(1, 8192), (1, 2048), (8, 1024)] if gpu else [(1, 130)]
    rows = []
    for B, T in shapes:
        r = np.random.default_rng(T)
        x = jnp.asarray(r.standard_normal((B, T, WIDTH)), jnp.bfloat16)
        weight = jnp.asarray(r.standard_normal((3 * H * D, 1, KC)) * 0.5, jnp.bfloat16)
        window = jnp.asarray(r.standard_normal((B, KC - 1, 3 * H * D)), jnp.bfloat16)
        g = -jnp.asarray(r.uniform(0, 0.5, (B, T, H)), jnp.float32)
        beta = jnp.asarray(r.uniform(0, 1, (B, T, H)), jnp.float32)
        s0 = jnp.zeros((B, H, D, D), jnp.float32)
        norm_w = jnp.ones(D, jnp.float32)
        args = (x, weight, window, g, beta, s0, norm_w)
        ref = None
        for name, form, warps in (("conv_kernel", conv_kernel, (2, 4, 4)), ("in_kernel", in_kernel, (2, 4, 4)),
                                  ("in_kernel", in_kernel, (4, 4, 4)), ("in_kernel", in_kernel, (2, 4, 8))):
            f = jax.jit(lambda *a, form=form, warps=warps: form(*a, warps))

            def measure(f=f):
                nonlocal ref
                o, s = f(*args)
                o = o.astype(jnp.float32)
                ref = o if ref is None else ref
                row = {"max_err": float(jnp.abs(o - ref).max()), "max_abs": float(jnp.abs(ref).max())}
                if gpu:
                    prof = profile_calls(f, *args)
                    row["busy_us"] = round(prof["busy_us"], 1)
                    row["kernels"] = [[n, round(us, 1)] for n, us, _ in prof["top"][:8]]
                return row

            rows.append(probe_row({"form": name, "shape": [B, T], "warps": list(warps)}, measure, quiet=("kernels",)))
    if out_path:
        with open(out_path, "w") as f:
            json.dump({"benchmark": "gdn-conv-fused-probe", "rows": rows, "env": environment()}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
