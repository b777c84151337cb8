"""The one-kernel GDN mixer (`pallas_kernels/gdn_decode.py`, interpret mode on CPU, compiled under -m gpu
below) against the unfused chain it replaces in `forward.gdn_rows_pooled`: projection split, gates,
the pooled conv kernel, the pooled recurrence kernel and the gated norm."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import gpu_test, small_config

from jaxgdn.engine.state import GDNSlots
from jaxgdn.engine.forward import RowView, gdn_rows_pooled, use_mixer_kernel
from jaxgdn.model.norms import DeferredNorm, inverse_rms
from jaxgdn.model.params import init_random_params, serving_layout
from jaxgdn.model.policy import KernelPolicy
from pallas_kernels.gdn_decode import gdn_mixer_pooled, mixer_kernel_supports


def mixer_case(T, K, dtype, seed=0, Hk=2, Hv=4, dk=16, dv=32):
    """A GDN layer in the serving layout, six rows (fresh, mid-window starts, verify rows, rows with
    num_valid < T, a padding row on the null slot 0) and pools full of random values."""
    cfg = small_config(linear_num_key_heads=Hk, linear_num_value_heads=Hv, linear_key_head_dim=dk,
                       linear_value_head_dim=dv)
    params = serving_layout(init_random_params(cfg, seed=seed, dtype=dtype), True)
    p = params.layers[0].mixer
    r = np.random.default_rng(seed)
    B, S, Kc = 6, 9, cfg.linear_conv_kernel_dim
    x = jnp.asarray(r.standard_normal((B, T, cfg.hidden_size)), dtype)
    conv = jnp.asarray(r.standard_normal((S, Kc - 1 + K, cfg.conv_dim)), dtype)
    ssm = jnp.asarray(0.3 * r.standard_normal((S, 1 + K, Hv, dk, dv)), jnp.float32)
    row = lambda *v: jnp.array(v, jnp.int32)  # noqa: E731
    num_valid = row(T, max(T - 1, 1), T, T, 1, 0)
    token_index = jnp.where(jnp.arange(T)[None, :] < num_valid[:, None], 0, -1)
    view = RowView(token_index=token_index, positions=None, kv_slots=None, block_tables=None, seq_lens=None,
                   idx_mapping=row(3, 7, 1, 5, 8, 0), fresh=row(1, 0, 0, 0, 1, 0) > 0,
                   verify_path=row(0, 0, K > 0, K > 0, 0, 0) > 0)
    num_accepted = jnp.ones((S,), jnp.int32).at[7].set(min(2, K + 1)).at[1].set(K + 1).at[5].set(1)
    return cfg, p, x, view, GDNSlots(conv=conv, ssm=ssm), num_accepted


def run_rows(mixer: bool, cfg, p, h, view, slots, num_accepted):
    """The pool path's rows on the one mixer kernel (fused_decode on) or on the unfused chain."""
    policy = KernelPolicy(gdn_kernels=True, fused_decode=mixer)
    assert use_mixer_kernel(p, cfg, h.shape[0], policy) == mixer
    fn = jax.jit(lambda h, slots: gdn_rows_pooled(p, cfg, h, view, slots, num_accepted, policy))
    return fn(h, slots)


def assert_same_rows(got, want, view, atol):
    """Outputs of real rows close, the pools close everywhere but the null slot 0 (padding rows' scratch)."""
    (out, slots), (out_ref, slots_ref) = got, want
    real = np.asarray(view.num_valid) > 0
    np.testing.assert_allclose(np.asarray(out, np.float32)[real], np.asarray(out_ref, np.float32)[real], atol=atol,
                               rtol=atol)
    np.testing.assert_allclose(np.asarray(slots.ssm)[1:], np.asarray(slots_ref.ssm)[1:], atol=atol, rtol=atol)
    np.testing.assert_array_equal(np.asarray(slots.conv, np.float32)[1:], np.asarray(slots_ref.conv, np.float32)[1:])


@pytest.mark.parametrize("T, K, dtype", [(1, 0, jnp.float32), (3, 2, jnp.float32), (4, 3, jnp.bfloat16),
                                         (2, 1, jnp.bfloat16)])
