"""The GDN recurrence's XLA forms: chunked form == token-by-token scan, state passing, overflow safety."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gdn_reference import gdn_chunked_reference, gdn_recurrent_reference


def random_inputs(B=2, T=65, Hk=2, Hv=4, dk=16, dv=24, seed=0, decay=(0.0, 2.0)):
    r = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(r.standard_normal(s), jnp.float32)  # noqa: E731
    g = -jnp.asarray(r.uniform(*decay, (B, T, Hv)), jnp.float32)
    beta = jnp.asarray(r.uniform(0, 1, (B, T, Hv)), jnp.float32)
    return f(B, T, Hk, dk), f(B, T, Hk, dk), f(B, T, Hv, dv), g, beta, f(B, Hv, dk, dv)


@pytest.mark.parametrize("T", [1, 2, 5, 63, 64, 65, 130, 200])
def test_chunked_equals_scan(T):
    q, k, v, g, beta, s0 = random_inputs(T=T, seed=T)
    o_ref, s_ref = gdn_recurrent_reference(q, k, v, g, beta, s0)
    o, s = gdn_chunked_reference(q, k, v, g, beta, s0)
    assert o.shape == (2, T, 4, 24) and s.shape == (2, 4, 16, 24)
    assert float(jnp.abs(o - o_ref).max()) <= 1e-5
    assert float(jnp.abs(s - s_ref).max()) <= 1e-5


@pytest.mark.parametrize("chunk_size", [4, 16, 64])
def test_chunk_size_does_not_change_result(chunk_size):
    q, k, v, g, beta, s0 = random_inputs(T=37, Hk=4, Hv=4, dk=32, dv=32)
    o_ref, s_ref = gdn_recurrent_reference(q, k, v, g, beta, s0)
    o, s = gdn_chunked_reference(q, k, v, g, beta, s0, chunk_size=chunk_size)
    assert float(jnp.abs(o - o_ref).max()) <= 1e-5 and float(jnp.abs(s - s_ref).max()) <= 1e-5


def test_zero_initial_state_is_default():
    q, k, v, g, beta, _ = random_inputs(T=9)
    zero = jnp.zeros((2, 4, 16, 24), jnp.float32)
    for fn in (gdn_chunked_reference, gdn_recurrent_reference):
        a, sa = fn(q, k, v, g, beta, None)
        b, sb = fn(q, k, v, g, beta, zero)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(sa), np.asarray(sb))


def test_state_passing_splits_a_sequence():
    """Running [0, 70) then [70, 130) from the carried state equals one run over [0, 130)."""
    q, k, v, g, beta, s0 = random_inputs(T=130)
    o_all, s_all = gdn_chunked_reference(q, k, v, g, beta, s0)
    cut = lambda x, a, b: x[:, a:b]  # noqa: E731
    o1, s1 = gdn_chunked_reference(*(cut(x, 0, 70) for x in (q, k, v, g, beta)), s0)
    o2, s2 = gdn_chunked_reference(*(cut(x, 70, 130) for x in (q, k, v, g, beta)), s1)
    assert float(jnp.abs(jnp.concatenate([o1, o2], 1) - o_all).max()) <= 1e-5
    assert float(jnp.abs(s2 - s_all).max()) <= 1e-5


def test_strong_decay_stays_finite_and_exact():
    """|g| up to 30 per step: cumulative decay of -1e3 in a chunk must not overflow (mask before exp)."""
    q, k, v, g, beta, s0 = random_inputs(T=128, decay=(5.0, 30.0))
    o, s = gdn_chunked_reference(q, k, v, g, beta, s0)
    o_ref, s_ref = gdn_recurrent_reference(q, k, v, g, beta, s0)
    assert bool(jnp.isfinite(o).all()) and bool(jnp.isfinite(s).all())
    assert float(jnp.abs(o - o_ref).max()) <= 1e-5


def test_value_head_sharing_is_repeat_interleave():
    """Hv = 2·Hk: value head j reads key head j // 2, i.e. the same as explicitly repeated q/k."""
    q, k, v, g, beta, s0 = random_inputs(T=20)
    o, s = gdn_recurrent_reference(q, k, v, g, beta, s0)
    rep = lambda x: jnp.repeat(x, 2, axis=2)  # noqa: E731
    o2, s2 = gdn_recurrent_reference(rep(q), rep(k), v, g, beta, s0)
    np.testing.assert_allclose(np.asarray(o), np.asarray(o2), atol=1e-6)
    tiled = lambda x: jnp.tile(x, (1, 1, 2, 1))  # noqa: E731  the GGUF order, which must differ
    o3, _ = gdn_recurrent_reference(tiled(q), tiled(k), v, g, beta, s0)
    assert float(jnp.abs(o3 - o).max()) > 1e-2
