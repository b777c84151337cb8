"""Writes of the paged KV pools and reads and writes of the GDN slot pool by a step's tokens and rows, in XLA.

`rows` is any step metadata with idx_mapping [R] (slot of each row; 0 = the null slot of padding rows),
fresh [R] (the row starts from zeros) and verify_path [R] (the row writes one checkpoint per window
position). A slot holds 1+K recurrent-state checkpoints and a conv buffer of Kc-1+K inputs; the committed
state is checkpoint num_accepted-1 and the conv window at that offset.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.kv_write import write_kernel_supports, write_kv_pallas

from .state import GDNSlots, PagedKV


def write_kv(kv: PagedKV, slots, k, v, kernel: bool):
    """Write k, v [N, Hkv, D] at flat pool slots [N]: with kernel, the Pallas kernel (in place) where a token's
    K is one Triton tile; XLA's scatter otherwise. Returns the two pools."""
    P, ps, Hkv, D = kv.k.shape
    if kernel and write_kernel_supports(Hkv, D):
        return write_kv_pallas(kv.k, kv.v, slots, k, v)
    scatter = lambda pool, x: pool.reshape(P * ps, Hkv, D).at[slots].set(x.astype(pool.dtype)).reshape(pool.shape)  # noqa: E731
    return scatter(kv.k, k), scatter(kv.v, v)


def read_conv(slots: GDNSlots, rows, offset, kc: int):
    """[R, Kc-1, C]: each row's conv window at checkpoint offset [R]; zeros for fresh rows."""
    conv = jax.vmap(lambda c, o: jax.lax.dynamic_slice_in_dim(c, o, kc - 1, axis=0))(slots.conv[rows.idx_mapping], offset)
    return jnp.where(rows.fresh[:, None, None], 0, conv)


def write_conv(slots: GDNSlots, rows, window, verify_buffer):
    """Non-verify rows write their new window [R, Kc-1, C] at offset 0; verify rows the whole Kc-1+K buffer."""
    idx = rows.idx_mapping
    kc1 = window.shape[1]
    if verify_buffer is None and kc1 == slots.conv.shape[1]:  # no spec window (K = 0): one scatter
        return slots.conv.at[idx].set(window.astype(slots.conv.dtype))
    conv = slots.conv[idx].at[:, :kc1].set(window.astype(slots.conv.dtype))
    if verify_buffer is not None:
        conv = jnp.where(rows.verify_path[:, None, None], verify_buffer.astype(slots.conv.dtype), conv)
    return slots.conv.at[idx].set(conv)


def read_ssm(slots: GDNSlots, rows, offset):
    """[R, Hv, dk, dv]: each row's recurrent state at checkpoint offset [R]; zeros for fresh rows, so whatever
    a slot held before admission never leaks in."""
    ssm = jax.vmap(lambda s, o: s[o])(slots.ssm[rows.idx_mapping], offset)
    return jnp.where(rows.fresh[:, None, None, None], 0, ssm)


def write_ssm(slots: GDNSlots, rows, final, checkpoints):
    """The pool's states after the step: prefill and decode rows commit their final state [R, Hv, dk, dv] to
    checkpoint 0; verify rows write every checkpoint [R, 1+K, Hv, dk, dv] (the state after each window
    position; None without spec windows), and the next step selects with num_accepted."""
    idx = rows.idx_mapping
    new = slots.ssm[idx].at[:, 0].set(final.astype(slots.ssm.dtype))
    if checkpoints is not None:
        new = jnp.where(rows.verify_path[:, None, None, None, None], checkpoints.astype(slots.ssm.dtype), new)
    return slots.ssm.at[idx].set(new)
