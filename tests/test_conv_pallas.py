"""The pooled causal-conv kernel (interpret mode on CPU, compiled under -m gpu in test_gpu.py) against the
engine's XLA path: window read from the pool, conv + SiLU, new window written back."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgdn.cache import GDNSlots
from jaxgdn.gdn import causal_conv_silu
from jaxgdn.paged_forward import _read_conv, _write_conv
from pallas_kernels.conv_pallas import causal_conv_pooled, conv_kernel_supports


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
    """The engine's XLA path (paged_forward._read_conv, gdn.causal_conv_silu, paged_forward._write_conv)."""
    C, Kc = weight.shape[0], weight.shape[-1]
    K = pool.shape[1] - (Kc - 1)
    view = SimpleNamespace(idx_mapping=slots, fresh=fresh, verify_path=verify)
    gdn_slots = GDNSlots(conv=pool, ssm=None)
    window = _read_conv(gdn_slots, view, start, Kc)
    u, new_window, full = causal_conv_silu(x[..., :C], window, weight, num_valid)
    return u, _write_conv(gdn_slots, view, new_window, full[:, 1 : Kc + K] if K else None)


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
