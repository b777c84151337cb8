"""Probe: GDN decode layers at the 0.8B widths with the mixer kernel prefetching the next products' weights
into L2 (`pallas_kernels/common.with_l2_prefetch`), against the same layers without.

    python bench/probes/l2_prefetch.py OUT.json [BATCH ...]   # on the H200 (PYTHONPATH=.); CPU: a run check only

A chain of LAYERS GDN decoder layers as the engine's decode step runs them (folded norms as DeferredNorm,
the fused in_proj product, the one-kernel mixer, out_proj, the MLP), each layer with its own weights and
pools, so every product reads its weights cold from DRAM. Forms: `none`; `o+gu` the mixer's extra programs
read out_proj and the MLP's gate/up weights (19 MB a layer); `o+gu+d` also the down weights (26 MB);
`o+gu+d+in` also the next layer's in_proj (43 MB). `rows` extra rows of the mixer's grid (x16 programs)
do the prefetch. Wall time of back-to-back chained calls (pools donated and threaded through, so the
in-place kernels copy nothing), per layer, and the kernels of one profiled call.
"""

import functools
import json
import sys
import time

import jax
import jax.numpy as jnp

from jaxgdn.bench.common import environment, profile_summary
from jaxgdn.mlp import linear, linear_parts, mlp
from jaxgdn.norms import DeferredNorm, inverse_rms
from jaxgdn.params import MLPParams
from pallas_kernels.common import on_gpu
from pallas_kernels.gdn_mixer import gdn_mixer_pooled

H, Hk, dk, Kc, I = 1024, 16, 128, 4, 3584  # the 0.8B config's GDN layer widths
C = 3 * Hk * dk
N = C + Hk * dk + 2 * Hk  # in_proj: q, k, v, z, b, a
bf = jnp.bfloat16
EPS = 1e-6
FORMS = {"none": (), "o+gu": ("out", "gate_up"), "o+gu+d": ("out", "gate_up", "down"),
         "o+gu+d+in": ("out", "gate_up", "down", "next_in")}


def make_layers(key, layers):
    ks = jax.random.split(key, 6)
    w = lambda k, shape, s: (s * jax.random.normal(k, (layers, *shape), jnp.float32)).astype(bf)  # noqa: E731
    return {"in": w(ks[0], (N, H), H**-0.5), "out": w(ks[1], (H, Hk * dk), (Hk * dk) ** -0.5),
            "gate_up": w(ks[2], (2 * I, H), H**-0.5), "down": w(ks[3], (H, I), I**-0.5),
            "conv_w": (0.3 * jax.random.normal(ks[4], (C, 1, Kc))).astype(bf)}


def chain(form, rows_extra, layers, x, W, convs, ssms, rows):
    """x [B, 1, H] through `layers` GDN decoder layers; returns (x, convs, ssms)."""
    A_log, dt_bias, norm_w = jnp.zeros(Hk), jnp.zeros(Hk, bf), jnp.ones(dk)
    new_convs, new_ssms = [], []
    for i in range(layers):
        n = DeferredNorm(x, inverse_rms(x, EPS))
        y, scale = linear_parts(n, W["in"][i])
        named = {"out": W["out"][i], "gate_up": W["gate_up"][i], "down": W["down"][i],
                 "next_in": W["in"][i + 1] if i + 1 < layers else None}
        prefetch = tuple(named[k] for k in FORMS[form] if named[k] is not None)
        o, conv, ssm = gdn_mixer_pooled(y, scale, W["conv_w"], A_log, dt_bias, norm_w, EPS, convs[i], ssms[i],
                                        *rows, dtype=bf, prefetch=prefetch, prefetch_programs=Hk * rows_extra)
        new_convs.append(conv)
        new_ssms.append(ssm)
        x = x + linear(o, W["out"][i])
        n2 = DeferredNorm(x, inverse_rms(x, EPS))
        x = x + mlp(MLPParams(None, None, W["down"][i], fused=W["gate_up"][i]), n2)
    return x, new_convs, new_ssms


def main(out_path, batches=(1, 8)):
    gpu = on_gpu()
    layers = 18 if gpu else 2
    result = {"benchmark": "l2-prefetch-probe", "rows": [], "env": environment(),
              "timing": "wall us per GDN decoder layer of chained layers (median of 5 runs of 20 calls), "
                        "and device busy us per layer of one profiled run"}
    key = jax.random.PRNGKey(0)
    W = make_layers(key, layers)
    settings = [("none", 0), ("o+gu", 4), ("o+gu", 7), ("o+gu+d", 7), ("o+gu+d+in", 7)]
    for B in batches if gpu else (1,):
        S = B + 1
        ks = jax.random.split(jax.random.PRNGKey(B), 3)
        x0 = jax.random.normal(ks[0], (B, 1, H), jnp.float32).astype(bf)
        rows = (jnp.arange(1, B + 1), jnp.zeros(B, jnp.int32), jnp.zeros(B, bool), jnp.zeros(B, bool),
                jnp.ones(B, jnp.int32))
        for form, extra in settings if gpu else [("none", 0), ("o+gu", 2)]:
            convs = [(0.5 * jax.random.normal(jax.random.fold_in(ks[1], i), (S, Kc - 1, C))).astype(bf)
                     for i in range(layers)]
            ssms = [0.1 * jax.random.normal(jax.random.fold_in(ks[2], i), (S, 1, Hk, dk, dk), jnp.float32)
                    for i in range(layers)]
            fn = jax.jit(functools.partial(chain, form, extra, layers), donate_argnums=(2, 3))
            x, convs, ssms = fn(x0, W, convs, ssms, rows)
            jax.block_until_ready(x)
            runs = []
            for _ in range(5 if gpu else 1):
                t0 = time.perf_counter()
                for _ in range(20):
                    x, convs, ssms = fn(x0, W, convs, ssms, rows)
                jax.block_until_ready((x, convs, ssms))
                runs.append((time.perf_counter() - t0) / (20 * layers) * 1e6)
            row = {"batch": B, "form": form, "prefetch_rows": extra, "layers_chained": layers,
                   "wall_us_per_layer": sorted(runs)[len(runs) // 2], "runs": runs,
                   "x_digest": float(jnp.sum(jnp.abs(x.astype(jnp.float32))))}
            if gpu:
                import tempfile
                trace = tempfile.mkdtemp()
                with jax.profiler.trace(trace, create_perfetto_trace=True):
                    for _ in range(3):
                        x, convs, ssms = fn(x0, W, convs, ssms, rows)
                    jax.block_until_ready(x)
                prof = profile_summary(trace, divide_by=3 * layers)
                row["busy_us_per_layer"] = prof.get("busy_us")
                row["top_kernels"] = prof.get("top", [])[:8]
            result["rows"].append(row)
            print(f"B {B:3d} {form:10s} rows {extra} wall {row['wall_us_per_layer']:7.2f} us/layer "
                  f"busy {row.get('busy_us_per_layer') or 0:7.2f}", flush=True)
            if out_path:
                with open(out_path, "w") as f:
                    json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None, tuple(int(b) for b in sys.argv[2:]) or (1, 8))
