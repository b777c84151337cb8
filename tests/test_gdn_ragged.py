"""The GDN layer's ragged forms: the conv and the recurrence references against per-row dense computations
(`jaxgdn.model.gdn.causal_conv_silu`, `gdn_recurrent_reference`), and the Pallas kernels (interpret mode on CPU, compiled
under -m gpu below) against the references on random mixes of short and long rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import gpu_test

from jaxgdn.model.gdn import causal_conv_silu
from pallas_kernels.gdn_common import SHORT_ROW
from pallas_kernels.gdn_conv import ragged_causal_conv
from pallas_kernels.gdn_ragged_chunked import chunk_tables, gdn_ragged_chunked
from pallas_kernels.gdn_reference import gdn_ragged_reference, gdn_recurrent_checkpoints

LENGTHS = (1, 3, 20, 4, 70, 1, 16, 17, 130)  # decode, verify windows, short and long prompt chunks


def ragged_rows(lengths, pad_tokens=5, pad_rows=2):
    """(query_start_loc [R+1], token_row [T]) of rows of these lengths, padding tokens and rows after them."""
    n = np.array(lengths)
    qsl = np.concatenate([[0], np.cumsum(n), np.full(pad_rows, n.sum())]).astype(np.int32)
    T = int(n.sum()) + pad_tokens
    token_row = np.full(T, -1, np.int32)
    token_row[: n.sum()] = np.repeat(np.arange(len(n)), n)
    return jnp.asarray(qsl), jnp.asarray(token_row)


def test_ragged_conv_equals_the_dense_conv_row_by_row():
    """Each row convolves over [its window ‖ its tokens] alone; the windows after the row and the verify
    buffers (inputs 1 .. Kc-2+W) are the row's, whatever its neighbours."""
    r = np.random.default_rng(0)
    C, Kc, W = 8, 4, 3
    qsl, token_row = ragged_rows(LENGTHS)
    T, R = token_row.shape[0], qsl.shape[0] - 1
    x = jnp.asarray(r.standard_normal((T, C + 5)), jnp.float32)  # extra channels are never read
    windows = jnp.asarray(r.standard_normal((R, Kc - 1, C)), jnp.float32)
    weight = jnp.asarray(r.standard_normal((C, 1, Kc)), jnp.float32)
    out, after, buffers = jax.jit(ragged_causal_conv, static_argnums=5)(x, weight, windows, token_row, qsl, W)
    for i, n in enumerate(LENGTHS):
        t = slice(int(qsl[i]), int(qsl[i + 1]))
        want, want_after = causal_conv_silu(x[None, t, :C], windows[i : i + 1], weight)
        np.testing.assert_allclose(np.asarray(out[t]), np.asarray(want[0]), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(after[i]), np.asarray(want_after[0]))
        full = np.concatenate([np.asarray(windows[i]), np.asarray(x[t, :C])])
        m = min(Kc - 2 + W, len(full) - 1)
        np.testing.assert_array_equal(np.asarray(buffers[i, :m]), full[1 : 1 + m])
    assert np.all(np.asarray(out[int(qsl[len(LENGTHS)]) :]) == 0)


