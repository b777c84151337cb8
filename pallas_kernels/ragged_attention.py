"""Causal GQA attention of a ragged token stream over a paged KV pool: the XLA reference and a Pallas kernel.

One step's tokens are one flat stream; each token belongs to a row (a request's window: a prompt chunk, a
prompt tail, a decode token or a verify window) that owns a block table of pages:

    q            [T, Hq, D]      this step's queries (normed, rotated)
    k_pool/v_pool [P, ps, Hkv, D] the pools, this step's keys already written; page 0 is the null page
    token_row    [T] int32       the row of each token, -1 for padding (sees no key, output zeros)
    q_positions  [T] int32       absolute position of each query
    block_tables [R, MP] int32   page ids of each row's positions 0, ps, 2ps, ...
    seq_lens     [R] int32       keys 0 .. seq_len-1 exist for the row
    -> out [T, Hq, D] in q.dtype

Key s of row r is visible to query t of that row iff s <= q_positions[t] and s < seq_lens[r]. Query head h
reads KV head h // (Hq / Hkv). Scores are fp32 products of the operands in q's dtype, scaled by D^-1/2; the
softmax runs online over pages in fp32 (unnormalized probabilities times values, one division at the end),
so no [T, context] score matrix exists and memory stays O(T) whatever the rows' contexts.

The kernel (`ragged_paged_attention`) runs one program per (block of BQ queries of one row, KV head): the
group's query heads times the block's tokens are the rows of its matrix products, and it walks the row's
pages up to the block's last query position. Blocks come from a table the host builds with the step
(`query_blocks`): at most T // BQ + R of them, so the grid is fixed by (T, R).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from .common import interpret_default, triton_params

f32 = jnp.float32


def ragged_paged_attention_reference(q, k_pool, v_pool, token_row, q_positions, block_tables, seq_lens):
    """XLA: a loop over page index j (up to the longest row's pages) with an online softmax; each token
    reads page block_tables[row, j] of its row. Shapes and semantics in the module docstring."""
    T, Hq, D = q.shape
    P, ps, Hkv, _ = k_pool.shape
    R, MP = block_tables.shape
    G = Hq // Hkv
    valid = token_row >= 0
    row = jnp.clip(token_row, 0, R - 1)
    seq = jnp.where(valid, seq_lens[row], 0)  # [T]
    qg = q.reshape(T, Hkv, G, D)
    scale = D**-0.5
    n_pages = jnp.minimum((jnp.max(seq) + ps - 1) // ps, MP)
    offs = jnp.arange(ps, dtype=jnp.int32)

    def page(j, carry):
        m, l, acc = carry  # [T, Hkv, G], [T, Hkv, G], [T, Hkv, G, D]
        pid = block_tables[row, j]  # [T]
        k = k_pool[pid].astype(q.dtype)  # [T, ps, Hkv, D]
        v = v_pool[pid].astype(q.dtype)
        kpos = j * ps + offs  # [ps]
        visible = (kpos[None, :] <= q_positions[:, None]) & (kpos[None, :] < seq[:, None])  # [T, ps]
        s = jnp.einsum("tkgd,tskd->tkgs", qg, k, preferred_element_type=f32) * scale
        s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # nothing visible yet: stay at zero
        p = jnp.exp(s - shift[..., None])
        corr = jnp.exp(jnp.where(m == -jnp.inf, -jnp.inf, m - shift))
        v = jnp.where((kpos[None, :] < seq[:, None])[..., None, None], v, 0)  # never multiply a zero by garbage
        pv = jnp.einsum("tkgs,tskd->tkgd", p.astype(q.dtype), v, preferred_element_type=f32)
        return m_new, l * corr + jnp.sum(p, axis=-1), acc * corr[..., None] + pv

    init = (jnp.full((T, Hkv, G), -jnp.inf, f32), jnp.zeros((T, Hkv, G), f32), jnp.zeros((T, Hkv, G, D), f32))
    _, l, acc = lax.fori_loop(0, n_pages, page, init)
    out = acc / jnp.maximum(l, 1e-30)[..., None]
    return jnp.where(valid[:, None, None], out.reshape(T, Hq, D), 0).astype(q.dtype)


# ----------------------------------------------------------------------------- the Pallas kernel

BLOCK_ROWS = 64  # matrix rows of a program: BQ query tokens x the group's query heads


def block_queries(num_heads: int, num_kv_heads: int) -> int:
    """Query tokens per program (BQ): BLOCK_ROWS matrix rows over the group's heads, at least 1."""
    return max(1, BLOCK_ROWS // (num_heads // num_kv_heads))


def num_query_blocks(T: int, R: int, bq: int) -> int:
    """Table length for a step of T tokens in R rows: each row adds at most one partial block."""
    return T // bq + R


def query_blocks(query_start_loc: np.ndarray, num_rows: int, bq: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Host side: (block_row [size], block_start [size]) of a step's query blocks, BQ tokens of one row
    each (the row's last block may be partial); unused entries have row -1."""
    qsl = np.asarray(query_start_loc[: num_rows + 1])
    n = np.diff(qsl)
    per_row = -(-n // bq)
    total = int(per_row.sum())
    assert total <= size, (total, size)
    rows = np.full(size, -1, np.int32)
    starts = np.zeros(size, np.int32)
    owner = np.repeat(np.arange(num_rows, dtype=np.int32), per_row)
    first = np.repeat(np.cumsum(per_row) - per_row, per_row)
    rows[:total] = owner
    starts[:total] = qsl[owner] + (np.arange(total) - first) * bq
    return rows, starts


def _kernel(brow_ref, bstart_ref, qsl_ref, seq_ref, bt_ref, pos_ref, q_ref, k_ref, v_ref, _zeros, o_ref, *, BQ, G,
            PB):
    from jax.experimental.pallas import triton as plt  # masked loads and stores (also in interpret mode)

    b, hk = pl.program_id(0), pl.program_id(1)
    row = brow_ref[b]
    D = q_ref.shape[-1]
    ps = k_ref.shape[1]
    MP = bt_ref.shape[1]
    M = BQ * G
    live = row >= 0
    r = jnp.maximum(row, 0)
    start, end = bstart_ref[b], qsl_ref[r + 1]
    i = lax.iota(jnp.int32, M)
    tok = start + i // G  # [M] token of each matrix row
    head = hk * G + i % G  # [M] query head of each matrix row
    in_row = live & (tok < end)
    tok_c = jnp.minimum(tok, q_ref.shape[0] - 1)
    d = lax.iota(jnp.int32, D)
    q = plt.load(q_ref.at[tok_c[:, None], head[:, None], d[None, :]], mask=in_row[:, None], other=0)  # [M, D]
    qpos = jnp.where(in_row, plt.load(pos_ref.at[tok_c], mask=in_row, other=-1), -1)  # [M]
    seq_len = jnp.where(live, seq_ref[r], 0)
    dtype = q.dtype
    precision = lax.Precision.HIGHEST if dtype == jnp.dtype(f32) else None
    rows = lax.iota(jnp.int32, PB * ps)

    def tile(step, carry):
        m, l, acc = carry
        pid = bt_ref[r, jnp.minimum(step * PB + rows // ps, MP - 1)]
        k = k_ref[pid, rows % ps, hk, :].astype(dtype)  # [PB*ps, D]
        v = v_ref[pid, rows % ps, hk, :]
        kpos = step * PB * ps + rows
        old = kpos < seq_len
        v = jnp.where(old[:, None], v.astype(dtype), jnp.zeros((), dtype))  # never multiply a zero by garbage
        s = jnp.dot(q, k.T, preferred_element_type=f32, precision=precision) * (D**-0.5)  # [M, PB*ps]
        seen = old[None, :] & (kpos[None, :] <= qpos[:, None])
        s = jnp.where(seen, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - shift[:, None])
        corr = jnp.exp(jnp.where(m == -jnp.inf, -jnp.inf, m - shift))
        pv = jnp.dot(p.astype(dtype), v, preferred_element_type=f32, precision=precision)
        return m_new, l * corr + jnp.sum(p, axis=1), acc * corr[:, None] + pv

    last = jnp.minimum(seq_len, jnp.max(qpos) + 1)  # keys past the block's last query are never seen
    n_tiles = jnp.where(live, (last + PB * ps - 1) // (PB * ps), 0)
    init = (jnp.full((M,), -jnp.inf, f32), jnp.zeros((M,), f32), jnp.zeros((M, D), f32))
    _, l, acc = lax.fori_loop(0, n_tiles, tile, init)
    out = (acc / jnp.maximum(l, 1e-30)[:, None]).astype(o_ref.dtype)
    # the output has BQ rows past T, so the store's indices need no clipping: a masked store at clipped
    # duplicates could lose the real lane's value in interpret mode
    plt.store(o_ref.at[tok[:, None], head[:, None], d[None, :]], out, mask=in_row[:, None])


def ragged_paged_attention(q, k_pool, v_pool, q_positions, block_tables, seq_lens, query_start_loc, block_row,
                           block_start, interpret=None, num_warps: int = 4, pages_per_tile: int | None = None):
    """The kernel: q, pools, positions, tables as in the module docstring (the blocks give each token's
    row); query_start_loc [R+1];
    block_row, block_start [NB] from `query_blocks` (BQ = `block_queries`). Tokens outside every block
    (padding) come back as zeros."""
    T, Hq, D = q.shape
    P, ps, Hkv, _ = k_pool.shape
    G = Hq // Hkv
    BQ = block_queries(Hq, Hkv)
    PB = pages_per_tile or max(1, 16 // ps)  # a tile of at least 16 keys (Triton's smallest dot)
    NB = block_row.shape[0]
    i32 = lambda a: jnp.asarray(a).astype(jnp.int32)  # noqa: E731
    kernel = functools.partial(_kernel, BQ=BQ, G=G, PB=PB)
    # Tokens in no block (padding) keep the zeros of the aliased output: garbage there could reach a
    # later layer's state through a NaN times a zero gate.
    zeros = jnp.zeros((T + BQ, Hq, D), q.dtype)
    out = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(zeros.shape, q.dtype), grid=(NB, Hkv), input_output_aliases={9: 0},
        interpret=interpret_default(interpret), compiler_params=triton_params(num_warps),
    )(i32(block_row), i32(block_start), i32(query_start_loc), i32(seq_lens), i32(block_tables), i32(q_positions),
      q, k_pool, v_pool, zeros)
    return out[:T]


def kernel_supports(head_dim: int, page_size: int, num_heads: int, num_kv_heads: int) -> bool:
    """Triton tiles: head_dim a power of two >= 16, a page size that is a power of two, and the program's
    BQ x group matrix rows at least 16."""
    pow2 = lambda x: x > 0 and x & (x - 1) == 0  # noqa: E731
    G = num_heads // num_kv_heads
    return head_dim >= 16 and pow2(head_dim) and pow2(page_size) and block_queries(num_heads, num_kv_heads) * G >= 16
