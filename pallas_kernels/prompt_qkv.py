"""The attention layer's q/k/v from its fused projection for many tokens at once (prefill), as one Pallas kernel.

Between the fused q/k/v product and the attention, XLA runs six kernels a layer at a long prompt: a copy of the
query columns out of the product, the q RMSNorm, RoPE on q, the same two for k, and a copy of v, ~2.5 passes
over q's bytes. This kernel reads each head's columns of the product
once and writes the normed, rotated q and k and the v the attention reads: one program per (row, tile of
BT tokens, head), the heads being the Hq query heads, then the Hkv key heads, then the Hkv value heads.

    y        [R, Q, N]  the fused projection in the activation dtype: q_proj (per head [query_h ‖ gate_h],
                        2*Hq*D), k_proj (Hkv*D), v_proj (Hkv*D)
    q_norm, k_norm [D]  the zero-centred RMSNorm weights (scale 1 + w)
    cos, sin [R, Q, rot] RoPE tables (`jaxgdn.rope.rope_cos_sin`, the activation dtype)
    -> q [R, Q, Hq, D], k [R, Q, Hkv, D], v [R, Q, Hkv, D] in y's dtype

Semantics are those of `jaxgdn.attention.project_qkv_gate` after its product (tests/test_prompt_qkv.py),
rounding where it rounds: the normed head to the activation dtype, then each RoPE product and their sum.
A head's columns are loaded as power-of-two pieces (Triton tiles): the two rotated halves, then the rest.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .common import interpret_default, triton_params
from .decode_attention import _round  # x rounded to the activation dtype, back in fp32

f32 = jnp.float32


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def prompt_qkv_supports(head_dim: int, rotary_dim: int) -> bool:
    """RoPE must rotate halves that are power-of-two tiles inside the head."""
    return 0 < rotary_dim <= head_dim and rotary_dim % 2 == 0 and _pow2(rotary_dim // 2)


def _pieces(D: int, rot: int) -> tuple[tuple[int, int], ...]:
    """(start, width) column pieces of a head, each a power of two: the two rotated halves, then the rest
    largest first (256 dims, 64 rotated: (0, 32), (32, 32), (64, 128), (192, 64))."""
    half = rot // 2
    pieces, start = [(0, half), (half, half)], rot
    while start < D:
        width = 1 << ((D - start).bit_length() - 1)
        pieces.append((start, width))
        start += width
    return tuple(pieces)


def _kernel(y_ref, qn_ref, kn_ref, cos_ref, sin_ref, q_ref, k_ref, v_ref, *, Hq, Hkv, D, rot, eps, BT, T):
    from jax.experimental.pallas import triton as plt  # masked loads and stores (also in interpret mode)

    r, it, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    t0 = it * BT
    row_ok = ((t0 + lax.iota(jnp.int32, BT)) < T)[:, None]
    dtype = q_ref.dtype
    pieces = _pieces(D, rot)
    half = rot // 2

    def load(ref, c0, width):  # [BT, width] of ref [R, T, C] at columns c0.., fp32
        mask = jnp.broadcast_to(row_ok, (BT, width))
        return plt.load(ref.at[r, pl.ds(t0, BT), pl.ds(c0, width)], mask=mask, other=0).astype(f32)

    def store(ref, head, xs):
        for (start, width), x in zip(pieces, xs):
            plt.store(ref.at[r, pl.ds(t0, BT), head, pl.ds(start, width)], x.astype(ref.dtype),
                      mask=jnp.broadcast_to(row_ok, (BT, width)))

    def normed_rotated(lo, w_ref):
        xs = [load(y_ref, lo + start, width) for start, width in pieces]
        inv = lax.rsqrt(sum(jnp.sum(x * x, axis=-1, keepdims=True) for x in xs) / D + eps)
        xs = [_round(x * inv * (1.0 + w_ref[pl.ds(start, width)].astype(f32))[None, :], dtype)
              for (start, width), x in zip(pieces, xs)]
        a, b = xs[0], xs[1]  # rotate-half: column j < half pairs with j + half
        cos_a, cos_b, sin_a, sin_b = (load(t, c, half) for t in (cos_ref, sin_ref) for c in (0, half))
        xs[0] = _round(_round(a * cos_a, dtype) - _round(b * sin_a, dtype), dtype)
        xs[1] = _round(_round(b * cos_b, dtype) + _round(a * sin_b, dtype), dtype)
        return xs

    @pl.when(h < Hq)
    def _query():
        store(q_ref, h, normed_rotated(h * 2 * D, qn_ref))

    @pl.when((h >= Hq) & (h < Hq + Hkv))
    def _key():
        store(k_ref, h - Hq, normed_rotated(2 * Hq * D + (h - Hq) * D, kn_ref))

    @pl.when(h >= Hq + Hkv)
    def _value():
        lo = 2 * Hq * D + Hkv * D + (h - Hq - Hkv) * D
        store(v_ref, h - Hq - Hkv, [load(y_ref, lo + start, width) for start, width in pieces])


def prompt_qkv(y, q_norm, k_norm, eps: float, cos, sin, num_heads: int, num_kv_heads: int, head_dim: int,
               block_t: int = 32, num_warps: int = 4, interpret=None):
    """q, k, v of the attention layer from its fused projection y (see the module docstring)."""
    R, Q, _ = y.shape
    Hq, Hkv, D, rot = num_heads, num_kv_heads, head_dim, cos.shape[-1]
    assert prompt_qkv_supports(D, rot), (D, rot)
    BT = min(block_t, pl.next_power_of_2(Q))
    kernel = functools.partial(_kernel, Hq=Hq, Hkv=Hkv, D=D, rot=rot, eps=float(eps), BT=BT, T=Q)
    sds = jax.ShapeDtypeStruct
    return pl.pallas_call(
        kernel, out_shape=(sds((R, Q, Hq, D), y.dtype), sds((R, Q, Hkv, D), y.dtype), sds((R, Q, Hkv, D), y.dtype)),
        grid=(R, pl.cdiv(Q, BT), Hq + 2 * Hkv), interpret=interpret_default(interpret),
        compiler_params=triton_params(num_warps),
    )(y, q_norm, k_norm, cos, sin)