def gdn_case(seed, lengths, Hk=2, Hv=4, dk=16, dv=32, W=3, S=16, dtype=jnp.float32, pad_tokens=5, decay=0.3):
    """A ragged step of rows of these lengths (fresh rows, verify windows, padding) over a random state pool;
    decay scales the log decays |g|."""
    r = np.random.default_rng(seed)
    qsl, token_row = ragged_rows(lengths, pad_tokens)
    T, R = token_row.shape[0], qsl.shape[0] - 1
    valid = (np.asarray(token_row) >= 0)[:, None]
    q = jnp.asarray(r.standard_normal((T, Hk, dk)), dtype)
    k = jnp.asarray(r.standard_normal((T, Hk, dk)), dtype)
    v = jnp.asarray(r.standard_normal((T, Hv, dv)), dtype)
    g = jnp.asarray(np.where(valid, -np.abs(r.standard_normal((T, Hv))) * decay, 0), jnp.float32)
    beta = jnp.asarray(np.where(valid, r.uniform(0.1, 0.9, (T, Hv)), 0), jnp.float32)
    pool = jnp.asarray(0.3 * r.standard_normal((S, W, Hv, dk, dv)), jnp.float32)
    n_real = len(lengths)
    slots = np.zeros(R, np.int32)
    slots[:n_real] = r.permutation(np.arange(1, S))[:n_real]  # padding rows on the null slot 0
    start = np.where(np.arange(R) < n_real, r.integers(0, W, R), 0).astype(np.int32)
    n = np.diff(np.asarray(qsl))
    fresh = (np.arange(R) % 3 == 0) & (np.arange(R) < n_real)
    verify = (n > 1) & (n <= W) & ~fresh  # verify windows of up to W tokens
    return q, k, v, g, beta, pool, qsl, token_row, *(jnp.asarray(a) for a in (slots, start, fresh, verify))


def expected_pool(pool, o_states, slots, verify):
    """The pool after the step: verify rows' checkpoints 0..W-1, other rows' final state at checkpoint 0."""
    final, checkpoints = o_states
    want = np.array(pool)
    for b, slot in enumerate(np.asarray(slots)):
        if slot == 0:
            continue
        if verify[b]:
            want[slot] = np.asarray(checkpoints[b])
        else:
            want[slot, 0] = np.asarray(final[b])
    return want


def test_ragged_recurrence_equals_the_dense_recurrence_row_by_row():
    q, k, v, g, beta, pool, qsl, token_row, slots, start, fresh, verify = gdn_case(1, LENGTHS)
    W = pool.shape[1]
    init = jnp.where(fresh[:, None, None, None], 0, pool[slots, start])
    o, final, checkpoints = jax.jit(gdn_ragged_reference, static_argnums=8)(q, k, v, g, beta, token_row, qsl, init, W)
    for i, n in enumerate(LENGTHS):
        t = slice(int(qsl[i]), int(qsl[i + 1]))
        want_o, want_final, states = gdn_recurrent_checkpoints(q[None, t], k[None, t], v[None, t], g[None, t],
                                                               beta[None, t], init[i : i + 1])
        np.testing.assert_allclose(np.asarray(o[t]), np.asarray(want_o[0]), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(np.asarray(final[i]), np.asarray(want_final[0]), rtol=1e-4, atol=1e-5)
        for c in range(W):  # the state after token c, or the final state past the row's end
            want = states[0, c] if c < n else want_final[0]
            np.testing.assert_allclose(np.asarray(checkpoints[i, c]), np.asarray(want), rtol=1e-4, atol=1e-5)
    assert np.all(np.asarray(o[int(qsl[len(LENGTHS)]) :]) == 0)


@pytest.mark.parametrize("lengths, dtype, pad_tokens, decay", [
    (LENGTHS, jnp.float32, 5, 0.3), ((2, 1, 1, 3), jnp.float32, 5, 0.3), ((40, 1, 64, 65), jnp.bfloat16, 5, 0.3),
    ((200,), jnp.float32, 5, 0.3), ((1, 4, 8, 19), jnp.float32, 0, 0.3), ((128, 3), jnp.float32, 0, 20.0)])
def test_kernels_equal_the_reference(lengths, dtype, pad_tokens, decay):
    """Short rows (token loop, verify checkpoints) and long rows (chunks of 64 that never cross a row,
    partial last chunks, one ending at the step's last token) in one step; fp32 and bf16 inputs; the pool
    written in place, the null slot aside. Strong decay (|g| ~ 20 a token) stays finite: the chunk's decays
    are masked before exp."""
    q, k, v, g, beta, pool, qsl, token_row, slots, start, fresh, verify = gdn_case(
        len(lengths), lengths, dtype=dtype, pad_tokens=pad_tokens, decay=decay)
    W = pool.shape[1]
    init = jnp.where(fresh[:, None, None, None], 0, pool[slots, start])
    o_ref, final, checkpoints = gdn_ragged_reference(q, k, v, g, beta, token_row, qsl, init, W)
    o, new_pool = jax.jit(gdn_ragged_chunked)(q, k, v, g, beta, pool, qsl, slots, start, fresh, verify)
    tol = 2e-2 if dtype == jnp.bfloat16 else 2e-4
    assert bool(jnp.isfinite(o).all())
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), rtol=tol, atol=tol)
    want = expected_pool(pool, (final, checkpoints), slots, np.asarray(verify))
    np.testing.assert_allclose(np.asarray(new_pool)[1:], want[1:], rtol=tol, atol=tol)


