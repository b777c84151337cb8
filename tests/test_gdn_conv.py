"""The GDN conv (`pallas_kernels/gdn_conv.py`): the pooled kernel (interpret mode on CPU, compiled under -m gpu
below) against the engine's XLA path: window read from the pool, conv + SiLU, new window written back. The
ragged XLA form: tests/test_gdn_ragged.py."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import gpu_test

from jaxgdn.engine.pools import read_conv, write_conv
from jaxgdn.engine.state import GDNSlots
from jaxgdn.model.gdn import causal_conv_silu
from pallas_kernels.gdn_conv import causal_conv_pooled, conv_kernel_supports


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
