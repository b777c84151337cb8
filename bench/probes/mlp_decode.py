"""Probe: a decoder layer's MLP half at decode sizes, the one-kernel form (`pallas_kernels/mlp_decode.py`)
against the XLA chain it replaces, with cold weights (0.8B widths, COPIES layers' distinct weights chained).

    python bench/probes/mlp_decode.py OUT.json [M ...]   # on the H200 (PYTHONPATH=.); CPU: correctness only

Each timed call runs COPIES layers x -> (x + h) + MLP(norm(x + h)), each on its own weights (COPIES x 22 MB
>> the 50 MB L2), and reports the device busy time of all its kernels per layer. The XLA chain is the
engine's code (`model.residual_block`'s second half on a `norms.DeferredNorm`); in the kernel chain the
final add (x + h) + acc is a kernel of its own here, where in the engine it joins the next layer's norm.
Columns: `xla_us`, `kernel_<form>_<combine>_b<BI>w<warps><t|hf>` (us a layer, max |error| against the XLA
chain's output at the last layer in units of its max |value|); form, combine: `mlp_decode.mlp_decode`'s; t:
down_proj transposed to [I, H], hf: read in its [H, I] layout. r41's first run (`mlp-decode-probe-r41`) timed
the reduce form with atomic adds only.
"""

import json
import sys

import jax
import jax.numpy as jnp

from jaxgdn.bench.common import environment, profile_calls
from jaxgdn.mlp import mlp
from jaxgdn.norms import POST_SCALE_MAX_TOKENS, pre_norm
from jaxgdn.params import MLPParams
from pallas_kernels.mlp_decode import mlp_decode

f32 = jnp.float32
EPS = 1e-6
COPIES = 16
# (BI, warps, down transposed, form, combine): see `mlp_decode.mlp_decode`
CONFIGS = ((32, 8, True, "reduce", "atomic"), (32, 8, True, "reduce", "partials"), (16, 8, True, "reduce", "partials"),
           (16, 4, True, "dot", "atomic"), (16, 8, True, "dot", "atomic"), (32, 4, True, "dot", "atomic"),
           (32, 8, True, "dot", "atomic"), (64, 4, True, "dot", "atomic"), (16, 4, False, "dot", "atomic"),
           (32, 4, False, "dot", "atomic"), (32, 4, True, "dot", "partials"))


def xla_layer(x, h, w_gate_up, w_down):
    x1 = x + h
    p = MLPParams(gate_proj=None, up_proj=None, down_proj=w_down, fused=w_gate_up)
    return x1 + mlp(p, pre_norm(x1, None, EPS))


def kernel_layer(block, warps, transposed, form, combine, interpret):
    def layer(x, h, w_gate_up, w_down):
        acc = mlp_decode(x, h, w_gate_up, w_down, EPS,  # w_down [I, H] when transposed
                         post_scale=x.shape[0] <= POST_SCALE_MAX_TOKENS, down_transposed=transposed,
                         block=block, num_warps=warps, form=form, combine=combine, interpret=interpret)
        return (x + h) + acc.astype(x.dtype)
    return layer


def chain(layer, x, hs, weights):
    for h, (w_gate_up, w_down) in zip(hs, weights):
        x = layer(x, h, w_gate_up, w_down)
    return x


def main(out_path=None, ms=(1, 2, 4, 8)):
    interpret = jax.default_backend() != "gpu"
    H, I, copies = (64, 96, 2) if interpret else (1024, 3584, COPIES)
    key = jax.random.PRNGKey(0)
    bf16 = jnp.bfloat16
    weights = [((0.03 * jax.random.normal(jax.random.fold_in(key, 2 * i), (2 * I, H))).astype(bf16),
                (0.03 * jax.random.normal(jax.random.fold_in(key, 2 * i + 1), (H, I))).astype(bf16))
               for i in range(copies)]
    # The kernel's transposed form reads down_proj as [I, H]: those copies are made once, outside the timing.
    weights_t = [(g, d.T.copy()) for g, d in weights]
    rows = []
    for M in (1, 3) if interpret else ms:
        x = jax.random.normal(jax.random.fold_in(key, 1000 + M), (M, H), bf16)
        hs = [jax.random.normal(jax.random.fold_in(key, 2000 + i), (M, H), bf16) for i in range(copies)]
        ref = jax.jit(lambda x, hs, ws: chain(xla_layer, x, hs, ws))(x, hs, weights).astype(f32)
        row = {"M": M, "H": H, "I": I}
        if not interpret:
            s = profile_calls(jax.jit(lambda x, hs, ws: chain(xla_layer, x, hs, ws)), x, hs, weights, iters=10,
                              divide_by=10 * copies)
            row["xla_us"], row["xla_top"] = round(s["busy_us"], 3), s["top"][:6]
        for block, warps, transposed, form, combine in CONFIGS:
            name = f"kernel_{form}_{combine}_b{block}w{warps}{'t' if transposed else 'hf'}"
            ws = weights_t if transposed else weights
            layer = kernel_layer(block, warps, transposed, form, combine, interpret)
            fn = jax.jit(lambda x, hs, ws, layer=layer: chain(layer, x, hs, ws))
            try:
                err = float(jnp.abs(fn(x, hs, ws).astype(f32) - ref).max() / jnp.abs(ref).max())
                us, top = None, None
                if not interpret:
                    s = profile_calls(fn, x, hs, ws, iters=10, divide_by=10 * copies)
                    us, top = round(s["busy_us"], 3), s["top"][:4]
                row[name] = (us, round(err, 4))
                row[name + "_top"] = top
            except Exception as e:  # noqa: BLE001 - a config that does not lower is a result too
                row[name] = repr(e)[:160]
        rows.append(row)
        timed = {k: v[0] for k, v in row.items() if k.startswith("kernel") and isinstance(v, tuple) and v[0]}
        print(f"M{M}: xla {row.get('xla_us')} us; " + ", ".join(f"{k} {v}" for k, v in sorted(timed.items(),
              key=lambda kv: kv[1])), flush=True)
        if interpret:
            print({k: v for k, v in row.items() if k.startswith("kernel") and not k.endswith("_top")})
    if out_path:
        with open(out_path, "w") as f:
            json.dump({"benchmark": "mlp-decode-probe", "copies": copies, "rows": rows, "env": environment()}, f,
                      indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None, tuple(int(m) for m in sys.argv[2:]) or (1, 2, 4, 8))
