"""Pallas kernels of the gated delta rule's token loop (Triton lowering on GPU, interpret mode on CPU), and the
gate and norm helpers the GDN kernels share.

Same math and shapes as `pallas_kernels/gdn.py` (its `gdn_recurrent_reference` is the reference):
q, k [B, T, Hk, dk]; v [B, T, Hv, dv]; g, beta [B, T, Hv] fp32; state [B, Hv, dk, dv] fp32.
Inputs stay in their [B, T, H, d] layout (no transposes); L2 norm and query scale happen in-kernel.

- `gdn_recurrent_pallas`: the token loop, one program per (row, value head, dv block) holding its
  [dk, BV] state tile in registers. Decode (T=1) and spec verification (T=1+K, `keep_states=True`
  writes the state after every position, the checkpoints rollback selects from).
- `gdn_recurrent_pooled`: the same loop reading and writing the engine's slot pool in place: it starts
  from checkpoint `num_accepted - 1` of the row's slot (zeros for a fresh row) and writes one checkpoint
  per window position (verify rows) or the final state (other rows), with no gathered copy of states.
  It reads q, k, v from the packed conv output [B, T, q‖k‖v] (`conv_pallas.causal_conv_pooled`'s).
Matmuls take their operands in the input dtype with fp32 accumulation (bf16 tensor cores for bf16
models, exact fp32 for fp32 runs), as fla does; the state, decays and the triangular inverse stay fp32
(for bf16 models the inverse's block combination multiplies on TF32, as fla's does).
Triton needs power-of-two tiles: dk and dv are zero-padded up to one (exactly a no-op, see `_pad_heads`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .common import interpret_default, triton_params

f32 = jnp.float32


def _inv_norm(x):
    """1 / |x| over the last axis, in fp32 (with _l2norm's epsilon)."""
    return lax.rsqrt(jnp.sum(jnp.square(x.astype(f32)), axis=-1) + 1e-6)


def _l2norm(x):
    return x * _inv_norm(x)[..., None]


def _dot(a, b, dtype, tf32: bool = False):
    """a @ b with operands cast to dtype, fp32 accumulation; HIGHEST keeps fp32 operands off TF32 unless
    tf32 (Pallas' Triton lowering maps DEFAULT to TF32; interpret mode computes fp32 either way)."""
    precision = lax.Precision.DEFAULT if tf32 else lax.Precision.HIGHEST
    return jnp.dot(a.astype(dtype), b.astype(dtype), preferred_element_type=f32, precision=precision)


def _softplus(x):
    """jax.nn.softplus's form, log(1 + e^x) = max(x, 0) + log1p(e^-|x|): jax.nn.softplus itself is a
    custom_jvp, which the Triton lowering rejects."""
    return jnp.maximum(x, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(x)))


def gate_values(b, a, A_log, dt_bias, dtype):
    """`jaxgdn.model.gdn.gdn_gates` inside a kernel: b, a the projection's raw values (any shape), A_log and dt_bias
    one head's scalars, dtype the projection's. Returns (g log decay, beta), fp32; beta = sigmoid(b) rounded
    to dtype as the layer computes it there."""
    beta = jax.nn.sigmoid(b.astype(f32)).astype(dtype).astype(f32)
    g = -jnp.exp(A_log.astype(f32)) * _softplus(a.astype(f32) + dt_bias.astype(f32))
    return g, beta


def _pad_heads(q, k, v, initial_state):
    """Zero state when None, fp32; then zero-pad dk, dv to powers of two >= 16. Zero key/query columns
    leave the norms and the state's real rows unchanged; zero value columns stay zero in the state and
    the output. Exact no-op."""
    B, _, _, dk = q.shape
    Hv, dv = v.shape[2], v.shape[3]
    initial_state = jnp.zeros((B, Hv, dk, dv), f32) if initial_state is None else initial_state.astype(f32)
    pk, pv = max(16, pl.next_power_of_2(dk)) - dk, max(16, pl.next_power_of_2(dv)) - dv
    if pk:
        q, k = (jnp.pad(x, [(0, 0)] * 3 + [(0, pk)]) for x in (q, k))
    if pv:
        v = jnp.pad(v, [(0, 0)] * 3 + [(0, pv)])
    if pk or pv:
        initial_state = jnp.pad(initial_state, [(0, 0), (0, 0), (0, pk), (0, pv)])
    return q, k, v, initial_state


