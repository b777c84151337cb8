"""Probe: the residual chain of a 0.8B prefill layer at one long prompt (8192 tokens, hidden 1024, bf16), the
norms folded (`params.fold_norms`). In the engine's 1x8192 step (bench/results/prefill-dump-r30_gpu_20261203.json
and its HLO) every layer spends three bandwidth-bound kernels on it, ~37 us: the post-attention norm
recomputing x + h (48 MB), the residual x + h + m (64 MB), the next layer's input norm (32 MB); neither add
runs in a GEMM's epilogue. Forms, each a chain of LAYERS such layers (a GELU between two products stands
for the mixer's kernels):

  engine       residual_block as the engine runs it
  barrier      each residual sum behind an optimization barrier: computed once, so XLA's GEMM rewriter may
               fold the add into the cuBLASLt product before it (beta = 1) instead of consumers recomputing it
  post_scale   the MLP's gate/up product reads the un-normed x; 1/rms scales gate and up in the SiLU kernel
  barrier_post both

    python bench/probes/residual_chain.py OUT.json   # on the H200 (PYTHONPATH=.); CPU: correctness only

Rows: form, device busy µs per chain, kernels, GEMMs with a fused matrix bias (beta = 1 in the compiled
HLO), max |x - x_engine|. One more row times a plain Pallas copy kernel, to see whether XLA sets memory
before every Pallas (Triton) call (the engine's prefill profiles show about one 'Memset' per Pallas call;
r33: this kernel ran without one).
"""

import json
import re
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxgdn.bench.common import environment, probe_row, profile_calls
from jaxgdn.model.mlp import linear, split_outputs
from jaxgdn.model.norms import pre_norm, upcast
from pallas_kernels.common import on_gpu

EPS = 1e-6
LAYERS = 4


def layer(x, w, *, barrier: bool, post_scale: bool):
    """One pre-norm layer on x [T, H] with folded norms; w = (w_in, w_out, w_gate_up, w_down)."""
    w_in, w_out, w_gate_up, w_down = w
    pin = jax.lax.optimization_barrier if barrier else (lambda a: a)
    x = pin(x + linear(jax.nn.gelu(linear(pre_norm(x, None, EPS), w_in)), w_out))
    normed = pre_norm(x, None, EPS)
    width = w_down.shape[1]
    if post_scale:
        gate, up = split_outputs(jnp.einsum("ti,oi->to", x, w_gate_up), (width, width))
        r = normed.inv_rms
        act = (jax.nn.silu(upcast(gate) * r) * (upcast(up) * r)).astype(x.dtype)
    else:
        gate, up = split_outputs(linear(normed, w_gate_up), (width, width))
        act = jax.nn.silu(gate) * up
    return pin(x + linear(act, w_down))


FORMS = {"engine": (False, False), "barrier": (True, False), "post_scale": (False, True), "barrier_post": (True, True)}


def chain(x, weights, barrier, post_scale):
    for w in weights:
        x = layer(x, w, barrier=barrier, post_scale=post_scale)
    return x


def _copy_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2 + 1


def pallas_copy(x):
    """y = 2x + 1 over [T, H] in [64, H] blocks: the simplest Pallas call, for the memset question."""
    T, H = x.shape
    spec = pl.BlockSpec((64, H), lambda i: (i, 0))
    return pl.pallas_call(_copy_kernel, grid=(T // 64,), in_specs=[spec], out_specs=spec,
                          out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=not on_gpu())(x)


def main(out_path=None):
    gpu = on_gpu()
    T, H, mid, inter = (8192, 1024, 2048, 3584) if gpu else (64, 32, 48, 40)
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 1 + 4 * LAYERS))
    x = jax.random.normal(next(keys), (T, H), jnp.bfloat16)

    def weight(shape):
        return (jax.random.normal(next(keys), shape, jnp.float32) * shape[1] ** -0.5).astype(jnp.bfloat16)

    weights = [(weight((mid, H)), weight((H, mid)), weight((2 * inter, H)), weight((H, inter))) for _ in range(LAYERS)]
    fns = {name: jax.jit(lambda x, w, b=b, s=s: chain(x, w, b, s)) for name, (b, s) in FORMS.items()}
    ref = fns["engine"](x, weights).astype(jnp.float32)
    rows = []
    for name, f in fns.items():
        def measure(f=f):
            text = f.lower(x, weights).compile().as_text()
            row = {"error": float(jnp.abs(f(x, weights).astype(jnp.float32) - ref).max()),
                   "bias_fused_gemms": len(re.findall(r'"beta":1', text)),
                   "fusions": len(re.findall(r"= \S+ fusion\(", text))}
            if gpu:
                prof = profile_calls(f, x, weights)
                row["busy_us"] = round(prof["busy_us"], 1)
                row["span_us"] = round(prof["span_us"], 1)
                row["kernels"] = [[n, round(us, 1), c] for n, us, c in prof["top"][:14]]
            return row

        rows.append(probe_row({"form": name, "layers": LAYERS, "shape": [T, H, mid, inter]}, measure))

    def measure_copy():
        f = jax.jit(pallas_copy)
        row = {"error": float(jnp.abs(f(x) - (x * 2 + 1)).max())}
        if gpu:
            prof = profile_calls(f, x)
            row["kernels"] = [[n, round(us, 1), c] for n, us, c in prof["top"][:6]]
            row["custom_call"] = [ln.strip()[:600] for ln in f.lower(x).compile().as_text().splitlines()
                                  if "custom-call(" in ln][:2]
        return row

    rows.append(probe_row({"form": "pallas_copy", "shape": [T, H]}, measure_copy))
    if out_path:
        with open(out_path, "w") as f:
            json.dump({"benchmark": "residual-chain-probe", "rows": rows, "env": environment()}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
