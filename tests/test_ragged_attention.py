"""Ragged paged attention: the XLA reference against the model's dense attention row by row, the Pallas kernel
(interpret mode on CPU, compiled under -m gpu below) against the reference on random mixes of rows,
and the KV write kernel against XLA's scatter."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import gpu_test

from jaxgdn.model.attention import gqa_attention
from pallas_kernels.kv_write import write_kv_pallas
from pallas_kernels.ragged_attention import (
    block_queries,
    kernel_supports,
    num_query_blocks,
    query_blocks,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)


def ragged_case(seed=0, rows=((37, 1), (16, 20), (0, 40), (70, 3), (5, 1)), pad_tokens=7, pad_rows=2, Hq=4, Hkv=2,
                D=16, ps=16, MP=6, dtype=jnp.float32):
    """A step of rows (context before the step, new tokens): a decode row, a prompt chunk after 16 tokens, a
    fresh prompt, a verify window, another decode row; padding tokens and rows after them. Pools of noise with
    NaN in the null page and past each row's end (garbage must never leak in); the step's keys are written."""
    r = np.random.default_rng(seed)
    R = len(rows) + pad_rows
    n_new = np.array([n for _, n in rows])
    seq_lens = np.array([c + n for c, n in rows] + [0] * pad_rows, np.int32)
    T = int(n_new.sum()) + pad_tokens
    P = R * MP + 1
    k_pool, v_pool = (r.standard_normal((P, ps, Hkv, D)).astype(np.float32) for _ in range(2))
    perm = r.permutation(np.arange(1, P))
    block_tables = np.zeros((R, MP), np.int32)
    k_pool[0] = v_pool[0] = np.nan
    for i, s in enumerate(seq_lens[: len(rows)]):
        n = -(-s // ps)
        block_tables[i, :n] = perm[i * MP : i * MP + n]
        tail = s - (n - 1) * ps
        k_pool[block_tables[i, n - 1], tail:] = v_pool[block_tables[i, n - 1], tail:] = np.nan
    qsl = np.concatenate([[0], np.cumsum(n_new), np.full(pad_rows, n_new.sum())]).astype(np.int32)
    token_row = np.full(T, -1, np.int32)
    positions = np.zeros(T, np.int32)
    for i, (c, n) in enumerate(rows):
        token_row[qsl[i] : qsl[i + 1]] = i
        positions[qsl[i] : qsl[i + 1]] = c + np.arange(n)
    q = r.standard_normal((T, Hq, D)).astype(np.float32)
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    return (cast(q), cast(k_pool), cast(v_pool), i32(token_row), i32(positions), i32(block_tables), i32(seq_lens),
            i32(qsl), len(rows))


def dense_row(q, k_pool, v_pool, bt, qpos, seq_len):
    """Attention of one row's queries [n, Hq, D] over its gathered pages with the model's dense form."""
    MP = bt.shape[0]
    ps, Hkv, D = k_pool.shape[1:]
    k = k_pool[bt].reshape(MP * ps, Hkv, D)
    v = v_pool[bt].reshape(MP * ps, Hkv, D)
    k_pos = jnp.arange(MP * ps)
    valid = k_pos < seq_len
    k, v = (jnp.where(valid[:, None, None], x, 0) for x in (k, v))
    return gqa_attention(q[None], k[None], v[None], qpos[None], k_pos[None], valid[None])[0]


def test_reference_equals_dense_attention_row_by_row():
    q, k_pool, v_pool, token_row, pos, bt, seq, qsl, n_rows = ragged_case()
    out = np.asarray(ragged_paged_attention_reference(q, k_pool, v_pool, token_row, pos, bt, seq))
    for i in range(n_rows):
        t = slice(int(qsl[i]), int(qsl[i + 1]))
        want = dense_row(q[t], k_pool, v_pool, bt[i], pos[t], seq[i])
        np.testing.assert_allclose(out[t], np.asarray(want), atol=1e-5, err_msg=f"row {i}")
    assert np.all(out[int(qsl[n_rows]) :] == 0)  # padding tokens


def kernel_inputs(case, bq):
    q, k_pool, v_pool, token_row, pos, bt, seq, qsl, n_rows = case
    T, R = q.shape[0], bt.shape[0]
    rows, starts = query_blocks(np.asarray(qsl), n_rows, bq, num_query_blocks(T, R, bq))
    return q, k_pool, v_pool, pos, bt, seq, qsl, jnp.asarray(rows), jnp.asarray(starts)


@pytest.mark.parametrize("Hq, Hkv, dtype, ps, pad_tokens", [(4, 2, jnp.float32, 16, 7), (8, 2, jnp.bfloat16, 16, 7),
                                                             (4, 1, jnp.float32, 8, 0), (2, 2, jnp.float32, 32, 7)])
def test_kernel_equals_reference(Hq, Hkv, dtype, ps, pad_tokens):
    """Groups of 2, 4 and 1 query heads per KV head (query blocks of 32, 16, 64 tokens), pages of 8 to 32
    tokens, fp32 and bf16; rows that span several blocks, blocks that end inside a row or at the step's end."""
    case = ragged_case(seed=Hq + ps, Hq=Hq, Hkv=Hkv, ps=ps, dtype=dtype, MP=96 // ps, pad_tokens=pad_tokens)
    bq = block_queries(Hq, Hkv)
    ref = ragged_paged_attention_reference(*case[:7])
    out = ragged_paged_attention(*kernel_inputs(case, bq))
    assert out.shape == ref.shape and bool(jnp.isfinite(out).all())
    tol = 3e-2 if dtype == jnp.bfloat16 else 2e-5
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=tol, rtol=tol)


