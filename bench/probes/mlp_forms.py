"""Probe: the 0.8B MLP at one long prompt (8192 tokens, hidden 1024, intermediate 3584, bf16) in XLA's
hands. In the engine's prefill the gate/up product is one cuBLAS GEMM of the fused weight, then SiLU(gate)
* up is a kernel of its own (1.07 of the 26.2 ms 1x8192 step, prefill-r19) before the down product. Does
XLA fuse that product into the down GEMM when gate and up come from two products instead of slices of
one, and what does the MLP cost each way?

    python bench/probes/mlp_forms.py OUT.json    # on the H200 (PYTHONPATH=.); CPU: correctness only

Rows: form, device µs per call (busy), its kernels, max |y - y_fused|.
"""

import json
import sys

import jax
import jax.numpy as jnp

from jaxgdn.bench.common import environment, probe_row, profile_calls
from pallas_kernels.common import on_gpu


def fused(x, w_gate_up, w_down):
    """The engine's form: one product with [gate; up] stacked on the output axis, split after."""
    gate, up = jnp.split(jnp.einsum("ti,oi->to", x, w_gate_up), 2, axis=-1)
    return jnp.einsum("ti,oi->to", jax.nn.silu(gate) * up, w_down)


def separate(x, w_gate_up, w_down):
    """Two products (the weight's halves), so SiLU(gate) * up reads two whole outputs."""
    w_gate, w_up = jnp.split(w_gate_up, 2, axis=0)
    gate, up = jnp.einsum("ti,oi->to", x, w_gate), jnp.einsum("ti,oi->to", x, w_up)
    return jnp.einsum("ti,oi->to", jax.nn.silu(gate) * up, w_down)


def separate_f32(x, w_gate_up, w_down):
    """As separate, with SiLU and the product in fp32 (one rounding into the down product's operand)."""
    w_gate, w_up = jnp.split(w_gate_up, 2, axis=0)
    gate, up = (jnp.einsum("ti,oi->to", x, w, preferred_element_type=jnp.float32) for w in (w_gate, w_up))
    return jnp.einsum("ti,oi->to", (jax.nn.silu(gate) * up).astype(x.dtype), w_down)


FORMS = {"fused": fused, "separate": separate, "separate_f32": separate_f32}


def main(out_path=None):
    gpu = on_gpu()
    T, H, inter = (8192, 1024, 3584) if gpu else (64, 32, 48)
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(k[0], (T, H), jnp.bfloat16)
    w_gate_up = (jax.random.normal(k[1], (2 * inter, H), jnp.float32) * H**-0.5).astype(jnp.bfloat16)
    w_down = (jax.random.normal(k[2], (H, inter), jnp.float32) * inter**-0.5).astype(jnp.bfloat16)
    ref = jax.jit(fused)(x, w_gate_up, w_down).astype(jnp.float32)
    rows = []
    for name, form in FORMS.items():
        f = jax.jit(form)

        def measure(f=f):
            row = {"error": float(jnp.abs(f(x, w_gate_up, w_down).astype(jnp.float32) - ref).max())}
            if gpu:
                prof = profile_calls(f, x, w_gate_up, w_down)
                row["busy_us"] = round(prof["busy_us"], 1)
                row["kernels"] = [[n, round(us, 1)] for n, us, _ in prof["top"][:8]]
            return row

        rows.append(probe_row({"form": name, "shape": [T, H, inter]}, measure))
    if out_path:
        with open(out_path, "w") as f:
            json.dump({"benchmark": "mlp-forms-probe", "rows": rows, "env": environment()}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
