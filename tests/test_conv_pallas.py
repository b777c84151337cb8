"""The pooled causal-conv kernel (interpret mode on CPU, compiled under -m gpu below) against the
engine's XLA path: window read from the pool, conv + SiLU, new window written back."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import gpu_test

from jaxgdn.engine.pools import read_conv, write_conv
from jaxgdn.engine.state import GDNSlots
from jaxgdn.model.gdn import causal_conv_silu
from pallas_kernels.conv_pallas import causal_conv_pooled, causal_conv_prompt, conv_kernel_supports


def conv_checkpoint_inputs(window, mixed, spec_window: int):
    """Inputs 1 .. Kc-1+K of [window ‖ mixed] ([B, Kc-1+K, C], K = spec_window <= T-1): the conv window
    after accepting a tokens of a verify window is [a-1 : a-1+Kc-1] of it."""
    return jnp.concatenate([window[:, 1:].astype(mixed.dtype), mixed[:, : spec_window + 1]], axis=1)


def conv_case(seed=0, T=3, K=2, C=48, extra=8, Kc=4, dtype=jnp.float32):
    """Six rows: fresh, mid-window starts, verify rows (T = 1+K), non-verify rows with num_valid < T, and a
    padding row on the null slot 0. The input has `extra` channels past C (the fused projection's z, b, a)."""
    r = np.random.default_rng(seed)
    x = jnp.asarray(r.standard_normal((6, T, C + extra)), dtype)
    weight = jnp.asarray(r.standard_normal((C, 1, Kc)), dtype)
    pool = jnp.asarray(r.standard_normal((9, Kc - 1 + K, C)), dtype)
    row = lambda *v: jnp.array(v)  # noqa: E731
    slots = row(3, 7, 1, 5, 8, 0)
    start = row(0, min(1, K), K, 0, min(2, K), 0)
    fresh = row(True, False, False, False, True, False)
    verify = row(False, False, K > 0, K > 0, False, False)
    num_valid = row(T, max(T - 1, 1), T, T, 1, 0)
    return x, weight, pool, slots, start, fresh, verify, num_valid


def xla_conv_path(x, weight, pool, slots, start, fresh, verify, num_valid):
    """The engine's XLA path (pools.read_conv, gdn.causal_conv_silu, pools.write_conv)."""
    C, Kc = weight.shape[0], weight.shape[-1]
    K = pool.shape[1] - (Kc - 1)
    view = SimpleNamespace(idx_mapping=slots, fresh=fresh, verify_path=verify)
    gdn_slots = GDNSlots(conv=pool, ssm=None)
    window = read_conv(gdn_slots, view, start, Kc)
    u, new_window = causal_conv_silu(x[..., :C], window, weight, num_valid)
    return u, write_conv(gdn_slots, view, new_window, conv_checkpoint_inputs(window, x[..., :C], K) if K else None)


@pytest.mark.parametrize("T", [1, 2, 3, 70])
def test_xla_conv_equals_its_definition_over_the_concatenated_inputs(T):
    """causal_conv_silu never builds [window ‖ mixed] (zero-padded mixed plus the window's taps); against
    the definition that builds it: out[t] = silu(sum_j w_j full[t + j]), new window = full[n : n + Kc-1] per row of n real tokens
    (0, 1, T-1 and T), checkpoint inputs = full[1 : Kc + K]."""
    r = np.random.default_rng(T)
    B, C, Kc = 4, 6, 4
    mixed = jnp.asarray(r.standard_normal((B, T, C)), jnp.float32)
    window = jnp.asarray(r.standard_normal((B, Kc - 1, C)), jnp.float32)
    weight = jnp.asarray(r.standard_normal((C, 1, Kc)), jnp.float32)
    num_valid = jnp.asarray([0, 1, max(T - 1, 0), T], jnp.int32)
    full = np.concatenate([np.asarray(window), np.asarray(mixed)], axis=1)
    acc = sum(full[:, j : j + T] * np.asarray(weight)[:, 0, j] for j in range(Kc))
    u, new_window = jax.jit(causal_conv_silu)(mixed, window, weight, num_valid)
    np.testing.assert_allclose(np.asarray(u), acc / (1 + np.exp(-acc)), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(new_window), np.stack([full[b, n : n + Kc - 1]
                                                                    for b, n in enumerate(np.asarray(num_valid))]))
    K = min(T - 1, 3)
    np.testing.assert_array_equal(np.asarray(conv_checkpoint_inputs(window, mixed, K)), full[:, 1 : Kc + K])


@pytest.mark.parametrize("T, K", [(1, 0), (3, 2), (4, 3)])
def test_conv_kernel_equals_the_xla_path(T, K):
    """Outputs to fp32 rounding; the pool bit for bit (windows are copies of inputs) except the null slot,
    which padding rows may write anything to."""
    args = conv_case(seed=T + K, T=T, K=K)
    u_ref, pool_ref = xla_conv_path(*args)
    x, weight, pool, *rows = args
    u, new_pool = causal_conv_pooled(x, weight.shape[0], weight, pool, *rows)
    real = np.asarray(rows[-1]) > 0
    np.testing.assert_allclose(np.asarray(u)[real], np.asarray(u_ref)[real], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(new_pool)[1:], np.asarray(pool_ref)[1:])
    assert not np.array_equal(np.asarray(new_pool)[1:], np.asarray(pool)[1:])  # the case does write windows


def test_conv_kernel_lowers_to_triton_without_a_gpu():
    x, weight, pool, *rows = conv_case(T=4, K=3, C=6144, dtype=jnp.bfloat16)
    fn = lambda x, pool: causal_conv_pooled(x, 6144, weight, pool, *rows, interpret=False)  # noqa: E731
    text = jax.jit(fn).trace(x, pool).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text.lower()


def test_conv_kernel_supports_channel_tiles_only():
    assert conv_kernel_supports(6144) and conv_kernel_supports(48) and not conv_kernel_supports(40)


@pytest.mark.parametrize("T, block_t, dtype", [(4, 16, jnp.float32), (37, 16, jnp.float32), (64, 32, jnp.bfloat16)])
def test_prompt_conv_kernel_equals_the_xla_conv_split_into_q_k_v(T, block_t, dtype):
    """causal_conv_prompt against causal_conv_silu over a nonzero window, its outputs the channel ranges of
    q, k, v; T = 4 reads the window in every output (the first tile's path), 37 a partial last tile.
    The input carries extra channels past C (the fused projection's z, b, a), which must not be read."""
    r = np.random.default_rng(T)
    B, Kc, widths = 2, 4, (32, 32, 48)
    C = sum(widths)
    x = jnp.asarray(r.standard_normal((B, T, C + 16)), dtype)
    window = jnp.asarray(r.standard_normal((B, Kc - 1, C)), dtype)
    weight = jnp.asarray(r.standard_normal((C, 1, Kc)), dtype)
    u_ref, _ = causal_conv_silu(x[..., :C], window, weight)
    outs = causal_conv_prompt(x, widths, weight, window, block_t=block_t, block_c=16)
    assert [o.shape[-1] for o in outs] == list(widths) and all(o.dtype == dtype for o in outs)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(jnp.concatenate(outs, -1), np.float32), np.asarray(u_ref, np.float32),
                               rtol=tol, atol=tol)