def test_query_blocks_cover_every_token_once():
    qsl = np.array([0, 1, 21, 61, 64, 65, 65, 65])
    rows, starts = query_blocks(qsl, 5, 16, num_query_blocks(72, 7, 16))
    used = rows >= 0
    covered = np.concatenate([np.arange(s, min(s + 16, qsl[r + 1])) for r, s in zip(rows[used], starts[used])])
    np.testing.assert_array_equal(np.sort(covered), np.arange(65))
    assert all(qsl[r] <= s < qsl[r + 1] for r, s in zip(rows[used], starts[used]))


def test_kernel_lowers_to_triton_without_a_gpu():
    """The 0.8B attention widths: 8 query heads on 2 KV heads of 256, bf16, pages of 16."""
    case = ragged_case(Hq=8, Hkv=2, D=256, dtype=jnp.bfloat16)
    assert kernel_supports(256, 16, 8, 2)
    args = kernel_inputs(case, block_queries(8, 2))
    fn = lambda *a: ragged_paged_attention(*a, interpret=False)  # noqa: E731
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text.lower()


def test_engine_with_the_attention_kernel_equals_plain_greedy(monkeypatch):
    """PD + MTP K=2 with attention_impl="pallas" (interpret mode): trunk and MTP attention run the ragged
    kernel over the pages in place, q/k/v come out of the prompt kernel (`prompt_qkv`); every request equals
    one-request greedy decoding."""
    from helpers import naive_greedy, small_config

    from jaxgdn.engine import forward
    from jaxgdn.engine.config import EngineConfig
    from jaxgdn.engine.request import SamplingParams
    from jaxgdn.engine.workers import decode_engine, prefill_engine, run_disaggregated
    from jaxgdn.model.params import init_random_params

    cfg = small_config(eos_token_ids=())
    params = init_random_params(cfg, seed=8)
    rng = np.random.default_rng(4)
    prompts = [[int(t) for t in rng.integers(0, cfg.vocab_size, n)] for n in (1, 3, 17, 40)]
    ecfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=96, kv_page_size=16,
                        dtype="float32", num_speculative_tokens=2, pd=True, attention_impl="pallas")
    calls = {"attention": 0, "qkv": 0}  # kernel calls while the steps trace
    for name, key in (("ragged_paged_attention", "attention"), ("prompt_qkv", "qkv")):
        fn = getattr(forward, name)
        monkeypatch.setattr(forward, name, lambda *a, fn=fn, key=key, **k: calls.update({key: calls[key] + 1})
                            or fn(*a, **k))
    forward._layer.clear_cache()
    P = prefill_engine(params, cfg, ecfg, garbage_seed=1)
    D = decode_engine(params, cfg, ecfg, garbage_seed=2)  # NaN-free garbage in the pools: must not leak in
    sp = SamplingParams(temperature=0, max_tokens=5)
    rids = run_disaggregated(P, D, prompts, [sp] * len(prompts))
    for r, p in zip(rids, prompts):
        assert D.output(r).token_ids == naive_greedy(params, cfg, p, 5)
    assert calls["attention"] > 0 and calls["qkv"] > 0