def _value_block(dv: int, programs: int, target_programs: int = 256) -> int:
    """dv tile: 64 (fewer recomputations) unless that leaves the GPU short of programs; >= 16."""
    bv = min(dv, 64)
    while bv > 16 and programs * (dv // bv) < target_programs:
        bv //= 2
    return bv


# ----------------------------------------------------------------------------- recurrent (decode / verify)


def _delta_step(q, k, v, g, beta, scale, S):
    """One token of the recurrence on a [dk, BV] state tile: q, k [dk] (raw: L2-normed here), v [BV],
    g, beta scalars. Decay, delta-rule write; returns (S, output row [BV] fp32)."""
    q = _l2norm(q.astype(f32)) * scale
    k = _l2norm(k.astype(f32))
    S = S * jnp.exp(g)
    pred = jnp.sum(S * k[:, None], axis=0)  # Sᵀk: [BV]
    S = S + k[:, None] * (beta * (v.astype(f32) - pred))[None, :]
    return S, jnp.sum(S * q[:, None], axis=0)


def _recurrent_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, s0_ref, o_ref, sT_ref, *ckpt_refs, T, group, BV, scale):
    b, h, iv = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    hk = h // group
    cols = pl.ds(iv * BV, BV)

    def step(t, S):  # S: [dk, BV] fp32
        S, o = _delta_step(q_ref[b, t, hk, :], k_ref[b, t, hk, :], v_ref[b, t, h, cols], g_ref[b, t, h],
                           beta_ref[b, t, h], scale, S)
        o_ref[b, t, h, cols] = o.astype(o_ref.dtype)
        if ckpt_refs:
            ckpt_refs[0][b, t, h, :, cols] = S
        return S

    sT_ref[b, h, :, cols] = lax.fori_loop(0, T, step, s0_ref[b, h, :, cols].astype(f32))


