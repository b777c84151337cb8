"""Probe: the GDN layer's mixer at decode (T=1) on the 0.8B layer's widths, one kernel against the unfused chain.

    python bench/probes/gdn_mixer.py OUT.json [BATCH ...]   # on the H200 (PYTHONPATH=.); CPU: a run check only

Forms: `mixer-w<N>` the one-kernel mixer (`pallas_kernels/gdn_mixer.py`) with N warps; `unfused` the chain the
engine ran before it (the post-scale of the product, the gates, `causal_conv_pooled`, `gdn_recurrent_pooled`,
the gated norm). Inputs as a batch-1 decode step hands them: the fp32 in_proj product and its 1/rms, one
row per slot. Each call runs the mixer over LAYERS distinct pools in a chain, as a step's layers do, so the
states are cold (not in the 50 MB L2); device us per layer from a profiler trace, with the top kernels.
"""

import functools
import json
import sys

import jax
import jax.numpy as jnp

from jaxgdn.bench.common import environment, profile_calls
from jaxgdn.gdn import gdn_gates
from jaxgdn.mlp import split_outputs
from jaxgdn.norms import gated_rms_norm
from pallas_kernels.common import on_gpu
from pallas_kernels.conv_pallas import causal_conv_pooled
from pallas_kernels.gdn_mixer import gdn_mixer_pooled
from pallas_kernels.gdn_pallas import gdn_recurrent_pooled

Hk, dk, Kc = 16, 128, 4
C = 3 * Hk * dk
bf = jnp.bfloat16


def unfused(y, row_scale, w, A_log, dt_bias, norm_w, eps, conv, ssm, slots, start, fresh, verify, num_valid):
    """The engine's chain before the mixer kernel (paged_forward.gdn_rows with fused_decode=False)."""
    B, T, _ = y.shape
    source = (y * row_scale).astype(bf)
    _, z, b, a = split_outputs(source, (C, Hk * dk, Hk, Hk))
    g, beta = gdn_gates(type("P", (), {"A_log": A_log, "dt_bias": dt_bias}), a, b)
    valid = (jnp.arange(T)[None, :] < num_valid[:, None])[..., None]
    g, beta = jnp.where(valid, g, 0.0), jnp.where(valid, beta, 0.0)
    u, conv = causal_conv_pooled(source, C, w, conv, slots, start, fresh, verify, num_valid)
    o, ssm = gdn_recurrent_pooled(u, g, beta, ssm, slots, start, fresh, verify)
    out = gated_rms_norm(o.astype(bf), z.reshape(B, T, Hk, dk), norm_w, eps, bf)
    return out.reshape(B, T, -1), conv, ssm


def chained(form, layers, ys, scale, w, A_log, dt_bias, norm_w, convs, ssms, rows):
    """The form over `layers` (product, pools) pairs, one after another on the stream, as a step's layers."""
    outs = []
    for i in range(layers):
        if form == "unfused":
            outs.append(unfused(ys[i], scale, w, A_log, dt_bias, norm_w, 1e-6, convs[i], ssms[i], *rows))
        else:
            outs.append(gdn_mixer_pooled(ys[i], scale, w, A_log, dt_bias, norm_w, 1e-6, convs[i], ssms[i], *rows,
                                         dtype=bf, num_warps=int(form.split("-w")[1])))
    return outs


def main(out_path, batches=(1, 64)):
    gpu = on_gpu()
    forms = ("unfused", "mixer-w4", "mixer-w8", "mixer-w16") if gpu else ("unfused", "mixer-w4")
    result = {"benchmark": "gdn-mixer-probe", "rows": [], "env": environment(),
              "timing": "device us per layer (one row per slot, T = 1) from a profiler trace of chained layers"}
    key = jax.random.PRNGKey(0)
    for B in batches if gpu else (2,):
        layers = max(2, min(32, 256 // B)) if gpu else 2
        ks = jax.random.split(key, 6)
        N = C + Hk * dk + 2 * Hk
        ys = jax.random.normal(ks[0], (layers, B, 1, N), jnp.float32)
        scale = jnp.full((B, 1, 1), 0.5, jnp.float32)
        w = (0.3 * jax.random.normal(ks[1], (C, 1, Kc))).astype(bf)
        A_log, dt_bias = jax.random.normal(ks[2], (Hk,)), jax.random.normal(ks[3], (Hk,)).astype(bf)
        norm_w = jnp.ones(dk)
        S = B + 1
        convs = (0.5 * jax.random.normal(ks[4], (layers, S, Kc - 1, C))).astype(bf)
        ssms = 0.1 * jax.random.normal(ks[5], (layers, S, 1, Hk, dk, dk), jnp.float32)
        rows = (jnp.arange(1, B + 1), jnp.zeros(B, jnp.int32), jnp.zeros(B, bool), jnp.zeros(B, bool),
                jnp.ones(B, jnp.int32))
        for form in forms:
            fn = jax.jit(functools.partial(chained, form, layers))
            args = (ys, scale, w, A_log, dt_bias, norm_w, convs, ssms, rows)
            if not gpu:
                jax.block_until_ready(fn(*args))
                print(f"{form}: ran")
                continue
            prof = profile_calls(fn, *args, divide_by=10 * layers)
            row = {"batch": B, "form": form, "layers_chained": layers, "us_per_layer": prof["busy_us"],
                   "top_kernels": prof.get("top", [])[:6]}
            result["rows"].append(row)
            print(f"B {B:3d} {form:10s} {prof['busy_us']:7.2f} us/layer", flush=True)
            if out_path:
                with open(out_path, "w") as f:
                    json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None, tuple(int(b) for b in sys.argv[2:]) or (1, 64))
