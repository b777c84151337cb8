"""The gated delta rule of a ragged step as Pallas kernels, reading and writing the engine's state pool in place
(Triton lowering on a GPU, interpret mode on CPU); `gdn_reference.gdn_ragged_reference` is the reference.

    q, k [T, Hk, dk], v [T, Hv, dv]   the step's conv outputs, rows one after another (not L2-normed)
    g, beta [T, Hv] fp32              gates, 0 and 0 on padding tokens
    pool [S, W, Hv, dk, dv] fp32      the slot pool: checkpoint `start` of a row's slot is its committed state
    query_start_loc [R+1], slots, start, fresh, verify [R]
    -> o [T, Hv, dv] fp32 (zeros on padding tokens), the pool with every row's new state written

A dense batch [B, L] is the stream of B rows with query_start_loc = arange(B + 1) * L.

A row of at most SHORT_ROW tokens (decode, prompt tails, verify windows, short prompts) runs the token loop of
`_short_rows_kernel`, one program per (row, value head, dv tile) holding its state tile in registers; a
verify row writes the state after each of its first W tokens to checkpoints 0..W-1, any other row its final
state to checkpoint 0.

Longer rows (prompt chunks) run the chunked (WY) form over chunks of CHUNK tokens that never cross a row
(`gdn_reference.gdn_chunked_reference` is the same math in XLA). `_prep_kernel`, over every chunk in parallel:
cumulative log decay γ, A = strict_lower(βKKᵀ ⊙ e^{γ_i-γ_j}), (I+A)⁻¹ by forward substitution on SUB-row
blocks plus block combination (`gdn_common.chunk_inverse`), U = (I+A)⁻¹βV, W = (I+A)⁻¹βe^γK and the key scale
s = e^{γ_last-γ} (with the key norm). `_output_parts_kernel` forms QKᵀ ⊙ Dec and the query factor, also in
parallel. `_scan_kernel` is the only sequential part: per (long row, head, dv tile) it walks the row's chunks
with the state in registers, V' = U - W S, S <- e^{γ_last} S + Kᵀ(s ⊙ V'), and adds the output's two
state-dependent products inside its loop, O = (e^γ Q) S_enter + (QKᵀ ⊙ Dec) V', so the entering states and V'
never go to memory; it writes the final state. The chunk table (`chunk_tables`) is built on the device from
query_start_loc; its length is fixed by T and R. Head sizes must be Triton tiles (`gdn_common.tiles_supported`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .common import interpret_default, triton_params
from .gdn_common import CHUNK, SHORT_ROW, SUB, chunk_inverse, delta_step, dot, inv_norm, tiles_supported, value_block

f32 = jnp.float32


def max_long_rows(T: int, R: int) -> int:
    """The most rows of more than SHORT_ROW tokens a step of T tokens in R rows can hold."""
    return max(1, min(R, T // (SHORT_ROW + 1)))


def chunk_tables(query_start_loc, T: int):
    """On the device: the chunks of the rows longer than SHORT_ROW tokens, CHUNK tokens each (a row's last one
    partial). Returns (chunk_start [NC] first token, chunk_len [NC] (0: unused), long_row [L] row of each
    long row (-1: unused), first_chunk [R], num_chunks [R]); NC = T // CHUNK + L, L = max_long_rows."""
    R = query_start_loc.shape[0] - 1
    L = max_long_rows(T, R)
    NC = T // CHUNK + L
    n = query_start_loc[1:] - query_start_loc[:-1]
    long = n > SHORT_ROW
    num_chunks = jnp.where(long, (n + CHUNK - 1) // CHUNK, 0).astype(jnp.int32)
    ends = jnp.cumsum(num_chunks)
    first = ends - num_chunks
    c = jnp.arange(NC, dtype=jnp.int32)
    row = jnp.clip(jnp.searchsorted(ends, c, side="right", method="compare_all"), 0, R - 1).astype(jnp.int32)
    start = query_start_loc[row] + (c - first[row]) * CHUNK
    length = jnp.where(c < ends[-1], jnp.clip(query_start_loc[row + 1] - start, 0, CHUNK), 0).astype(jnp.int32)
    rank = jnp.cumsum(long) - 1
    long_row = jnp.full((L,), -1, jnp.int32).at[jnp.where(long, rank, L)].set(jnp.arange(R, dtype=jnp.int32),
                                                                              mode="drop")
    return start.astype(jnp.int32), length, long_row, first.astype(jnp.int32), num_chunks


def _tokens(start, length, n: int, T: int):
    """Token indices start .. start+n-1 clipped into [0, T) and the mask of those inside the length. (Loads
    only: a masked store at clipped duplicates can lose the real lane's value in interpret mode.)"""
    i = lax.iota(jnp.int32, n)
    return jnp.minimum(start + i, T - 1), i < length


def _short_rows_kernel(qsl_ref, slot_ref, start_ref, fresh_ref, verify_ref, q_ref, k_ref, v_ref, g_ref, beta_ref,
                       _o_in, _pool_in, o_ref, pool_ref, *, group, BV, scale):
    from jax.experimental.pallas import triton as plt  # masked stores (also in interpret mode)

    b, h, iv = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    hk = h // group
    t0 = qsl_ref[b]
    n = qsl_ref[b + 1] - t0
    W = pool_ref.shape[1]
    cols = pl.ds(iv * BV, BV)

    @pl.when((n > 0) & (n <= SHORT_ROW))
    def _row():
        slot = slot_ref[b]
        S = pool_ref[slot, start_ref[b], h, :, cols]
        S = jnp.where(fresh_ref[b] != 0, 0.0, S)  # a fresh row never sees what the slot held before
        verify = verify_ref[b] != 0

        def token(i, S):
            t = t0 + i
            S, o = delta_step(q_ref[t, hk, :], k_ref[t, hk, :], v_ref[t, h, cols], g_ref[t, h], beta_ref[t, h], scale,
                               S)
            o_ref[t, h, cols] = o
            # a verify row keeps the state after each of its first W tokens: checkpoint i
            plt.store(pool_ref.at[slot, jnp.minimum(i, W - 1), h, :, cols], S,
                      mask=jnp.full(S.shape, verify & (i < W)))
            return S

        S = lax.fori_loop(0, n, token, S)
        plt.store(pool_ref.at[slot, jnp.int32(0), h, :, cols], S, mask=jnp.full(S.shape, jnp.logical_not(verify)))


def _prep_kernel(cstart_ref, clen_ref, k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, kscale_ref, gam_ref, *, group,
                 dtype):
    """One (chunk, value head): γ, (I+A)⁻¹, U, W and the key scale for the chunk's tokens
    of the stream, stored at the chunk's rows of the chunk-major outputs; tokens past its length are zeros."""
    from jax.experimental.pallas import triton as plt

    c, h = pl.program_id(0), pl.program_id(1)
    hk = h // group
    T = k_ref.shape[0]
    dk, dv = k_ref.shape[-1], v_ref.shape[-1]
    length = clen_ref[c]

    @pl.when(length > 0)
    def _chunk():
        nsub = CHUNK // SUB
        blocks = [_tokens(cstart_ref[c] + i * SUB, length - i * SUB, SUB, T) for i in range(nsub)]
        ks = [plt.load(k_ref.at[t[:, None], hk, lax.iota(jnp.int32, dk)[None, :]], mask=ok[:, None], other=0)
              for t, ok in blocks]
        vs = [plt.load(v_ref.at[t[:, None], h, lax.iota(jnp.int32, dv)[None, :]], mask=ok[:, None], other=0)
              for t, ok in blocks]
        gs = [plt.load(g_ref.at[t, h], mask=ok, other=0.0) for t, ok in blocks]
        betas = [plt.load(beta_ref.at[t, h], mask=ok, other=0.0) for t, ok in blocks]
        inv_norms = [inv_norm(x) for x in ks]
        rows = [pl.ds(c * CHUNK + i * SUB, SUB) for i in range(nsub)]
        gam, last = [], jnp.zeros((), f32)
        for r, g in zip(rows, gs):
            gam.append(jnp.cumsum(g) + last)
            last = last + jnp.sum(g)
            gam_ref[r, h] = gam[-1]
        inv = chunk_inverse(ks, inv_norms, betas, gam, dtype)
        w_scale = [betas[j] * inv_norms[j] * jnp.exp(gam[j]) for j in range(nsub)]
        for i in range(nsub):
            u = sum(dot(inv[i, j] * betas[j][None, :], vs[j], dtype) for j in range(i + 1))
            w = sum(dot(inv[i, j] * w_scale[j][None, :], ks[j], dtype) for j in range(i + 1))
            u_ref[rows[i], h, :] = u.astype(u_ref.dtype)
            w_ref[rows[i], h, :] = w.astype(w_ref.dtype)
            kscale_ref[rows[i], h] = jnp.where(blocks[i][1], inv_norms[i] * jnp.exp(last - gam[i]), 0.0)


def _output_parts_kernel(cstart_ref, clen_ref, q_ref, k_ref, gam_ref, intra_ref, qf_ref, *, group, scale, dtype):
    """One (chunk, value head): the state-independent parts of the output for `_scan_kernel`, intra =
    (QKᵀ ⊙ Dec) [CHUNK, CHUNK] (L2-normed, scaled queries and keys, Dec_ij = e^{γ_i-γ_j} for i >= j, zero
    above) and the query factor qf = scale e^γ / |q| [CHUNK], for the chunk's tokens of the stream (zeros
    past its length). The product takes the raw q and k as loaded; the norms scale it after, in fp32."""
    from jax.experimental.pallas import triton as plt

    c, h = pl.program_id(0), pl.program_id(1)
    hk = h // group
    T, dk = q_ref.shape[0], q_ref.shape[-1]
    length = clen_ref[c]

    @pl.when(length > 0)
    def _chunk():
        t, ok = _tokens(cstart_ref[c], length, CHUNK, T)
        d = lax.iota(jnp.int32, dk)[None, :]
        q = plt.load(q_ref.at[t[:, None], hk, d], mask=ok[:, None], other=0)
        k = plt.load(k_ref.at[t[:, None], hk, d], mask=ok[:, None], other=0)
        rows = pl.ds(c * CHUNK, CHUNK)
        r = lax.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 0)
        cc = lax.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 1)
        inv_q, inv_k = inv_norm(q), inv_norm(k)
        gam = gam_ref[rows, h]
        decay = jnp.exp(jnp.where(r >= cc, gam[:, None] - gam[None, :], -jnp.inf))
        intra = dot(q, k.T, dtype) * (scale * inv_q)[:, None] * inv_k[None, :] * decay
        intra_ref[rows, h, :] = intra.astype(intra_ref.dtype)
        qf_ref[rows, h] = jnp.where(ok, scale * inv_q * jnp.exp(gam), 0.0)