def test_gdn_inputs_with_the_prompt_conv_kernel_equal_the_xla_conv():
    """impl "pallas" routes a long row's conv through the kernel (q, k, v, window, mixed all equal)."""
    from helpers import small_config

    from jaxgdn.model.config import LINEAR_ATTENTION
    from jaxgdn.model.gdn import gdn_inputs
    from jaxgdn.model.params import fuse_projections, init_random_params
    from pallas_kernels.gdn import use_prompt_conv_kernel

    cfg = small_config()
    params = init_random_params(cfg)
    i = cfg.layer_types.index(LINEAR_ATTENTION)
    p, p_fused = params.layers[i].mixer, fuse_projections(params).layers[i].mixer
    assert p_fused.fused is not None  # the kernel then reads q‖k‖v out of the whole fused product
    T = 40
    assert use_prompt_conv_kernel("pallas", T) and not use_prompt_conv_kernel("chunked", T)
    x = jax.random.normal(jax.random.PRNGKey(1), (2, T, cfg.hidden_size))
    window = jax.random.normal(jax.random.PRNGKey(2), (2, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim))
    num_valid = jnp.array([T, 25])
    want = gdn_inputs(p, cfg, x, window, num_valid, impl="chunked")
    for mixer in (p, p_fused):
        got = gdn_inputs(mixer, cfg, x, window, num_valid, impl="pallas")
        for name in ("q", "k", "v", "g", "beta", "z", "conv", "mixed"):
            np.testing.assert_allclose(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)),
                                       rtol=1e-5, atol=1e-5, err_msg=name)
        # z_source holds z in place: the whole fused product, or z itself
        B, T, Hv, dv = got.z.shape
        z_in_source = got.z_source[..., got.z_offset : got.z_offset + Hv * dv].reshape(got.z.shape)
        assert (mixer.fused is not None) == (got.z_source.shape[-1] > Hv * dv)
        np.testing.assert_array_equal(np.asarray(z_in_source), np.asarray(got.z))