def gdn_recurrent_pallas(q, k, v, g, beta, initial_state=None, keep_states: bool = False, interpret=None,
                         num_warps: int = 4):
    """The recurrence as one kernel. Returns (o [B, T, Hv, dv] fp32, final state [B, Hv, dk, dv] fp32) and,
    with keep_states, the state after every step [B, T, Hv, dk, dv] (the spec-verify checkpoints)."""
    B, T, Hk, dk = q.shape
    Hv, dv = v.shape[2], v.shape[3]
    q, k, v, s0 = _pad_heads(q, k, v, initial_state)
    dkp, dvp = q.shape[-1], v.shape[-1]
    BV = _value_block(dvp, B * Hv)
    out_shape = [jax.ShapeDtypeStruct((B, T, Hv, dvp), f32), jax.ShapeDtypeStruct((B, Hv, dkp, dvp), f32)]
    if keep_states:
        out_shape.append(jax.ShapeDtypeStruct((B, T, Hv, dkp, dvp), f32))
    kernel = functools.partial(_recurrent_kernel, T=T, group=Hv // Hk, BV=BV, scale=dk**-0.5)
    outs = pl.pallas_call(
        kernel, out_shape=tuple(out_shape), grid=(B, Hv, dvp // BV), interpret=interpret_default(interpret),
        compiler_params=triton_params(num_warps),
    )(q, k, v, g.astype(f32), beta.astype(f32), s0)
    o, sT = outs[0][..., :dv], outs[1][:, :, :dk, :dv]
    if keep_states:
        return o, sT, outs[2][..., :dk, :dv]
    return o, sT


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
        S, o = _delta_step(qkv_ref[b, t, q_cols], qkv_ref[b, t, k_cols], qkv_ref[b, t, v_cols], *gates(t), scale, S)
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


def pooled_kernel_supports(dk: int, dv: int) -> bool:
    """The in-place kernel cannot pad the pool: head dims must already be Triton tiles."""
    return all(d >= 16 and d == pl.next_power_of_2(d) for d in (dk, dv))


def pool_warps(T: int) -> int:
    """Warps of a pool-kernel program: 4 for decode rows, 2 for verify windows (T >= 2), whose longer loop
    gains more from two programs an SM scheduler."""
    return 4 if T == 1 else 2


def gdn_recurrent_pooled(qkv, g, beta, pool, slots, start, fresh, verify, interpret=None, num_warps: int | None = None,
                         block_v: int | None = None, evict_first: bool = True, gates=None):
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
    `_value_block`'s); num_warps: default `pool_warps(T)`; evict_first: L2 evict-first hints on the state's
    load and stores (read once, written once, so they need not hold L2 lines others could use).
    """
    B, T, C = qkv.shape
    _, W, Hv, dk, dv = pool.shape
    Hk = (C - Hv * dv) // (2 * dk)
    assert pooled_kernel_supports(dk, dv) and C == 2 * Hk * dk + Hv * dv, (C, pool.shape)
    BV = block_v or _value_block(dv, B * Hv)
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


def gated_norm(o, z, weight, eps: float, dv: int, dtype):
    """`norms.gated_rms_norm(o.astype(dtype), z, weight)` in a kernel, over o's last axis: o [..., BV] fp32
    (whole heads; padded columns zero, dv the real width), z [..., BV] the gate, weight [BV]. fp32 result."""
    o = o.astype(dtype).astype(f32)  # the layer casts the core output to its activation dtype first
    normed = (o * lax.rsqrt(jnp.sum(o * o, axis=-1, keepdims=True) / dv + eps)).astype(dtype).astype(f32)
    z = z.astype(f32)
    return weight.astype(f32) * normed * (z * jax.nn.sigmoid(z))


class OutputGate(NamedTuple):
    """The GDN layer's gated RMS norm, for the chunked kernel's output kernel to apply.

    z: the gates, [B, T, Hv, dv], or (with z_offset) any [B, T, C] array whose columns z_offset + h * dv
    .. + dv hold value head h's: the fused projection's whole product, read in place (a slice passed to
    the kernel is first copied into a buffer of its own by XLA). weight [dv]; eps the norm's epsilon."""

    z: jax.Array
    weight: jax.Array
    eps: float
    z_offset: int = 0


class GateSource(NamedTuple):
    """The GDN gates for a kernel to compute from the input projection in place, as `jaxgdn.model.gdn.gdn_gates` and
    the padding mask do in XLA, where they are two small kernels a layer of their own.

    source [B, T, N]: value head h's b at column b_offset + h and its a at b_offset + Hv + h (the fused
    projection's whole product); A_log, dt_bias [Hv]; num_valid [B] real tokens per row (steps past it
    get g = beta = 0) or None (all T)."""

    source: jax.Array
    b_offset: int
    A_log: jax.Array
    dt_bias: jax.Array
    num_valid: jax.Array | None = None


def gate_kernel_args(g, beta, gates: GateSource | None, B: int, T: int, Hv: int) -> tuple:
    """A kernel's gate arguments: (g, beta) in fp32, or with gates (g = beta = None) the GateSource's source,
    A_log, dt_bias and num_valid (int32, at most T; T when None), checked against [B, T] rows and Hv heads."""
    if gates is None:
        return g.astype(f32), beta.astype(f32)
    if g is not None or beta is not None:
        raise ValueError("gates= computes g and beta in the kernel: pass g = beta = None")
    src_shape = gates.source.shape
    if src_shape[:2] != (B, T) or not 0 <= gates.b_offset <= src_shape[2] - 2 * Hv:
        raise ValueError(f"GateSource: source {src_shape} has no [{B}, {T}] rows with b and a columns at "
                         f"{gates.b_offset} .. {gates.b_offset + 2 * Hv}")
    n = jnp.full((B,), T, jnp.int32) if gates.num_valid is None else jnp.minimum(gates.num_valid, T)
    return gates.source, gates.A_log, gates.dt_bias, n.astype(jnp.int32)