def kv_write_case(seed=0, P=9, ps=4, Hkv=2, D=16, N=7, dtype=jnp.float32):
    """Random pools; N tokens at distinct slots off the null page, two more padding tokens on null slot 0."""
    r = np.random.default_rng(seed)
    pools = [jnp.asarray(r.standard_normal((P, ps, Hkv, D)), dtype) for _ in range(2)]
    slots = np.concatenate([r.choice(np.arange(ps, P * ps), N, replace=False), [0, 0]]).astype(np.int32)
    k, v = (jnp.asarray(r.standard_normal((N + 2, Hkv, D)), dtype) for _ in range(2))
    return (*pools, jnp.asarray(slots), k, v)


def test_kv_write_kernel_equals_scatter():
    """Bit for bit off the null page; nothing else of the pools changes."""

    k_pool, v_pool, slots, k, v = kv_write_case()
    new_k, new_v = write_kv_pallas(k_pool, v_pool, slots, k, v)
    for pool, new, x in ((k_pool, new_k, k), (v_pool, new_v, v)):
        expect = pool.reshape(-1, *pool.shape[2:]).at[slots].set(x).reshape(pool.shape)
        np.testing.assert_array_equal(np.asarray(new)[1:], np.asarray(expect)[1:])
        assert not np.array_equal(np.asarray(new)[1:], np.asarray(pool)[1:])


def test_kv_write_kernel_lowers_to_triton_without_a_gpu():
    from pallas_kernels.kv_write import write_kernel_supports

    assert write_kernel_supports(2, 256) and not write_kernel_supports(3, 32)
    k_pool, v_pool, slots, k, v = kv_write_case(D=256, dtype=jnp.bfloat16)
    fn = lambda kp, vp, k, v: write_kv_pallas(kp, vp, slots, k, v, interpret=False)  # noqa: E731
    text = jax.jit(fn).trace(k_pool, v_pool, k, v).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text.lower()


@gpu_test
@pytest.mark.parametrize("Hq, Hkv, D, dtype, pad_tokens", [(8, 2, 256, "bfloat16", 7), (8, 2, 256, "bfloat16", 0),
                                                            (4, 2, 32, "float32", 7)])
def test_ragged_attention_kernel_compiled_equals_reference(Hq, Hkv, D, dtype, pad_tokens):
    """The ragged paged attention kernel compiled (the 0.8B widths first) against the XLA reference on a mix of
    a decode row, prompt chunks, a fresh prompt and a verify window."""
    case = ragged_case(seed=D, Hq=Hq, Hkv=Hkv, D=D, dtype=getattr(jnp, dtype), pad_tokens=pad_tokens,
                       rows=((37, 1), (16, 200), (0, 300), (70, 3), (5, 1)), MP=24)
    with jax.default_matmul_precision("highest"):
        ref = jax.jit(ragged_paged_attention_reference)(*case[:7]).astype(jnp.float32)
    out = jax.jit(ragged_paged_attention)(*kernel_inputs(case, block_queries(Hq, Hkv))).astype(jnp.float32)
    tol = 1e-4 if dtype == "float32" else 3e-2
    assert float(jnp.abs(out - ref).max()) <= tol * max(1.0, float(jnp.abs(ref).max()))


@gpu_test
def test_kv_write_kernel_compiled_equals_scatter():

    k_pool, v_pool, slots, k, v = kv_write_case(P=300, ps=16, D=256, N=128, dtype=jnp.bfloat16)
    expect = [pool.reshape(-1, 2, 256).at[slots].set(x).reshape(pool.shape) for pool, x in ((k_pool, k), (v_pool, v))]
    new = jax.jit(lambda kp, vp, k, v: write_kv_pallas(kp, vp, slots, k, v))(k_pool, v_pool, k, v)
    for got, want in zip(new, expect):
        np.testing.assert_array_equal(np.asarray(got, np.float32)[1:], np.asarray(want, np.float32)[1:])
