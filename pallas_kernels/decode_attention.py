"""The gated attention layer of decode and spec-verify rows as one Pallas kernel, between its two products.

Between the fused q/k/v projection and o_proj, a decode step's attention layer is ~15 small XLA kernels (the
q/k RMSNorms, RoPE, the KV write, the gather of each row's pages, scores, softmax, P·V, the sigmoid gate),
each a launch and a pass over its operands. This kernel does it all: one program per (row, query head) normalizes and rotates its query and its KV head's keys for the
row's few new tokens, writes the new K/V into the paged pools in place, attends over the row's pages (keys
written by earlier steps) and over the new keys held in registers, and stores the gated output in o_proj's
input layout. Reading this step's keys from registers rather than from the pages the kernel writes means
no program depends on another's stores. The grouped form (`_grouped_kernel`; for many rows or long block
tables: `DecodeAttentionLayout.grouped`) runs one program per (row, KV head) instead, the group's query heads and the
row's tokens as the rows of matrix products, so a KV head's pages are read once rather than once per query
head, and splits a long row's page tiles over several programs whose softmax states XLA merges
(`_merge_splits`, flash decoding) when the grid would be small.

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
dtype before P·V; the grouped form rounds the probabilities to the activation dtype for its P·V product,
unnormalized). Padding cells write their K/V to their slots (the null page) as write_kv does; their outputs
are zeros.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .common import call_on_product, product_rows

f32 = jnp.float32
@dataclasses.dataclass(frozen=True)
class DecodeAttentionLayout:
    """How the kernel lays out its programs (hashable: part of a program's static kernel policy).

    pages_per_step: pages per tile of the page loop (one gathered load per pool; the next tile's loads in flight
      while one computes); None: 2 while the grid has at most deep_tile_max_programs programs (about one an
      SM: each program's own loads in flight hide the latency), else 1.
    grouped_min_rows / grouped_min_keys: the grouped form (`_grouped_kernel`: one program per (row, KV head),
      the group's query heads on matrix products, a KV head's pages read once instead of once per query head)
      for steps of at least that many rows or block tables of at least that many keys a row (None: never by
      that measure); one program per (row, query head) otherwise, faster for a few short rows.
    split_target_programs / split_min_tiles: the grouped form splits a row's page tiles over programs (flash
      decoding) while the grid has fewer than split_target_programs programs, each split at least
      split_min_tiles tiles: a long row's pages walked by one program alone were slower than XLA's chain.
    """

    pages_per_step: int | None = None
    deep_tile_max_programs: int = 128
    num_warps: int = 4
    grouped_min_rows: int | None = 16
    grouped_min_keys: int | None = 256
    split_target_programs: int = 256
    split_min_tiles: int = 2

    def grouped(self, rows: int, table_keys: int) -> bool:
        """Whether a step of `rows` rows whose block tables hold `table_keys` keys runs the grouped form."""
        return ((self.grouped_min_rows is not None and rows >= self.grouped_min_rows)
                or (self.grouped_min_keys is not None and table_keys >= self.grouped_min_keys))

    def split_count(self, programs: int, tiles: int) -> int:
        """Splits of a row's page tiles for the grouped form: enough that the grid has about
        split_target_programs programs, each at least split_min_tiles tiles; 1 (no split) when the grid is that
        big already or the table that short. programs: R * Hkv; tiles: the block table's page tiles."""
        splits = max(1, min(self.split_target_programs // programs, tiles // self.split_min_tiles))
        per_split = -(-tiles // splits)
        return -(-tiles // per_split)  # no split left without tiles


def decode_attention_supports(head_dim: int, page_size: int, rotary_dim: int) -> bool:
    """A head and a page must be Triton tiles (powers of two; a head >= 16) and RoPE must rotate pairs."""
    pow2 = lambda x: x == pl.next_power_of_2(x)  # noqa: E731
    return head_dim >= 16 and pow2(head_dim) and pow2(page_size) and 0 < rotary_dim <= head_dim and rotary_dim % 2 == 0


def _round(x, dtype):
    """x rounded to dtype and back to fp32: where the XLA path stores or computes in the activation dtype."""
    return x.astype(dtype).astype(f32)


def _scaled_score(raw, D: int, dtype):
    """Scores from fp32 dot products raw: rounded as the XLA path's einsum output, then its scaled value."""
    return _round(_round(raw, dtype) * D**-0.5, dtype)


def _head_reader(read_product, qn_ref, kn_ref, cos_ref, sin_ref, r, D: int, rot: int, eps: float, dtype):
    """(product, normed_rotated) for grid row r. product(t, cols): the product at token t and columns cols as
    fp32 (what the XLA path's product holds). normed_rotated(t, lo, key): rms_norm_1p (q_norm or k_norm) then
    RoPE of the head whose columns start at lo. t is a static int and lo a scalar (-> [D]), or both are
    [M, 1] arrays, one token and head per row (-> [M, D]); rotate-half reads the partner columns."""
    d = lax.iota(jnp.int32, D)
    half = rot // 2
    partner = jnp.where(d < half, d + half, jnp.where(d < rot, d - half, d))
    in_rot = d < rot
    rot_col = jnp.where(in_rot, d, 0)
    sin_sign = jnp.where(d < half, -1.0, jnp.where(in_rot, 1.0, 0.0))

    def product(t, cols):
        return read_product(t, cols).astype(f32)

    def normed_rotated(t, lo, key: bool):
        w_ref = kn_ref if key else qn_ref
        x, xp = product(t, lo + d), product(t, lo + partner)
        inv = lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) / D + eps)
        x = _round(x * inv * (1.0 + w_ref[...].astype(f32)), dtype)
        xp = _round(xp * inv * (1.0 + w_ref[partner].astype(f32)), dtype)
        # index arrays of one rank (Triton's lowering broadcasts within a rank only)
        tt, cols = (jnp.int32(t), rot_col) if isinstance(t, int) else (t, rot_col[None, :])
        cos = jnp.where(in_rot, cos_ref[r, tt, cols].astype(f32), 1.0)
        sin = sin_ref[r, tt, cols].astype(f32) * sin_sign
        return _round(_round(x * cos, dtype) + _round(xp * sin, dtype), dtype)

    return product, normed_rotated


def _page_tiles(k_pool_ref, v_pool_ref, bt_ref, r, hk, PB: int):
    """tile(step): the keys and values of KV head hk in pages step*PB .. step*PB+PB-1 of row r's block table,
    [PB * ps, D] each, as stored (one gathered load per pool); and the tile's key rows [PB * ps]."""
    ps, MP = k_pool_ref.shape[1], bt_ref.shape[1]
    rows = lax.iota(jnp.int32, PB * ps)

    def tile(step):
        pid = bt_ref[r, jnp.minimum(step * PB + rows // ps, MP - 1)]
        return k_pool_ref[pid, rows % ps, hk, :], v_pool_ref[pid, rows % ps, hk, :]

    return tile, rows


def _write_new_kv(k_pool_ref, v_pool_ref, slot_ref, r, hk, Q: int, new_k, new_v, writer=True):
    """This step's K/V of KV head hk (Q lists of [D]) into the pools at the cells' flat slots, in place."""
    from jax.experimental.pallas import triton as plt  # masked stores (also in interpret mode)

    ps, D = k_pool_ref.shape[1], k_pool_ref.shape[3]
    for t in range(Q):
        slot = slot_ref[r * Q + t]
        page, offset = slot // ps, slot % ps
        mask = jnp.full((D,), writer)
        plt.store(k_pool_ref.at[page, offset, hk, :], new_k[t].astype(k_pool_ref.dtype), mask=mask)
        plt.store(v_pool_ref.at[page, offset, hk, :], new_v[t].astype(v_pool_ref.dtype), mask=mask)


def _attention_kernel(y_ref, *refs, Q, Hq, Hkv, D, rot, eps, scaled, PB):
    """One program per (row, query head); see the module docstring."""
    r, h = pl.program_id(0), pl.program_id(1)
    read_product, refs = product_rows(y_ref, refs, scaled, r)
    (qn_ref, kn_ref, cos_ref, sin_ref, slot_ref, bt_ref, qpos_ref, old_ref, seq_ref, _k_in, _v_in,
     out_ref, k_pool_ref, v_pool_ref) = refs
    group = Hq // Hkv
    hk = h // group
    dtype, pool_dtype = out_ref.dtype, k_pool_ref.dtype
    ps = k_pool_ref.shape[1]
    d = lax.iota(jnp.int32, D)
    product, normed_rotated = _head_reader(read_product, qn_ref, kn_ref, cos_ref, sin_ref, r, D, rot, eps, dtype)
    tile, rows = _page_tiles(k_pool_ref, v_pool_ref, bt_ref, r, hk, PB)
    # The first tile's loads go out before the prologue below (norms, RoPE, the KV write), so at small grids
    # their latency hides behind it. They may read the cells this step writes: those are selected out (`old`).
    first_tile = tile(0)

    k_lo, v_lo = 2 * Hq * D + hk * D, 2 * Hq * D + Hkv * D + hk * D
    qs = [normed_rotated(t, h * 2 * D, key=False) for t in range(Q)]
    new_k = [normed_rotated(t, k_lo, key=True) for t in range(Q)]
    new_v = [product(t, v_lo + d) for t in range(Q)]
    qpos = [qpos_ref[r, jnp.int32(t)] for t in range(Q)]
    old_len, seq_len = old_ref[r], seq_ref[r]
    # one program of the KV head writes its new K/V
    _write_new_kv(k_pool_ref, v_pool_ref, slot_ref, r, hk, Q, new_k, new_v, writer=h % group == 0)

    def score(k, q):  # q·k for k [..., D]
        return _scaled_score(jnp.sum(k * q, axis=-1), D, dtype)

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


def _grouped_kernel(y_ref, *refs, Q, Hq, Hkv, D, rot, eps, scaled, PB, M, S, TS, dtype):
    """One program per (row, KV head, split): the group's Hq/Hkv query heads x Q tokens as M matrix rows (row
    i is cell i mod (group * Q): token (i mod group*Q) // group, head hk * group + i mod group; rows past
    group * Q repeat earlier ones, so every row is real and their duplicate stores write equal values), scored
    against each page tile with one [M, D] x [D, tile] product and accumulated with one [M, tile] x [tile, D]
    product: each KV head's keys and values are read once for its group instead of once per query head.
    With S > 1 splits (flash decoding) program s attends over page tiles s*TS .. s*TS+TS-1 only (split 0
    also over the step's own keys, and it writes them to the pools) and stores its unnormalized online-softmax
    state (m, l [M], acc [M, D]) for `_merge_splits`; with S = 1 it stores the gated output itself."""
    r, hk, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    read_product, refs = product_rows(y_ref, refs, scaled, r, dtype)
    (qn_ref, kn_ref, cos_ref, sin_ref, slot_ref, bt_ref, qpos_ref, old_ref, seq_ref, _k_in, _v_in), refs = (
        refs[:11], refs[11:])
    *out_refs, k_pool_ref, v_pool_ref = refs
    group = Hq // Hkv
    pool_dtype = k_pool_ref.dtype
    ps = k_pool_ref.shape[1]
    d = lax.iota(jnp.int32, D)
    precision = lax.Precision.HIGHEST if dtype == jnp.dtype(f32) else None  # fp32 activations: no TF32
    product, normed_rotated = _head_reader(read_product, qn_ref, kn_ref, cos_ref, sin_ref, r, D, rot, eps, dtype)
    tile, rows = _page_tiles(k_pool_ref, v_pool_ref, bt_ref, r, hk, PB)
    old_len, seq_len = old_ref[r], seq_ref[r]
    n_steps = (old_len + ps * PB - 1) // (ps * PB)
    first, stop = (0, n_steps) if S == 1 else (s * TS, jnp.minimum(s * TS + TS, n_steps))
    first_tile = tile(first)  # in flight during the prologue, as in _attention_kernel

    cell = lax.iota(jnp.int32, M) % (group * Q)
    t_row = (cell // group)[:, None]  # [M, 1] token of each matrix row
    h_row = (hk * group + cell % group)[:, None]  # [M, 1] query head of each matrix row
    q = normed_rotated(t_row, h_row * 2 * D, key=False)  # [M, D]
    k_lo, v_lo = 2 * Hq * D + hk * D, 2 * Hq * D + Hkv * D + hk * D
    new_k = [normed_rotated(t, k_lo, key=True) for t in range(Q)]
    new_v = [product(t, v_lo + d) for t in range(Q)]
    qpos_row = qpos_ref[r, t_row[:, 0]]  # [M]
    qpos = [qpos_ref[r, jnp.int32(t)] for t in range(Q)]
    own_split = s == 0  # the split that owns the step's new keys: writes them and attends over them
    _write_new_kv(k_pool_ref, v_pool_ref, slot_ref, r, hk, Q, new_k, new_v, writer=own_split)

    def update(state, scores, pv):
        """Online softmax of the M rows: state (m [M], l [M], acc [M, D]); scores [M, n] (-inf: not
        visible); pv(p) -> [M, D], the probabilities p [M, n] times the values."""
        m, l, acc = state
        m_new = jnp.maximum(m, jnp.max(scores, axis=1))
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # nothing visible yet: stay at zero
        p = jnp.exp(scores - shift[:, None])
        corr = jnp.exp(jnp.where(m == -jnp.inf, -jnp.inf, m - shift))
        return m_new, l * corr + jnp.sum(p, axis=1), acc * corr[:, None] + pv(p)

    q_op = q.astype(dtype)

    def pages(step, carry):
        (k, v), state = carry
        following = tile(step + 1)  # loads in flight while this tile computes (past the end: read, unused)
        kpos = step * PB * ps + rows
        old = kpos < old_len  # unwritten and this step's slots may hold anything: select, never multiply
        k = k.astype(dtype)
        v = jnp.where(old[:, None], v.astype(dtype), jnp.zeros((), dtype))
        raw = jnp.dot(q_op, k.T, preferred_element_type=f32, precision=precision)  # [M, n]
        seen = old[None, :] & (kpos[None, :] <= qpos_row[:, None])
        pv = lambda p: jnp.dot(p.astype(dtype), v, preferred_element_type=f32, precision=precision)  # noqa: E731
        return following, update(state, jnp.where(seen, _scaled_score(raw, D, dtype), -jnp.inf), pv)

    init = (jnp.full((M,), -jnp.inf, f32), jnp.zeros((M,), f32), jnp.zeros((M, D), f32))
    _, state = lax.fori_loop(first, stop, pages, (first_tile, init))
    for j in range(Q):  # this step's keys from registers, as stored in the pool and read back
        k, v = (_round(x.astype(pool_dtype), dtype) for x in (new_k[j], new_v[j]))
        seen = own_split & (qpos[j] >= 0) & (qpos[j] <= qpos_row) & (qpos[j] < seq_len)  # [M]
        score = jnp.where(seen, _scaled_score(jnp.sum(q * k[None, :], axis=1), D, dtype), -jnp.inf)
        state = update(state, score[:, None], lambda p: p * v[None, :])
    m, l, acc = state
    if S > 1:
        m_ref, l_ref, acc_ref = out_refs
        m_ref[r, hk, s, :] = m
        l_ref[r, hk, s, :] = l
        acc_ref[r, hk, s, :, :] = acc
        return
    attn = _round(acc / jnp.maximum(l, 1e-30)[:, None], dtype)
    gate = product(t_row, h_row * 2 * D + D + d)
    out_refs[0][r, t_row, h_row * D + d] = (attn * _round(jax.nn.sigmoid(gate), dtype)).astype(dtype)


def _merge_splits(m, l, acc, y, row_scale, Q: int, Hq: int, D: int, dtype):
    """The S splits' online-softmax states of `_grouped_kernel` merged, normalized and gated, in XLA: m, l
    [R, Hkv, S, M], acc [R, Hkv, S, M, D] (fp32; matrix rows past group * Q are duplicates); y, row_scale the
    kernel's inputs (the gate columns). -> [R, Q, Hq * D] in dtype, as the unsplit kernel stores it."""
    R, Hkv = m.shape[:2]
    cells = Hq // Hkv * Q
    m, l, acc = m[..., :cells], l[..., :cells], acc[..., :cells, :]
    top = jnp.max(m, axis=2, keepdims=True)
    weight = jnp.where(m == -jnp.inf, 0.0, jnp.exp(m - jnp.where(top == -jnp.inf, 0.0, top)))
    l = jnp.sum(weight * l, axis=2)
    acc = jnp.sum(weight[..., None] * acc, axis=2)  # [R, Hkv, cells, D]
    attn = _round(acc / jnp.maximum(l, 1e-30)[..., None], dtype)
    # matrix row c of KV head hk is token c // group, query head hk * group + c % group
    attn = attn.reshape(R, Hkv, Q, Hq // Hkv, D).transpose(0, 2, 1, 3, 4).reshape(R, Q, Hq, D)
    gate = y[..., : 2 * Hq * D].reshape(R, Q, Hq, 2 * D)[..., D:]
    if row_scale is not None:
        gate = gate.astype(f32) * row_scale.astype(f32)[..., None]
    gate = gate.astype(dtype).astype(f32)
    return (attn * _round(jax.nn.sigmoid(gate), dtype)).astype(dtype).reshape(R, Q, Hq * D)


def decode_attention_pooled(y, row_scale, q_norm, k_norm, eps: float, cos, sin, k_pool, v_pool, kv_slots,
                            block_tables, q_positions, old_lens, seq_lens, *, num_heads: int, dtype=None,
                            interpret=None, layout: DecodeAttentionLayout = DecodeAttentionLayout(),
                            grouped: bool | None = None, splits: int | None = None):
    """The gated attention of short rows over the paged pools, written in place; shapes and semantics in the
    module docstring. dtype: the activation dtype (default y's; give it when y is the fp32 product of
    row_scale). Rows' new cells must use distinct slots (padding cells may share the null page's).
    layout: the programs' layout. grouped: one program per (row, KV head) with the group's query heads on
    matrix products (`_grouped_kernel`) instead of one per (row, query head); default the layout's rule.
    splits: the grouped form's splits of each row's page tiles (default the layout's; forces grouped when > 1)."""
    R, Q, N = y.shape
    _, ps, Hkv, D = k_pool.shape
    MP = block_tables.shape[1]
    rot = cos.shape[-1]
    assert decode_attention_supports(D, ps, rot) and num_heads % Hkv == 0, (D, ps, rot, num_heads, Hkv)
    assert N >= 2 * num_heads * D + 2 * Hkv * D, (N, num_heads, Hkv, D)
    dtype = jnp.dtype(dtype or y.dtype)
    i32 = lambda a: jnp.asarray(a).astype(jnp.int32)  # noqa: E731
    scaled = row_scale is not None
    if grouped is None:
        grouped = (splits or 1) > 1 or layout.grouped(R, MP * ps)
    programs = R * (Hkv if grouped else num_heads)
    pages_per_step = layout.pages_per_step or (2 if programs <= layout.deep_tile_max_programs else 1)
    common = dict(Q=Q, Hq=num_heads, Hkv=Hkv, D=D, rot=rot, eps=float(eps), scaled=scaled, PB=pages_per_step)
    inputs = (q_norm, k_norm, cos, sin, i32(kv_slots), i32(block_tables), i32(q_positions), i32(old_lens),
              i32(seq_lens))
    out = jax.ShapeDtypeStruct((R, Q, num_heads * D), dtype)
    if not grouped:
        kernel = functools.partial(_attention_kernel, **common)
        return call_on_product(kernel, y, row_scale, inputs, (k_pool, v_pool), out, (R, num_heads),
                               layout.num_warps, interpret)
    # matrix rows: the group's heads x Q tokens; every dot dimension at least 16 (Triton's smallest)
    PB = common["PB"] = max(pages_per_step, -(-16 // ps))
    M = max(16, pl.next_power_of_2(num_heads // Hkv * Q))
    tiles = -(-MP // PB)
    S = splits or layout.split_count(R * Hkv, tiles)
    kernel = functools.partial(_grouped_kernel, M=M, S=S, TS=-(-tiles // S), dtype=dtype, **common)
    if S > 1:
        out = (jax.ShapeDtypeStruct((R, Hkv, S, M), f32),) * 2 + (jax.ShapeDtypeStruct((R, Hkv, S, M, D), f32),)
    outputs = call_on_product(kernel, y, row_scale, inputs, (k_pool, v_pool), out, (R, Hkv, S),
                              layout.num_warps, interpret)
    if S == 1:
        return outputs
    m, l, acc, k_pool, v_pool = outputs
    return _merge_splits(m, l, acc, y, row_scale, Q, num_heads, D, dtype), k_pool, v_pool
