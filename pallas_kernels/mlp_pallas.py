"""Pallas kernels of the SwiGLU MLP at prefill sizes (Triton lowering on GPU, interpret mode on CPU).

In XLA's hands a long prompt's MLP is three kernels: cuBLAS's gate/up product writes [T, 2I], a pass
reads it back for SiLU(gate) * up and writes [T, I], and the down product reads that. The two forms here
each drop that middle pass:

- `swiglu_gate_up`: one GEMM with two accumulators, the gate and up tiles of the same output columns,
  SiLU(gate) * up formed in registers before the only store ([T, I]).
- `swiglu_down`: the down product reading gate and up ([T, 2I], XLA's product) and forming its operand
  SiLU(gate) * up tile by tile.

Shapes: x [M, K]; w_gate_up [2I, K] (Hugging Face [out, in] layout, gate rows first); w_down [N, I].
Operands in the input dtype, fp32 accumulation; M, I, K and N multiples of the tiles.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .common import interpret_default, triton_params

f32 = jnp.float32


def _dot_t(a, b):
    """a [m, k] @ b[n, k]ᵀ -> [m, n] fp32."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=f32)


def _silu_mul(gate, up):
    return gate * jax.nn.sigmoid(gate) * up


def _gate_up_kernel(x_ref, wg_ref, wu_ref, o_ref, *, bk: int, k_steps: int):
    bm, bn = o_ref.shape

    def body(s, acc):
        cols = pl.ds(pl.multiple_of(s * bk, bk), bk)
        x = x_ref[:, cols]
        return acc[0] + _dot_t(x, wg_ref[:, cols]), acc[1] + _dot_t(x, wu_ref[:, cols])

    zeros = jnp.zeros((bm, bn), f32)
    gate, up = lax.fori_loop(0, k_steps, body, (zeros, zeros))
    o_ref[...] = _silu_mul(gate, up).astype(o_ref.dtype)


def swiglu_gate_up(x, w_gate_up, bm: int = 128, bn: int = 128, bk: int = 64, num_warps: int = 8,
                   num_stages: int = 3, interpret=None):
    """SiLU(x @ w_gateᵀ) * (x @ w_upᵀ): x [M, K], w_gate_up [2I, K] -> [M, I] in x's dtype."""
    M, K = x.shape
    inter = w_gate_up.shape[0] // 2
    bm, bn, bk = min(bm, M), min(bn, inter), min(bk, K)
    kernel = functools.partial(_gate_up_kernel, bk=bk, k_steps=K // bk)
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((M, inter), x.dtype), grid=(M // bm, inter // bn),
        in_specs=[pl.BlockSpec((bm, K), lambda i, j: (i, 0)), pl.BlockSpec((bn, K), lambda i, j: (j, 0)),
                  pl.BlockSpec((bn, K), lambda i, j: (j + inter // bn, 0))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        interpret=interpret_default(interpret), compiler_params=triton_params(num_warps, num_stages),
    )(x, w_gate_up, w_gate_up)


def _down_kernel(g_ref, u_ref, w_ref, o_ref, *, bk: int, k_steps: int):
    bm, bn = o_ref.shape

    def body(s, acc):
        cols = pl.ds(pl.multiple_of(s * bk, bk), bk)
        act = _silu_mul(g_ref[:, cols].astype(f32), u_ref[:, cols].astype(f32)).astype(w_ref.dtype)
        return acc + _dot_t(act, w_ref[:, cols])

    o_ref[...] = lax.fori_loop(0, k_steps, body, jnp.zeros((bm, bn), f32)).astype(o_ref.dtype)


def swiglu_down(gate_up, w_down, bm: int = 128, bn: int = 128, bk: int = 64, num_warps: int = 8,
                num_stages: int = 3, interpret=None):
    """(SiLU(gate) * up) @ w_downᵀ: gate_up [M, 2I] (gate columns first), w_down [N, I] -> [M, N]."""
    M, two_i = gate_up.shape
    inter, N = two_i // 2, w_down.shape[0]
    bm, bn, bk = min(bm, M), min(bn, N), min(bk, inter)
    kernel = functools.partial(_down_kernel, bk=bk, k_steps=inter // bk)
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((M, N), gate_up.dtype), grid=(M // bm, N // bn),
        in_specs=[pl.BlockSpec((bm, inter), lambda i, j: (i, 0)), pl.BlockSpec((bm, inter), lambda i, j: (i, 1)),
                  pl.BlockSpec((bn, inter), lambda i, j: (j, 0))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        interpret=interpret_default(interpret), compiler_params=triton_params(num_warps, num_stages),
    )(gate_up, gate_up, w_down)


def _matmul_kernel(x_ref, w_ref, o_ref, *, bk: int, k_steps: int):
    bm, bn = o_ref.shape

    def body(s, acc):
        cols = pl.ds(pl.multiple_of(s * bk, bk), bk)
        return acc + _dot_t(x_ref[:, cols], w_ref[:, cols])

    o_ref[...] = lax.fori_loop(0, k_steps, body, jnp.zeros((bm, bn), f32)).astype(o_ref.dtype)


def matmul_t(x, w, bm: int = 128, bn: int = 128, bk: int = 64, num_warps: int = 8, num_stages: int = 3,
             interpret=None):
    """x @ wᵀ: x [M, K], w [N, K] -> [M, N]: the plain GEMM of these tiles, the yardstick of the two above."""
    M, K = x.shape
    N = w.shape[0]
    bm, bn, bk = min(bm, M), min(bn, N), min(bk, K)
    kernel = functools.partial(_matmul_kernel, bk=bk, k_steps=K // bk)
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((M, N), x.dtype), grid=(M // bm, N // bn),
        in_specs=[pl.BlockSpec((bm, K), lambda i, j: (i, 0)), pl.BlockSpec((bn, K), lambda i, j: (j, 0))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        interpret=interpret_default(interpret), compiler_params=triton_params(num_warps, num_stages),
    )(x, w)