def test_mixer_kernel_equals_the_unfused_chain(T, K, dtype):
    """Decode (K = 0) and verify windows, a key head shared by two value heads, fp32 and bf16 activations
    from a plain (pre-normed) input; the conv windows bit for bit (copies of inputs)."""
    cfg, p, x, view, slots, num_accepted = mixer_case(T, K, dtype, seed=T + K)
    want = run_rows(False, cfg, p, x, view, slots, num_accepted)
    got = run_rows(True, cfg, p, x, view, slots, num_accepted)
    assert not np.array_equal(np.asarray(got[1].ssm), np.asarray(slots.ssm))  # the case does write states
    assert_same_rows(got, want, view, 2e-2 if dtype == jnp.bfloat16 else 2e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_mixer_kernel_applies_the_folded_norms_row_scale(dtype):
    """With a post-scaled DeferredNorm input (the kernel gets the fp32 product and the 1/rms) the kernel equals
    the unfused chain, which scales and rounds the product first."""
    cfg, p, x, view, slots, num_accepted = mixer_case(2, 1, dtype, seed=11)
    h = DeferredNorm(x, inverse_rms(x, cfg.rms_norm_eps), post_scale=True)
    want = run_rows(False, cfg, p, h, view, slots, num_accepted)
    got = run_rows(True, cfg, p, h, view, slots, num_accepted)
    assert_same_rows(got, want, view, 2e-2 if dtype == jnp.bfloat16 else 2e-5)


def test_mixer_kernel_runs_where_its_tiles_and_weights_allow():
    cfg, p, *_ = mixer_case(1, 0, jnp.float32)
    policy = KernelPolicy(gdn_kernels=True)
    lo, hi = policy.mixer_rows
    assert use_mixer_kernel(p, cfg, lo, policy) and use_mixer_kernel(p, cfg, hi, policy)
    assert not use_mixer_kernel(p, cfg, hi + 1, policy)  # larger steps: the chain's kernels
    assert not use_mixer_kernel(p, cfg, lo - 1, policy)  # smaller steps: the chain's kernels too
    assert not use_mixer_kernel(dataclasses.replace(p, fused=None), cfg, lo, policy)  # b and a in the product
    assert not use_mixer_kernel(p, cfg, lo, policy.replace(fused_decode=False))  # switched off
    assert mixer_kernel_supports(128, 128) and not mixer_kernel_supports(24, 32)
    assert not mixer_kernel_supports(128, 256)  # the whole state tile lives in one program's registers


def test_mixer_kernel_lowers_to_triton_without_a_gpu():
    """The 0.8B layer's widths (Hk = Hv = 16, dk = dv = 128), a post-scaled bf16 product, a verify window."""
    Hk, dk, T, K, Kc = 16, 128, 3, 2, 4
    C = 3 * Hk * dk
    bf = jnp.bfloat16
    y = jnp.zeros((1, T, C + Hk * dk + 2 * Hk), jnp.float32)
    rows = [jnp.array([v]) for v in (2, 0, 0, 1, T)]
    fn = lambda y, scale, conv, ssm: gdn_mixer_pooled(  # noqa: E731
        y, scale, jnp.zeros((C, 1, Kc), bf), jnp.zeros(Hk), jnp.zeros(Hk, bf), jnp.ones(dk), 1e-6, conv, ssm, *rows,
        dtype=bf, interpret=False)
    args = (y, jnp.ones((1, T, 1)), jnp.zeros((3, Kc - 1 + K, C), bf), jnp.zeros((3, 1 + K, Hk, dk, dk)))
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text.lower()


@gpu_test
@pytest.mark.parametrize("T, K, dtype", [(1, 0, "bfloat16"), (3, 2, "bfloat16"), (4, 3, "float32")])
def test_gdn_mixer_kernel_compiled_at_the_0_8b_widths_equals_the_unfused_chain(T, K, dtype):
    """The one-kernel GDN mixer compiled at the 0.8B layer's head widths (Hk = Hv = 16, dk = dv = 128: one
    whole state tile per program) against the compiled unfused chain; the tests above run the smaller
    cases (and, interpreted, on CPU)."""
    dt = jnp.dtype(dtype)
    case = mixer_case(T, K, dt, seed=T, Hk=16, Hv=16, dk=128, dv=128)
    want = run_rows(False, *case)
    got = run_rows(True, *case)
    assert_same_rows(got, want, case[3], 2e-2 if dt == jnp.bfloat16 else 1e-4)
