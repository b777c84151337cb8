"""The GDN layer's causal conv and gated delta rule over a ragged token stream: XLA references.

A step's tokens are one flat stream; token t belongs to row token_row[t] (-1: padding), and row r owns
tokens query_start_loc[r] .. query_start_loc[r+1]-1, in order. Every row starts from its own conv window
and recurrent state (its slot's, or zeros) and its tokens never mix with another row's.

    ragged_causal_conv:   x [T, >=C], weight [C, 1, Kc], windows [R, Kc-1, C]
                          -> silu(conv) [T, C], windows after the row [R, Kc-1, C],
                             the inputs 1 .. Kc-2+W of [window ‖ row] [R, Kc-2+W, C] (a verify row's windows
                             after each of its first W tokens: the one after token i is [i : i+Kc-1])
    gdn_ragged_reference: q, k [T, Hk, dk], v [T, Hv, dv], g, beta [T, Hv] fp32, initial [R, Hv, dk, dv] fp32
                          -> o [T, Hv, dv] fp32, final [R, Hv, dk, dv], states after each of the row's first W
                             tokens [R, W, Hv, dk, dv] (the final state past the row's end)

The recurrence math is `pallas_kernels/gdn.py`'s (L2-normed q and k, q scaled by dk^-1/2, value head j reads
key head j // (Hv // Hk)). Padding tokens must carry g = beta = 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

f32 = jnp.float32


def _row_offsets(token_row, query_start_loc):
    """(valid [T], row [T] clipped, offset of each token in its row [T])."""
    R = query_start_loc.shape[0] - 1
    T = token_row.shape[0]
    valid = token_row >= 0
    row = jnp.clip(token_row, 0, R - 1)
    offset = jnp.arange(T, dtype=jnp.int32) - query_start_loc[row]
    return valid, row, offset


def ragged_causal_conv(x, weight, windows, token_row, query_start_loc, num_windows: int):
    """Depthwise causal conv + SiLU of each row over [window ‖ its tokens]; see the module docstring.
    num_windows = W: the verify buffer holds the inputs 1 .. Kc-2+W. Outputs in x's dtype (sums in fp32)."""
    C, _, Kc = weight.shape
    T = x.shape[0]
    x = x[:, :C]
    windows = windows.astype(x.dtype)
    w = weight[:, 0, :].astype(jnp.promote_types(x.dtype, f32))  # [C, Kc]
    valid, row, offset = _row_offsets(token_row, query_start_loc)
    padded = jnp.pad(x, [(Kc - 1, 0), (0, 0)])
    acc = 0.0
    for j in range(Kc):
        s = offset - (Kc - 1) + j  # the tap's input, as an offset in the row (negative: in the window)
        from_window = windows[row, jnp.clip(Kc - 1 + s, 0, Kc - 2)]
        tap = jnp.where((s >= 0)[:, None], padded[j : j + T], from_window)
        acc = acc + tap.astype(w.dtype) * w[:, j]
    out = jnp.where(valid[:, None], jax.nn.silu(acc), 0).astype(x.dtype)

    n = query_start_loc[1:] - query_start_loc[:-1]  # [R]

    def full_at(m):  # [R, E] indices into each row's [window ‖ tokens] -> [R, E, C]
        from_window = jnp.take_along_axis(windows, jnp.clip(m, 0, Kc - 2)[..., None], axis=1)
        from_tokens = x[jnp.clip(query_start_loc[:-1, None] + m - (Kc - 1), 0, T - 1)]
        return jnp.where((m < Kc - 1)[..., None], from_window, from_tokens)

    after = full_at(n[:, None] + jnp.arange(Kc - 1))
    buffers = full_at(1 + jnp.arange(Kc - 2 + num_windows)[None, :] + jnp.zeros_like(n)[:, None])
    return out, after, buffers


def _prepare(q, k, v, g, beta):
    """Heads to Hv, fp32 (or wider), L2-normed q and k, q scaled: [T, Hv, d] each, g and beta [T, Hv]."""
    Hk, dk = q.shape[1], q.shape[2]
    Hv = v.shape[1]
    if Hv != Hk:
        q = jnp.repeat(q, Hv // Hk, axis=1)
        k = jnp.repeat(k, Hv // Hk, axis=1)
    wide = jnp.promote_types(v.dtype, f32)
    q, k, v, g, beta = (a.astype(wide) for a in (q, k, v, g, beta))
    q = q * lax.rsqrt(jnp.sum(q * q, -1, keepdims=True) + 1e-6) * (dk**-0.5)
    k = k * lax.rsqrt(jnp.sum(k * k, -1, keepdims=True) + 1e-6)
    return q, k, v, g, beta


def gdn_ragged_reference(q, k, v, g, beta, token_row, query_start_loc, initial_state, num_checkpoints: int = 1):
    """The recurrence token by token (lax.scan over the stream), each token updating its row's state; see
    the module docstring. num_checkpoints = W."""
    R = initial_state.shape[0]
    W = num_checkpoints
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    valid, row, offset = _row_offsets(token_row, query_start_loc)
    states = initial_state.astype(q.dtype)
    checkpoints = jnp.zeros((R, W, *states.shape[1:]), states.dtype)

    def step(carry, xs):
        states, checkpoints = carry
        q_t, k_t, v_t, g_t, b_t, ok, r, i = xs  # [Hv, d] / [Hv]
        S = states[r] * jnp.exp(g_t)[:, None, None]
        pred = jnp.einsum("hkv,hk->hv", S, k_t)
        S = S + k_t[:, :, None] * (b_t[:, None] * (v_t - pred))[:, None, :]
        o_t = jnp.einsum("hkv,hk->hv", S, q_t)
        states = states.at[r].set(jnp.where(ok, S, states[r]))
        c = jnp.minimum(i, W - 1)
        checkpoints = checkpoints.at[r, c].set(jnp.where(ok & (i < W), S, checkpoints[r, c]))
        return (states, checkpoints), jnp.where(ok, o_t, 0)

    (states, checkpoints), o = lax.scan(step, (states, checkpoints), (q, k, v, g, beta, valid, row, offset))
    n = query_start_loc[1:] - query_start_loc[:-1]
    past_end = (jnp.arange(W)[None, :] >= n[:, None])[..., None, None, None]
    checkpoints = jnp.where(past_end, states[:, None], checkpoints)
    return o, states, checkpoints