def _scan_kernel(lrow_ref, first_ref, nch_ref, cstart_ref, clen_ref, slot_ref, start_ref, fresh_ref, w_ref, u_ref,
                 q_ref, k_ref, kscale_ref, gam_ref, qf_ref, intra_ref, _o_in, _pool_in, o_ref, pool_ref, *, group, BV,
                 dtype):
    """One (long row, value head, dv tile): the row's chunks in order with the state [dk, BV] in registers, from
    the slot's committed state; V' = U - W S, O = qf ⊙ (Q S) + intra V' stored at the chunk's tokens,
    S <- e^{γ_last} S + Kᵀ(s ⊙ V'); the final state to checkpoint 0."""
    from jax.experimental.pallas import triton as plt

    l, h, iv = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    hk = h // group
    T, dk = q_ref.shape[0], q_ref.shape[-1]
    row = lrow_ref[l]
    cols = pl.ds(iv * BV, BV)

    @pl.when(row >= 0)
    def _row():
        slot = slot_ref[row]
        S = pool_ref[slot, start_ref[row], h, :, cols]
        S = jnp.where(fresh_ref[row] != 0, 0.0, S)
        d = lax.iota(jnp.int32, dk)[None, :]
        vcols = iv * BV + lax.iota(jnp.int32, BV)[None, :]

        def chunk(j, S):
            c = first_ref[row] + j
            t, ok = _tokens(cstart_ref[c], clen_ref[c], CHUNK, T)
            rows = pl.ds(c * CHUNK, CHUNK)
            v_new = u_ref[rows, h, cols].astype(f32) - dot(w_ref[rows, h, :], S, dtype)  # [CHUNK, BV]
            q = plt.load(q_ref.at[t[:, None], hk, d], mask=ok[:, None], other=0)
            o = qf_ref[rows, h][:, None] * dot(q, S, dtype) + dot(intra_ref[rows, h, :], v_new, dtype)
            # o has CHUNK rows past T, so the store's indices need no clipping
            out_t = cstart_ref[c] + lax.iota(jnp.int32, CHUNK)
            plt.store(o_ref.at[out_t[:, None], h, vcols], o, mask=ok[:, None])
            k = plt.load(k_ref.at[t[:, None], hk, d], mask=ok[:, None], other=0)
            g_last = gam_ref[c * CHUNK + CHUNK - 1, h]
            return S * jnp.exp(g_last) + dot(k.T, v_new * kscale_ref[rows, h][:, None], dtype)

        pool_ref[slot, jnp.int32(0), h, :, cols] = lax.fori_loop(0, nch_ref[row], chunk, S)


