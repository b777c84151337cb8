"""The gated attention layer of decode and spec-verify rows as one Pallas kernel, between its two products.

Between the fused q/k/v projection and o_proj, a decode step's attention layer ran ~15 XLA kernels at batch 1
on the H200 (the q/k RMSNorms, RoPE, the KV write, the gather of each row's pages, scores, softmax, P·V, the
sigmoid gate; ~16 us a layer, bench/results/decode-kernels-fold-probe_gpu_20261202.json). This kernel does it
all: one program per (row, query head) normalizes and rotates its query and its KV head's keys for the
row's few new tokens, writes the new K/V into the paged pools in place, attends over the row's pages (keys
written by earlier steps) and over the new keys held in registers, and stores the gated output in o_proj's
input layout. Reading this step's keys from registers rather than from the pages the kernel writes means
no program depends on another's stores.

    y           [R, Q, N]  the fused projection: q_proj (per head [query_h ‖ gate_h], 2*Hq*D), k_proj (Hkv*D),
                           v_proj (Hkv*D); in the activation dtype, or fp32 with row_scale
    row_scale   [R, Q, 1]  fp32 or None: the folded norm's 1/rms (`norms.DeferredNorm.product_parts`)
    q_norm, k_norm [D]     the zero-centred RMSNorm weights (scale 1 + w)
    cos, sin    [R, Q, rot] RoPE tables (`rope.rope_cos_sin`, in the activation dtype)
    k_pool, v_pool [P, ps, Hkv, D]; kv_slots [R*Q] flat pool slot of each cell (page * ps + offset)
    block_tables [R, MP]; q_positions [R, Q] (-1: padding cell, sees no key and is no key)
    old_lens, seq_lens [R]: keys at positions < old_len are read from the pages; the step's own keys (its
                           valid cells, positions old_len .. seq_len - 1) from y
    -> (out [R, Q, Hq*D] in the activation dtype, k_pool, v_pool)

Semantics are `jaxgdn.attention.project_qkv_gate` + `paged_forward.write_kv` + the gather path's
`gqa_attention` + the sigmoid gate (tests/test_decode_attention.py compares them), rounding where those round
(the normed and rotated q/k, the scores before and after scaling, the output before the gate); the softmax
runs online in fp32 over unnormalized probabilities (the gather path casts normalized ones to the activation
dtype before P·V). Padding cells write their K/V to their slots (the null page) as write_kv does; their
outputs are zeros.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .common import call_on_product, product_rows

f32 = jnp.float32
# Pages per tile of the page loop (one gathered load per pool; the next tile's loads in flight while one
# computes): two while the grid has at most DEEP_TILE_MAX_PROGRAMS programs (about one an SM: each program's own
# loads in flight are what hides the latency), else one. On the H200 at the 0.8B widths, 96 keys a row in
# the pages, kernel us a layer: batch 1 6.35 on two pages against 6.92 on one, batch 8 6.78 against 7.46,
# batch 64 18.46 against 15.10; 4 warps (2: 9.1 at batch 1; 8: 7.4)
# (bench/results/decode-attention-probe-2_gpu_20261202.json).
PAGES_PER_STEP = None  # None: by the rule above
DEEP_TILE_MAX_PROGRAMS = 128
NUM_WARPS = 4


def decode_attention_supports(head_dim: int, page_size: int, rotary_dim: int) -> bool:
    """A head and a page must be Triton tiles (powers of two; a head >= 16) and RoPE must rotate pairs."""
    pow2 = lambda x: x == pl.next_power_of_2(x)  # noqa: E731
    return head_dim >= 16 and pow2(head_dim) and pow2(page_size) and 0 < rotary_dim <= head_dim and rotary_dim % 2 == 0


def _round(x, dtype):
    """x rounded to dtype and back to fp32: where the XLA path stores or computes in the activation dtype."""
    return x.astype(dtype).astype(f32)


def _attention_kernel(y_ref, *refs, Q, Hq, Hkv, D, rot, eps, scaled, PB):
    r, h = pl.program_id(0), pl.program_id(1)
    read_product, refs = product_rows(y_ref, refs, scaled, r)
    (qn_ref, kn_ref, cos_ref, sin_ref, slot_ref, bt_ref, qpos_ref, old_ref, seq_ref, _k_in, _v_in,
     out_ref, k_pool_ref, v_pool_ref) = refs
    from jax.experimental.pallas import triton as plt  # masked stores (also in interpret mode)

    group = Hq // Hkv
    hk = h // group
    dtype, pool_dtype = out_ref.dtype, k_pool_ref.dtype
    ps, MP = k_pool_ref.shape[1], bt_ref.shape[1]
    scale = D**-0.5
    d = lax.iota(jnp.int32, D)
    half = rot // 2
    partner = jnp.where(d < half, d + half, jnp.where(d < rot, d - half, d))  # rotate-half's other element
    in_rot = d < rot
    rot_col = jnp.where(in_rot, d, 0)

    def product(t: int, cols):
        """Product row t at columns cols [D] in the activation dtype (the XLA path's product), as fp32."""
        return read_product(t, cols).astype(f32)

    def normed_rotated(t: int, lo, w_ref):
        """rms_norm_1p then RoPE of the head at columns lo .. lo + D of product row t -> [D] fp32."""
        x, xp = product(t, lo + d), product(t, lo + partner)
        inv = lax.rsqrt(jnp.sum(x * x) / D + eps)
        x = _round(x * inv * (1.0 + w_ref[...].astype(f32)), dtype)
        xp = _round(xp * inv * (1.0 + w_ref[partner].astype(f32)), dtype)
        cos = jnp.where(in_rot, cos_ref[r, jnp.int32(t), rot_col].astype(f32), 1.0)
        sin = sin_ref[r, jnp.int32(t), rot_col].astype(f32)
        sin = jnp.where(d < half, -sin, jnp.where(in_rot, sin, 0.0))
        return _round(_round(x * cos, dtype) + _round(xp * sin, dtype), dtype)

    rows = lax.iota(jnp.int32, PB * ps)  # key rows of one tile: PB pages

    def tile(step):
        """Keys and values of the tile's PB pages, [PB * ps, D] each, as stored (one gather per pool)."""
        pid = bt_ref[r, jnp.minimum(step * PB + rows // ps, MP - 1)]
        return k_pool_ref[pid, rows % ps, hk, :], v_pool_ref[pid, rows % ps, hk, :]

    # The first tile's loads go out before the prologue below (norms, RoPE, the KV write), so at small grids
    # their latency hides behind it: kernel us a layer at batch 1 6.23 against 6.35, batch 8 6.65 against
    # 6.78, batch 64 (one-page tiles) 15.24 against 15.10 (decode-attention-probe-r24 / -probe-2). They may
    # read the cells this step writes: those are selected out (`old`).
    first_tile = tile(0)

    k_lo, v_lo = 2 * Hq * D + hk * D, 2 * Hq * D + Hkv * D + hk * D
    qs = [normed_rotated(t, h * 2 * D, qn_ref) for t in range(Q)]
    new_k = [normed_rotated(t, k_lo, kn_ref) for t in range(Q)]
    new_v = [product(t, v_lo + d) for t in range(Q)]
    qpos = [qpos_ref[r, jnp.int32(t)] for t in range(Q)]
    old_len, seq_len = old_ref[r], seq_ref[r]

    writer = h % group == 0  # one program of the KV head writes its new K/V
    for t in range(Q):
        slot = slot_ref[r * Q + t]
        page, offset = slot // ps, slot % ps
        mask = jnp.full((D,), writer)
        plt.store(k_pool_ref.at[page, offset, hk, :], new_k[t].astype(pool_dtype), mask=mask)
        plt.store(v_pool_ref.at[page, offset, hk, :], new_v[t].astype(pool_dtype), mask=mask)

    def score(k, q):  # q·k for k [..., D]: rounded as the XLA path's einsum output, then its scaled value
        return _round(_round(jnp.sum(k * q, axis=-1), dtype) * scale, dtype)

    def update(state, s, v):
        """Online softmax of one query: state (m, l, acc [D]); s scores [n] (-inf: not visible), v [n, D]."""
        m, l, acc = state
        m_new = jnp.maximum(m, jnp.max(s))
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # nothing visible yet: stay at zero
        p = jnp.exp(s - shift)
        corr = jnp.exp(jnp.where(m == -jnp.inf, -jnp.inf, m - shift))
        return m_new, l * corr + jnp.sum(p), acc * corr + jnp.sum(p[:, None] * v, axis=0)

    def pages(step, carry):
        (k, v), states = carry
        following = tile(step + 1)  # loads in flight while this tile computes (past the end: read, unused)
        kpos = step * PB * ps + rows
        old = kpos < old_len  # unwritten and this step's slots may hold anything: select, never multiply
        k = _round(k, dtype)
        v = jnp.where(old[:, None], _round(v, dtype), 0.0)
        states = tuple(update(st, jnp.where(old & (kpos <= qpos[t]), score(k, qs[t][None, :]), -jnp.inf), v)
                       for t, st in enumerate(states))
        return following, states

    init = tuple((jnp.float32(-jnp.inf), jnp.float32(0.0), jnp.zeros((D,), f32)) for _ in range(Q))
    n_steps = (old_len + ps * PB - 1) // (ps * PB)
    _, states = lax.fori_loop(0, n_steps, pages, (first_tile, init))
    # this step's keys from registers, as stored in the pool and read back
    stored = [tuple(_round(x.astype(pool_dtype), dtype) for x in kv) for kv in zip(new_k, new_v)]
    for t in range(Q):
        state = states[t]
        for j, (k, v) in enumerate(stored):
            seen = (qpos[j] >= 0) & (qpos[j] <= qpos[t]) & (qpos[j] < seq_len)
            s = jnp.where(seen, score(k, qs[t]), -jnp.inf)
            state = update(state, jnp.full((1,), s), v[None, :])
        _, l, acc = state
        attn = _round(acc / jnp.maximum(l, 1e-30), dtype)
        gate = product(t, h * 2 * D + D + d)
        out_ref[r, jnp.int32(t), pl.ds(h * D, D)] = (attn * _round(jax.nn.sigmoid(gate), dtype)).astype(dtype)


def decode_attention_pooled(y, row_scale, q_norm, k_norm, eps: float, cos, sin, k_pool, v_pool, kv_slots,
                            block_tables, q_positions, old_lens, seq_lens, *, num_heads: int, dtype=None,
                            interpret=None, num_warps: int | None = None, pages_per_step: int | None = None):
    """The gated attention of short rows over the paged pools, written in place; shapes and semantics in the
    module docstring. dtype: the activation dtype (default y's; give it when y is the fp32 product of
    row_scale). Rows' new cells must use distinct slots (padding cells may share the null page's).
    num_warps, pages_per_step (pages per tile of the page loop): default NUM_WARPS, PAGES_PER_STEP's rule."""
    R, Q, N = y.shape
    _, ps, Hkv, D = k_pool.shape
    rot = cos.shape[-1]
    assert decode_attention_supports(D, ps, rot) and num_heads % Hkv == 0, (D, ps, rot, num_heads, Hkv)
    assert N >= 2 * num_heads * D + 2 * Hkv * D, (N, num_heads, Hkv, D)
    dtype = jnp.dtype(dtype or y.dtype)
    i32 = lambda a: jnp.asarray(a).astype(jnp.int32)  # noqa: E731
    scaled = row_scale is not None
    pages_per_step = pages_per_step or PAGES_PER_STEP or (2 if R * num_heads <= DEEP_TILE_MAX_PROGRAMS else 1)
    kernel = functools.partial(_attention_kernel, Q=Q, Hq=num_heads, Hkv=Hkv, D=D, rot=rot, eps=float(eps),
                               scaled=scaled, PB=pages_per_step)
    inputs = (q_norm, k_norm, cos, sin, i32(kv_slots), i32(block_tables), i32(q_positions), i32(old_lens),
              i32(seq_lens))
    return call_on_product(kernel, y, row_scale, inputs, (k_pool, v_pool),
                           jax.ShapeDtypeStruct((R, Q, num_heads * D), dtype), (R, num_heads),
                           num_warps or NUM_WARPS, interpret)
