"""The GDN layer's mixer for decode and spec-verify rows as one Pallas kernel, between its two products.

Between the fused in_proj product and out_proj, a decode step's GDN layer otherwise runs five kernels: the
folded norm's 1/rms applied to the product, the gates, the conv (`conv_pallas.causal_conv_pooled`), the
recurrence (`gdn_pallas.gdn_recurrent_pooled`) and the gated RMS norm. This kernel does all of it. One program
per (row, key head) owns the conv channels of its key head's q and k and of its value heads' v, so reading
a window from the pool and writing the new one in place never races; it convolves them, computes the gates,
runs the delta rule on each value head's whole [dk, dv] state read from the pool (the gated norm needs whole
heads) and writes the normed, gated output in out_proj's input layout.

    y           [B, T, N]   the fused in_proj product: columns q‖k‖v (C = 2*Hk*dk + Hv*dv), z (Hv*dv), b (Hv),
                            a (Hv); in the activation dtype, or fp32 with row_scale
    row_scale   [B, T, 1]   fp32 or None: the folded norm's 1/rms (`norms.DeferredNorm.product_parts`), applied
                            and rounded to the activation dtype as the product would be
    conv_weight [C, 1, Kc]; A_log, dt_bias [Hv]; norm_weight [dv]
    conv_pool   [S, Kc-1+K, C];  ssm_pool [S, W, Hv, dk, dv] fp32 (W = 1+K checkpoints)
    slots, start, fresh, verify, num_valid [B]
    -> (out [B, T, Hv*dv] in the activation dtype, conv_pool, ssm_pool)

Semantics are the unfused chain's (`causal_conv_pooled`, `jaxgdn.model.gdn.gdn_gates`, `gdn_recurrent_pooled`,
`norms.gated_rms_norm`; tests/test_gdn_mixer.py compares them): a row starts from checkpoint `start` of its
slot (zeros when fresh); steps past num_valid neither decay nor write; a verify row writes the state after
each window position t < W to checkpoint t and its whole conv buffer, any other row its final state to
checkpoint 0 and its last Kc-1 real inputs as the window.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .common import call_on_product, product_rows
from .conv_pallas import conv_silu_rows, store_windows
from .gdn_pallas import _delta_step, gate_values, gated_norm, pooled_kernel_supports

f32 = jnp.float32


def mixer_kernel_supports(dk: int, dv: int) -> bool:
    """Head dims must be Triton tiles (the pools are read in place) and a whole [dk, dv] fp32 state tile
    must fit one program's registers."""
    return pooled_kernel_supports(dk, dv) and dk * dv <= 128 * 128


def _mixer_kernel(y_ref, *refs, T, W, Kc, Hk, group, dk, dv, eps, scaled):
    b, hk = pl.program_id(0), pl.program_id(1)
    product, refs = product_rows(y_ref, refs, scaled, b)  # product(t, cols): the unfused path's bf16 product
    (w_ref, alog_ref, dtb_ref, normw_ref, slot_ref, start_ref, fresh_ref, verify_ref, nvalid_ref, _conv_in, _ssm_in,
     out_ref, conv_ref, ssm_ref) = refs
    from jax.experimental.pallas import triton as plt  # masked stores (also in interpret mode)

    Hv = Hk * group
    Kd = Hk * dk
    C = 2 * Kd + Hv * dv
    dtype = out_ref.dtype
    slot, start, n = slot_ref[b], start_ref[b], nvalid_ref[b]
    fresh, verify = fresh_ref[b] != 0, verify_ref[b] != 0

    def conv(lo: int, width: int):
        """The conv outputs of channels [lo, lo + width) at every position (in the activation dtype, as the
        unfused conv stores them); writes those channels' new windows (every load of them comes first)."""
        cols = pl.ds(lo, width)
        window = [jnp.where(fresh, 0, conv_ref[slot, start + i, cols]).astype(dtype) for i in range(Kc - 1)]
        full = window + [product(t, cols) for t in range(T)]
        outs = [u.astype(dtype) for u in conv_silu_rows(full, w_ref, cols, T)]
        store_windows(conv_ref, slot, cols, full, Kc, T, n, verify)
        return outs

    qs, ks = conv(hk * dk, dk), conv(Kd + hk * dk, dk)
    for j in range(group):  # value heads hk*group + j, one whole state tile at a time
        h = hk * group + j
        vs = conv(2 * Kd + h * dv, dv)
        S = jnp.where(fresh, 0.0, ssm_ref[slot, start, h, :, :])
        for t in range(T):
            g, beta = gate_values(product(t, C + Hv * dv + h), product(t, C + Hv * dv + Hv + h), alog_ref[h],
                                  dtb_ref[h], dtype)
            real = t < n  # padded steps neither decay nor write
            S, o = _delta_step(qs[t], ks[t], vs[t], jnp.where(real, g, 0.0), jnp.where(real, beta, 0.0),
                               dk**-0.5, S)
            if t < W:  # verify rows keep the state after every window position: checkpoint t
                plt.store(ssm_ref.at[slot, jnp.int32(t), h, :, :], S, mask=jnp.full(S.shape, verify))
            z = product(t, pl.ds(C + h * dv, dv))
            out_ref[b, jnp.int32(t), pl.ds(h * dv, dv)] = gated_norm(o, z, normw_ref[:], eps, dv, dtype).astype(dtype)
        plt.store(ssm_ref.at[slot, jnp.int32(0), h, :, :], S, mask=jnp.full(S.shape, jnp.logical_not(verify)))


def gdn_mixer_pooled(y, row_scale, conv_weight, A_log, dt_bias, norm_weight, eps: float, conv_pool, ssm_pool, slots,
                     start, fresh, verify, num_valid, dtype=None, interpret=None, num_warps: int = 4):
    """The GDN mixer of short rows over the engine's pools in place; shapes and semantics in the module
    docstring. dtype: the activation dtype (default y's; give it when y is the fp32 product of row_scale).
    Rows must use distinct slots (padding rows may share the null slot: what they write there is never read)."""
    B, T, _ = y.shape
    _, W, Hv, dk, dv = ssm_pool.shape
    C, Kc = conv_weight.shape[0], conv_weight.shape[-1]
    Hk = (C - Hv * dv) // (2 * dk)
    assert mixer_kernel_supports(dk, dv) and C == 2 * Hk * dk + Hv * dv, (C, ssm_pool.shape)
    assert conv_pool.shape[2] == C and conv_pool.shape[1] >= Kc - 1 and y.shape[2] >= C + Hv * dv + 2 * Hv
    dtype = jnp.dtype(dtype or y.dtype)
    i32 = lambda a: jnp.asarray(a).astype(jnp.int32)  # noqa: E731
    scaled = row_scale is not None
    kernel = functools.partial(_mixer_kernel, T=T, W=W, Kc=Kc, Hk=Hk, group=Hv // Hk, dk=dk, dv=dv, eps=float(eps),
                               scaled=scaled)
    inputs = (conv_weight, A_log, dt_bias, norm_weight, i32(slots), i32(start), i32(fresh), i32(verify), i32(num_valid))
    return call_on_product(kernel, y, row_scale, inputs, (conv_pool, ssm_pool),
                           jax.ShapeDtypeStruct((B, T, Hv * dv), dtype), (B, Hk), num_warps, interpret)