def gdn_ragged_chunked(q, k, v, g, beta, pool, query_start_loc, slots, start, fresh, verify, interpret=None,
                      warps: tuple[int, int, int, int] = (4, 2, 4, 4)):
    """The recurrence of a ragged step on the kernels; shapes and semantics in the module docstring. Returns
    (o [T, Hv, dv] fp32, updated pool). Rows must use distinct slots (padding rows may share the null slot:
    they have no tokens). warps: (short rows, prep, output parts, scan)."""
    T, Hk, dk = q.shape
    Hv, dv = v.shape[1], v.shape[2]
    R = slots.shape[0]
    assert tiles_supported(dk, dv) and pool.shape[2:] == (Hv, dk, dv), (q.shape, v.shape, pool.shape)
    interpret = interpret_default(interpret)
    group = Hv // Hk
    i32 = lambda a: jnp.asarray(a).astype(jnp.int32)  # noqa: E731
    qsl, slots, start, fresh, verify = (i32(a) for a in (query_start_loc, slots, start, fresh, verify))
    dtype = jnp.promote_types(q.dtype, v.dtype)
    sds = jax.ShapeDtypeStruct
    g, beta = g.astype(f32), beta.astype(f32)
    cstart, clen, long_row, first, num_chunks = chunk_tables(qsl, T)
    NC, L = cstart.shape[0], long_row.shape[0]
    short_warps, prep_warps, parts_warps, scan_warps = warps

    w, u, kscale, gam = pl.pallas_call(
        functools.partial(_prep_kernel, group=group, dtype=dtype),
        out_shape=(sds((NC * CHUNK, Hv, dk), dtype), sds((NC * CHUNK, Hv, dv), dtype), sds((NC * CHUNK, Hv), f32),
                   sds((NC * CHUNK, Hv), f32)),
        grid=(NC, Hv), interpret=interpret, compiler_params=triton_params(prep_warps),
    )(cstart, clen, k, v, g, beta)
    intra, qf = pl.pallas_call(
        functools.partial(_output_parts_kernel, group=group, scale=dk**-0.5, dtype=dtype),
        out_shape=(sds((NC * CHUNK, Hv, CHUNK), dtype), sds((NC * CHUNK, Hv), f32)),
        grid=(NC, Hv), interpret=interpret, compiler_params=triton_params(parts_warps),
    )(cstart, clen, q, k, gam)
    BV = value_block(dv, L * Hv)
    o = jnp.zeros((T + CHUNK, Hv, dv), f32)  # rows past T: where a last chunk's masked lanes point
    o, pool = pl.pallas_call(
        functools.partial(_scan_kernel, group=group, BV=BV, dtype=dtype),
        out_shape=(sds(o.shape, f32), sds(pool.shape, pool.dtype)), grid=(L, Hv, dv // BV),
        input_output_aliases={16: 0, 17: 1}, interpret=interpret,
        compiler_params=triton_params(scan_warps, num_stages=2),
    )(long_row, first, num_chunks, cstart, clen, slots, start, fresh, w, u, q, k, kscale, gam, qf, intra, o, pool)
    BV = value_block(dv, R * Hv)
    o, pool = pl.pallas_call(
        functools.partial(_short_rows_kernel, group=group, BV=BV, scale=dk**-0.5),
        out_shape=(sds(o.shape, f32), sds(pool.shape, pool.dtype)), grid=(R, Hv, dv // BV),
        input_output_aliases={10: 0, 11: 1}, interpret=interpret, compiler_params=triton_params(short_warps),
    )(qsl, slots, start, fresh, verify, q, k, v, g, beta, o, pool)
    return o[:T], pool
