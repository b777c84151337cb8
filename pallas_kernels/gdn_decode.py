"""The GDN layer's kernels for decode and spec-verify rows (a few tokens each), reading and writing the engine's
pools in place (Triton lowering on a GPU, interpret mode on CPU).

- `gdn_recurrent_pooled`: the recurrence's token loop, one program per (row, value head, dv tile) holding its
  [dk, BV] state tile in registers. It starts from checkpoint `start` of the row's slot (zeros for a fresh
  row) and writes one checkpoint per window position (verify rows) or the final state (other rows), with no
  gathered copy of the states. It reads q, k, v from the packed conv output [B, T, q‖k‖v]
  (`gdn_conv.causal_conv_pooled`'s).
- `gdn_mixer_pooled`: everything between the layer's two products as one kernel. Otherwise a decode step's
  GDN layer runs five: the folded norm's 1/rms applied to the product, the gates, the conv, the recurrence
  and the gated RMS norm. One program per (row, key head) owns the conv channels of its key head's q and k
  and of its value heads' v, so reading a window from the pool and writing the new one in place never
  races; it convolves them, computes the gates, runs the delta rule on each value head's whole [dk, dv]
  state (the gated norm needs whole heads) and writes the normed, gated output in out_proj's input layout.

    y           [B, T, N]   the fused in_proj product: columns q‖k‖v (C = 2*Hk*dk + Hv*dv), z (Hv*dv), b (Hv),
                            a (Hv); in the activation dtype, or fp32 with row_scale
    row_scale   [B, T, 1]   fp32 or None: the folded norm's 1/rms (`norms.DeferredNorm.product_parts`), applied
                            and rounded to the activation dtype as the product would be
    conv_weight [C, 1, Kc]; A_log, dt_bias [Hv]; norm_weight [dv]
    conv_pool   [S, Kc-1+K, C];  ssm_pool [S, W, Hv, dk, dv] fp32 (W = 1+K checkpoints)
    slots, start, fresh, verify, num_valid [B]
    -> (out [B, T, Hv*dv] in the activation dtype, conv_pool, ssm_pool)

The mixer's semantics are the unfused chain's (`causal_conv_pooled`, `jaxgdn.model.gdn.gdn_gates`,
`gdn_recurrent_pooled`, `norms.gated_rms_norm`; tests/test_gdn_mixer.py compares them): a row starts from
checkpoint `start` of its slot (zeros when fresh); steps past num_valid neither decay nor write; a verify row
writes the state after each window position t < W to checkpoint t and its whole conv buffer, any other row its
final state to checkpoint 0 and its last Kc-1 real inputs as the window. The recurrence's reference is
`gdn_reference.gdn_recurrent_checkpoints` (tests/test_gdn_decode.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .common import call_on_product, interpret_default, product_rows, triton_params
from .gdn_common import GateSource, delta_step, gate_kernel_args, gate_values, gated_norm, tiles_supported, value_block
from .gdn_conv import conv_silu_rows, store_windows

f32 = jnp.float32


def _pooled_kernel(qkv_ref, *refs, T, W, group, dk, BV, scale, evict_first, b_offset):
    from jax.experimental.pallas import triton as plt  # masked stores (also in interpret mode)

    if b_offset is not None:  # the gates from the projection in place (`GateSource`)
        src_ref, alog_ref, dtb_ref, nvalid_ref, *refs = refs
    else:
        g_ref, beta_ref, *refs = refs
    slot_ref, start_ref, fresh_ref, verify_ref, _pool_in, o_ref, pool_ref = refs

    # evict_first: the state is read once and written once, so its lines may leave L2 first
    hint = {"eviction_policy": "evict_first"} if evict_first else {}

    b, h, iv = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    hk = h // group
    qk_width = qkv_ref.shape[2] - o_ref.shape[2] * o_ref.shape[3]  # q ‖ k channels before v's Hv * dv
    q_cols, k_cols = pl.ds(hk * dk, dk), pl.ds(qk_width // 2 + hk * dk, dk)
    cols = pl.ds(iv * BV, BV)
    v_cols = pl.ds(qk_width + h * o_ref.shape[3] + iv * BV, BV)
    slot = slot_ref[b]
    S = plt.load(pool_ref.at[slot, start_ref[b], h, :, cols], **hint)
    S = jnp.where(fresh_ref[b] != 0, 0.0, S)  # a fresh row never sees what the slot held before
    verify = verify_ref[b] != 0

    def gates(t):  # (g, beta) of token t: given, or formed from the projection's b and a columns
        if b_offset is None:
            return g_ref[b, t, h], beta_ref[b, t, h]
        Hv = o_ref.shape[2]
        g, beta = gate_values(src_ref[b, t, b_offset + h], src_ref[b, t, b_offset + Hv + h], alog_ref[h], dtb_ref[h],
                              src_ref.dtype)
        real = t < nvalid_ref[b]  # padded steps neither decay nor write
        return jnp.where(real, g, 0.0), jnp.where(real, beta, 0.0)

    def token(t, S):  # one token of the recurrence, its output row written
        S, o = delta_step(qkv_ref[b, t, q_cols], qkv_ref[b, t, k_cols], qkv_ref[b, t, v_cols], *gates(t), scale, S)
        o_ref[b, t, h, cols] = o.astype(o_ref.dtype)
        return S

    if T == 1:  # verify or not, the state after the one token goes to checkpoint 0: one unmasked store
        plt.store(pool_ref.at[slot, jnp.int32(0), h, :, cols], token(jnp.int32(0), S), **hint)
        return

    def step(t, S):
        S = token(t, S)
        # Verify rows keep the state after every window position: checkpoint t.
        plt.store(pool_ref.at[slot, jnp.minimum(t, W - 1), h, :, cols], S, mask=jnp.full(S.shape, verify & (t < W)),
                  **hint)
        return S

    S = lax.fori_loop(0, T, step, S)
    plt.store(pool_ref.at[slot, jnp.int32(0), h, :, cols], S, mask=jnp.full(S.shape, jnp.logical_not(verify)), **hint)


def pool_warps(T: int) -> int:
    """Warps of a pool-kernel program: 4 for decode rows, 2 for verify windows (T >= 2), whose longer loop
    gains more from two programs an SM scheduler."""
    return 4 if T == 1 else 2


def gdn_recurrent_pooled(qkv, g, beta, pool, slots, start, fresh, verify, interpret=None, num_warps: int | None = None,
                         block_v: int | None = None, evict_first: bool = True, gates: GateSource | None = None):
    """The decode / spec-verify recurrence reading and writing the engine's state pool in place.

    qkv [B, T, 2*Hk*dk + Hv*dv]: the conv output, q ‖ k ‖ v with heads contiguous (read in place: no
    sliced copies); g, beta [B, T, Hv]; pool [S, W, Hv, dk, dv] fp32 (W = 1+K checkpoints per slot);
    slots [B] pool slot of each row; start [B] checkpoint to start from (num_accepted - 1); fresh [B]
    start from zeros; verify [B] write the state after window position t to checkpoint t (t < W), else
    write the final state to checkpoint 0.
    gates: a `GateSource` (g = beta = None): the kernel forms g and beta from the projection's b and a columns
    in place, as `jaxgdn.model.gdn.gdn_gates` and the padding mask do in XLA, where they were a kernel of their own.
    Returns (o [B, T, Hv, dv] fp32, updated pool). Rows must use distinct slots (padding rows may share
    the null slot: what they write there is never read). block_v: the dv tile of a program (default
    `value_block`'s); num_warps: default `pool_warps(T)`; evict_first: L2 evict-first hints on the state's
    load and stores (read once, written once, so they need not hold L2 lines others could use).
    """
    B, T, C = qkv.shape
    _, W, Hv, dk, dv = pool.shape
    Hk = (C - Hv * dv) // (2 * dk)
    assert tiles_supported(dk, dv) and C == 2 * Hk * dk + Hv * dv, (C, pool.shape)
    BV = block_v or value_block(dv, B * Hv)
    assert dv % BV == 0 and BV >= 16, (dv, BV)
    i32 = lambda x: jnp.asarray(x).astype(jnp.int32)  # noqa: E731
    gate_args = gate_kernel_args(g, beta, gates, B, T, Hv)
    kernel = functools.partial(_pooled_kernel, T=T, W=W, group=Hv // Hk, dk=dk, BV=BV, scale=dk**-0.5,
                               evict_first=evict_first, b_offset=None if gates is None else gates.b_offset)
    args = (qkv, *gate_args, i32(slots), i32(start), i32(fresh), i32(verify), pool)
    o, pool = pl.pallas_call(
        kernel, out_shape=(jax.ShapeDtypeStruct((B, T, Hv, dv), f32), jax.ShapeDtypeStruct(pool.shape, pool.dtype)),
        grid=(B, Hv, dv // BV), input_output_aliases={len(args) - 1: 1}, interpret=interpret_default(interpret),
        compiler_params=triton_params(num_warps or pool_warps(T)),
    )(*args)
    return o, pool



def mixer_kernel_supports(dk: int, dv: int) -> bool:
    """Head dims must be Triton tiles (the pools are read in place) and a whole [dk, dv] fp32 state tile
    must fit one program's registers."""
    return tiles_supported(dk, dv) and dk * dv <= 128 * 128


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
            S, o = delta_step(qs[t], ks[t], vs[t], jnp.where(real, g, 0.0), jnp.where(real, beta, 0.0),
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