def test_prompt_conv_kernel_lowers_to_triton_without_a_gpu():
    x = jnp.zeros((1, 64, 6144 + 2080), jnp.bfloat16)
    weight, window = jnp.zeros((6144, 1, 4), jnp.bfloat16), jnp.zeros((1, 3, 6144), jnp.bfloat16)
    fn = lambda x: causal_conv_prompt(x, (2048, 2048, 2048), weight, window, interpret=False)  # noqa: E731
    assert "triton" in jax.jit(fn).trace(x).lower(lowering_platforms=("cuda",)).as_text().lower()


@gpu_test
@pytest.mark.parametrize("T, K", [(1, 0), (4, 3)])
def test_conv_kernel_compiled_equals_the_xla_path(T, K):
    """The Triton-lowered conv kernel at the 0.8B width (C = 6144, bf16) against the engine's XLA path."""
    args = conv_case(seed=T, T=T, K=K, C=6144, dtype=jnp.bfloat16)
    u_ref, pool_ref = jax.jit(xla_conv_path)(*args)
    u, pool = jax.jit(lambda x, w, pool, *rows: causal_conv_pooled(x, w.shape[0], w, pool, *rows))(*args)
    real = np.asarray(args[-1]) > 0
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    np.testing.assert_allclose(f32(u)[real], f32(u_ref)[real], rtol=2e-2, atol=2e-2)
    np.testing.assert_array_equal(f32(pool)[1:], f32(pool_ref)[1:])


@gpu_test
@pytest.mark.parametrize("T", [300, 2048])
def test_prompt_conv_kernel_compiled_equals_the_xla_conv(T):
    """The Triton-lowered whole-prompt conv at the 0.8B widths (q, k, v of 2048 channels, bf16, read out
    of the fused projection's 8224) against gdn.causal_conv_silu; T = 300 ends on a partial tile."""
    r = np.random.default_rng(T)
    x = jnp.asarray(r.standard_normal((2, T, 8224)), jnp.bfloat16)
    window = jnp.asarray(r.standard_normal((2, 3, 6144)), jnp.bfloat16)
    weight = jnp.asarray(r.standard_normal((6144, 1, 4)) * 0.5, jnp.bfloat16)
    u_ref, _ = jax.jit(causal_conv_silu)(x[..., :6144], window, weight)
    outs = jax.jit(lambda x, w, win: causal_conv_prompt(x, (2048, 2048, 2048), w, win))(x, weight, window)
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    np.testing.assert_allclose(f32(jnp.concatenate(outs, -1)), f32(u_ref), rtol=2e-2, atol=2e-2)
