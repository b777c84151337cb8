"""Causal GQA attention over a paged KV pool: a Pallas flash-attention kernel and its reference.

    q            [R, Q, Hq, D]   this step's queries per row (padding cells anywhere)
    k_pool/v_pool [P, ps, Hkv, D] the pool; page 0 is the null page
    block_tables [R, MP] int32   page ids of each row's positions 0, ps, 2ps, ...
    q_positions  [R, Q] int32    absolute position of each query
    seq_lens     [R] int32       keys 0 .. seq_len-1 exist for the row
    -> out [R, Q, Hq, D] in q.dtype

Key s is visible to query t iff s <= q_positions[t] and s < seq_len. Query head h reads KV head
h // (Hq / Hkv). Softmax in fp32 (scores scaled by D^-1/2); probabilities cast to the value dtype
before P·V, as HF's eager attention does. A query that sees no key gets zeros.

The kernel reads only the pages a row has (ceil(seq_len / ps) of them) and, per block of queries, only
those up to the block's last query position (causal), one page per step of an online softmax, instead of
gathering max-pages-wide copies of K and V per row.

`write_kv_pallas` writes a step's K/V into the pools in place, one program per token. XLA's scatter
did the same but, in the 4-steps-per-launch decode program on the H200, some of its KV scatters cost as
much as copying the whole pool (~0.36 ms per call at batch 128; bench/results/decode-r6-conv).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .common import interpret_default, triton_params

f32 = jnp.float32


def paged_attention_reference(q, k_pool, v_pool, block_tables, q_positions, seq_lens):
    """Gather each row's pages into a contiguous view and run masked softmax attention (XLA)."""
    R, Q, Hq, D = q.shape
    P, ps, Hkv, _ = k_pool.shape
    MP = block_tables.shape[1]
    k = k_pool[block_tables].reshape(R, MP * ps, Hkv, D)
    v = v_pool[block_tables].reshape(R, MP * ps, Hkv, D)
    k_pos = jnp.arange(MP * ps)
    visible = (k_pos[None, None, :] <= q_positions[:, :, None]) & (k_pos[None, None, :] < seq_lens[:, None, None])
    qg = q.reshape(R, Q, Hkv, Hq // Hkv, D)
    scores = jnp.einsum("rtkgd,rskd->rkgts", qg, k, preferred_element_type=f32) * (D**-0.5)
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.exp(scores - jnp.where(jnp.isfinite(m), m, 0.0))
    probs = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
    # Unwritten pages may hold anything (even NaN); masked probabilities are exact zeros, so zero V there.
    v = jnp.where((k_pos[None, :] < seq_lens[:, None])[..., None, None], v, 0)
    out = jnp.einsum("rkgts,rskd->rtkgd", probs.astype(v.dtype), v, preferred_element_type=f32)
    return out.reshape(R, Q, Hq, D).astype(q.dtype)


def _kernel(bt_ref, seq_ref, qpos_ref, q_ref, k_ref, v_ref, o_ref, *, BQ, group, ps, scale):
    r, h, iq = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    hk = h // group
    rows = pl.ds(iq * BQ, BQ)
    q = q_ref[r, rows, h, :]  # [BQ, D]
    qpos = qpos_ref[r, rows]  # [BQ]
    seq_len = seq_ref[r]
    D = q.shape[-1]
    offs = lax.iota(jnp.int32, ps)

    def page(j, carry):
        m, l, acc = carry
        pid = bt_ref[r, j]
        k = k_ref[pid, :, hk, :].astype(q.dtype)  # [ps, D]; the pool may be stored in another dtype
        v = v_ref[pid, :, hk, :].astype(q.dtype)
        s = jnp.dot(q, k.T, preferred_element_type=f32, precision=lax.Precision.HIGHEST) * scale  # [BQ, ps]
        kpos = j * ps + offs
        visible = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] < seq_len)
        s = jnp.where(visible, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows that have seen nothing yet stay at zero
        p = jnp.exp(s - shift[:, None])
        corr = jnp.exp(jnp.where(m == -jnp.inf, -jnp.inf, m - shift))
        v = jnp.where((kpos < seq_len)[:, None], v, 0)  # never multiply a masked zero by garbage
        pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=f32, precision=lax.Precision.HIGHEST)
        return m_new, l * corr + jnp.sum(p, axis=1), acc * corr[:, None] + pv

    init = (jnp.full((BQ,), -jnp.inf, f32), jnp.zeros((BQ,), f32), jnp.zeros((BQ, D), f32))
    # Pages past the block's last query position hold only keys no query here may see (causal): a
    # prompt's query blocks read half its pages on average, not all of them. All-padding blocks read none.
    n_pages = jnp.minimum((seq_len + ps - 1) // ps, jnp.max(qpos) // ps + 1)
    _, l, acc = lax.fori_loop(0, n_pages, page, init)
    o_ref[r, rows, h, :] = (acc / jnp.maximum(l, 1e-30)[:, None]).astype(o_ref.dtype)


LONG_ROW_BLOCK_Q = 64  # queries per program for rows of >= 256 queries (prompts): one read of the pages per 64


def paged_attention_pallas(q, k_pool, v_pool, block_tables, q_positions, seq_lens, interpret=None,
                           block_q: int | None = None, num_warps: int | None = None):
    """The flash kernel: one program per (row, query head, block of block_q queries). Q is padded to a
    multiple of block_q; head_dim and page size must be powers of two >= 16 (Triton tiles).
    block_q None: 16 for short rows (decode, verification), LONG_ROW_BLOCK_Q for rows of >= 256 queries,
    where each program re-reads the row's pages and a 16-query block would read them Q/16 times per head;
    num_warps None: 8 for blocks over 16 queries (their [block_q, D] fp32 accumulator), else 4."""
    interpret = interpret_default(interpret)
    R, Q, Hq, D = q.shape
    P, ps, Hkv, _ = k_pool.shape
    if block_q is None:
        block_q = LONG_ROW_BLOCK_Q if Q >= 256 else 16
    if num_warps is None:
        num_warps = 8 if block_q > 16 else 4
    BQ = min(block_q, max(16, pl.next_power_of_2(Q)))
    pad = (-Q) % BQ
    if pad:
        q = jnp.pad(q, [(0, 0), (0, pad), (0, 0), (0, 0)])
        q_positions = jnp.pad(q_positions, [(0, 0), (0, pad)], constant_values=-1)  # sees no key
    kernel = functools.partial(_kernel, BQ=BQ, group=Hq // Hkv, ps=ps, scale=D**-0.5)
    out = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype), grid=(R, Hq, q.shape[1] // BQ),
        interpret=interpret, compiler_params=triton_params(num_warps, num_stages=2),
    )(block_tables.astype(jnp.int32), seq_lens.astype(jnp.int32), q_positions.astype(jnp.int32), q, k_pool, v_pool)
    return out[:, :Q]


def _write_kernel(slot_ref, k_ref, v_ref, _k_in, _v_in, k_pool_ref, v_pool_ref):
    n = pl.program_id(0)
    slot = slot_ref[n]
    k_pool_ref[slot, :] = k_ref[n, :].astype(k_pool_ref.dtype)
    v_pool_ref[slot, :] = v_ref[n, :].astype(v_pool_ref.dtype)


def write_kv_pallas(k_pool, v_pool, slots, k, v, interpret=None, num_warps: int = 2):
    """k_pool, v_pool [P, ps, Hkv, D]; slots [N] flat pool slots (page * ps + offset); k, v [N, Hkv, D].
    Returns the pools with token n's K/V at slots[n], written in place (the pools are aliased to the
    outputs). Tokens may share only the null page's slots (padding): what lands there is never read."""
    P, ps, Hkv, D = k_pool.shape
    assert write_kernel_supports(Hkv, D), (Hkv, D)
    flat = lambda x: x.reshape(-1, Hkv * D)  # noqa: E731
    pool_shape = jax.ShapeDtypeStruct((P * ps, Hkv * D), k_pool.dtype)
    k_new, v_new = pl.pallas_call(
        _write_kernel, out_shape=(pool_shape, pool_shape), grid=(slots.shape[0],), input_output_aliases={3: 0, 4: 1},
        interpret=interpret_default(interpret),
        compiler_params=triton_params(num_warps),
    )(slots.astype(jnp.int32), flat(k), flat(v), flat(k_pool), flat(v_pool))
    return k_new.reshape(k_pool.shape), v_new.reshape(v_pool.shape)


def write_kernel_supports(num_kv_heads: int, head_dim: int) -> bool:
    """A token's K (Hkv * D values) must be one Triton tile: a power of two >= 16."""
    n = num_kv_heads * head_dim
    return n >= 16 and n == pl.next_power_of_2(n)


def kernel_supports(head_dim: int, page_size: int) -> bool:
    return all(x >= 16 and x == pl.next_power_of_2(x) for x in (head_dim, page_size))