def test_chunk_tables_cover_the_long_rows_in_order():
    lengths = (1, 20, 16, 17, 130, 3, 64)
    qsl, _ = ragged_rows(lengths)
    T = int(qsl[-1]) + 5
    start, length, long_row, first, num_chunks = (np.asarray(a) for a in chunk_tables(qsl, T))
    long = [i for i, n in enumerate(lengths) if n > SHORT_ROW]
    assert list(long_row[: len(long)]) == long and np.all(long_row[len(long) :] == -1)
    for i in long:
        c = slice(first[i], first[i] + num_chunks[i])
        covered = np.concatenate([np.arange(s, s + n) for s, n in zip(start[c], length[c])])
        np.testing.assert_array_equal(covered, np.arange(qsl[i], qsl[i + 1]))
    assert length.sum() == sum(lengths[i] for i in long)


def test_kernels_lower_to_triton_without_a_gpu():
    """The 0.8B widths (Hk = Hv = 16, dk = dv = 128), bf16 inputs, a step of 256 tokens in 16 rows."""
    T, R, H, d = 256, 16, 16, 128
    bf = jnp.bfloat16
    q = k = jnp.zeros((T, H, d), bf)
    gates = jnp.zeros((T, H), jnp.float32)
    ints = jnp.zeros((R,), jnp.int32)
    fn = lambda q, k, v, pool: gdn_ragged_chunked(q, k, v, gates, gates, pool, jnp.zeros((R + 1,), jnp.int32),  # noqa: E731
                                                 ints, ints, ints, ints, interpret=False)
    text = jax.jit(fn).trace(q, k, q, jnp.zeros((4, 2, H, d, d))).lower(lowering_platforms=("cuda",)).as_text()
    assert text.lower().count("triton") >= 4


@gpu_test
@pytest.mark.parametrize("lengths, dtype", [((1, 3, 20, 4, 70, 1, 16, 17, 130), "float32"),
                                            ((1, 4, 300, 2048, 1, 3), "bfloat16")])
def test_ragged_gdn_kernels_compiled_equal_the_reference(lengths, dtype):
    """The ragged GDN kernels compiled at the 0.8B head widths (Hk = Hv = 16, dk = dv = 128): short rows on the
    token loop, long rows on the chunked form, the pool written in place."""
    q, k, v, g, beta, pool, qsl, token_row, slots, start, fresh, verify = gdn_case(
        len(lengths), lengths, Hk=16, Hv=16, dk=128, dv=128, dtype=getattr(jnp, dtype), pad_tokens=0)
    W = pool.shape[1]
    init = jnp.where(fresh[:, None, None, None], 0, pool[slots, start])
    with jax.default_matmul_precision("highest"):
        o_ref, final, checkpoints = jax.jit(gdn_ragged_reference, static_argnums=8)(
            *(x.astype(jnp.float32) for x in (q, k, v)), g, beta, token_row, qsl, init, W)
    o, new_pool = jax.jit(gdn_ragged_chunked)(q, k, v, g, beta, pool, qsl, slots, start, fresh, verify)
    err = lambda a, b: float(jnp.abs(a - b).max() / max(1.0, float(jnp.abs(b).max())))  # noqa: E731
    tol = 1e-4 if dtype == "float32" else 3e-2
    assert err(o, o_ref) <= tol
    want = expected_pool(pool, (final, checkpoints), slots, np.asarray(verify))
    assert err(new_pool[1:], jnp.asarray(want[1:])) <= tol
