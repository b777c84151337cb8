"""Probe: the 0.8B MLP at one long prompt (8192 tokens, hidden 1024, intermediate 3584, bf16) with the
SiLU(gate) * up pass fused into a Pallas GEMM (`pallas_kernels/mlp_pallas.py`) against XLA's three kernels
(cuBLAS gate/up 146 us, the multiply 44, Triton down 78 at r20: `mlp-forms-probe_gpu_20261202.json`).

    python bench/probes/mlp_pallas.py OUT.json    # on the H200 (PYTHONPATH=.); CPU: correctness only

Rows: form, tiles (bm, bn, bk, warps, stages), device us per call (busy), its kernels, max |y - y_xla|
over max |y_xla|. "gemm" rows time the plain Pallas GEMM of the gate/up shape (the yardstick: how near
cuBLAS the Triton lowering gets before any fusion).
"""

import json
import sys

import jax
import jax.numpy as jnp

from jaxgdn.bench.common import environment, probe_row, profile_calls
from pallas_kernels.common import on_gpu
from pallas_kernels.mlp_pallas import matmul_t, swiglu_down, swiglu_gate_up


def xla_mlp(x, w_gate_up, w_down):
    gate, up = jnp.split(jnp.einsum("ti,oi->to", x, w_gate_up), 2, axis=-1)
    return jnp.einsum("ti,oi->to", jax.nn.silu(gate) * up, w_down)


def fused_gate_up(cfg):
    def f(x, w_gate_up, w_down):
        return jnp.einsum("ti,oi->to", swiglu_gate_up(x, w_gate_up, *cfg), w_down)
    return f


def fused_down(cfg):
    def f(x, w_gate_up, w_down):
        return swiglu_down(jnp.einsum("ti,oi->to", x, w_gate_up), w_down, *cfg)
    return f


def gemm(cfg):
    def f(x, w_gate_up, w_down):
        return matmul_t(x, w_gate_up, *cfg)
    return f


GATE_UP = ((128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (128, 128, 32, 8, 4),
           (128, 64, 64, 8, 3))
DOWN = ((128, 128, 64, 8, 3), (128, 128, 64, 4, 3), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (128, 256, 64, 8, 3),
        (128, 128, 32, 8, 4))
GEMM = ((128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (256, 128, 64, 8, 3))


def main(out_path=None):
    gpu = on_gpu()
    T, H, inter = (8192, 1024, 3584) if gpu else (128, 64, 128)
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(k[0], (T, H), jnp.bfloat16)
    w_gate_up = (jax.random.normal(k[1], (2 * inter, H), jnp.float32) * H**-0.5).astype(jnp.bfloat16)
    w_down = (jax.random.normal(k[2], (H, inter), jnp.float32) * inter**-0.5).astype(jnp.bfloat16)
    ref = jax.jit(xla_mlp)(x, w_gate_up, w_down).astype(jnp.float32)
    ref_gemm = jnp.einsum("ti,oi->to", x, w_gate_up, preferred_element_type=jnp.float32)
    forms = [("xla", None, xla_mlp, ref)]
    forms += [("gate_up", c, fused_gate_up(c), ref) for c in GATE_UP]
    forms += [("down", c, fused_down(c), ref) for c in DOWN]
    forms += [("gemm", c, gemm(c), ref_gemm) for c in GEMM]
    if not gpu:  # interpret mode: one config of each is the correctness check
        forms = [f for f in forms if f[1] in (None, GATE_UP[0], DOWN[0], GEMM[0])]
    rows = []
    for name, cfg, form, want in forms:
        f = jax.jit(form)

        def measure(f=f, want=want):
            got = f(x, w_gate_up, w_down).astype(jnp.float32)
            row = {"rel_error": float(jnp.abs(got - want).max() / jnp.abs(want).max())}
            if gpu:
                prof = profile_calls(f, x, w_gate_up, w_down)
                row["busy_us"] = round(prof["busy_us"], 1)
                row["kernels"] = [[n, round(us, 1)] for n, us, _ in prof["top"][:4]]
            return row

        rows.append(probe_row({"form": name, "tiles": cfg, "shape": [T, H, inter]}, measure))
    if out_path:
        with open(out_path, "w") as f:
            json.dump({"benchmark": "mlp-pallas-probe", "rows": rows, "env": environment()}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
