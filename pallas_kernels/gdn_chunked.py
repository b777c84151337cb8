"""The chunked (WY) form of the gated delta rule as Pallas kernels (Triton lowering on GPU, interpret mode on CPU).

Same math and shapes as `pallas_kernels/gdn.py` (its `gdn_recurrent_reference` is the reference):
q, k [B, T, Hk, dk]; v [B, T, Hv, dv]; g, beta [B, T, Hv] fp32; state [B, Hv, dk, dv] fp32.

`gdn_chunked_pallas`: `_prep_kernel` runs over all chunks in parallel: cumulative
log decay γ, A = strict_lower(βKKᵀ ⊙ e^{γ_i-γ_j}), (I+A)⁻¹ by forward substitution on 16-row blocks plus
block combination, U = (I+A)⁻¹βV, W = (I+A)⁻¹βe^γK and the key scale s = e^{γ_last-γ} (with the key
norm). `_output_parts_kernel` forms QKᵀ ⊙ Dec and the query factor, also in parallel. The scan is the only
sequential part: per (row, head, dv block) it walks the chunks with the state in registers,
V' = U - W S, S <- e^{γ_last} S + Kᵀ(s ⊙ V'), and adds the output's two state-dependent products inside
its loop, O = (e^γ Q) S_enter + (QKᵀ ⊙ Dec) V', so the entering states and V' never go to memory; the
layer's gated RMS norm (`gate=`) runs in XLA after. Each row of the batch starts from its own initial
state and chunks never cross rows. With `GateSource` the prep kernel computes g and β itself from the
input projection's b and a columns, read in place.

Matmuls take their operands in the input dtype with fp32 accumulation; the state, decays and the triangular
inverse stay fp32 (for bf16 models the inverse's block combination multiplies on TF32, as fla's does).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .common import interpret_default, triton_params
from .gdn_pallas import (
    GateSource,
    OutputGate,
    _dot,
    _inv_norm,
    _pad_heads,
    _value_block,
    gate_kernel_args,
    gate_values,
    gated_norm,
)

CHUNK = 64  # tokens per chunk of the chunked form
SUB = 16  # rows per block of the in-chunk triangular solve (Triton's smallest dot tile)
DEEP_PIPELINE_MAX_PROGRAMS = 128  # the scan's loop pipelines 3 stages deep up to this many programs (<= one per SM)
# Shared memory a Triton program may hold on the H100/H200 (227 KiB, the opt-in maximum per block), less 16 KiB
# for the compiler's own scratch (layout conversions: the fused fp32 scan at dk=dv=128 asked 8 KiB beside
# its pipeline buffers).
SCAN_SHARED_MEMORY_BUDGET = 232448 - 16384
f32 = jnp.float32


def _unit_lower_inverse(a):
    """(I + a)⁻¹ for a strictly lower [n, n] fp32 tile, by forward substitution one row at a time:
    row i of the inverse is e_i - a_i · (rows < i of the inverse). Backward stable, unlike power series.
    Unrolled: faster than fla's loop form here."""
    n = a.shape[0]
    r = lax.broadcasted_iota(jnp.int32, (n, n), 0)
    c = lax.broadcasted_iota(jnp.int32, (n, n), 1)
    inv = (r == c).astype(f32)
    for i in range(1, n):
        a_i = jnp.sum(jnp.where(r == i, a, 0.0), axis=0)  # row i of a, [n]
        row = jnp.where(lax.iota(jnp.int32, n) == i, 1.0, 0.0) - jnp.sum(a_i[:, None] * inv, axis=0)
        inv = jnp.where(r == i, row[None, :], inv)
    return inv


def _chunk_inverse(ks, inv_norm, betas, gam, dtype):
    """The blocked (I+A)⁻¹ of one chunk from its raw key blocks ks [SUB, dk] and their inverse norms, β and
    γ ([SUB] each): {(i, j): T_ij [SUB, SUB] fp32} for j <= i.

    The L2 norm, β and the decays are per-row scales folded into the [SUB, SUB] tiles,
    A_ij = β_i n_i n_j e^{γ_i-γ_j} (K_i K_jᵀ), so no [CHUNK, dk] fp32 copies of the keys are live (they would
    spill registers)."""
    nsub = len(ks)
    ri = lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0)
    ci = lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)

    def a_block(i, j):  # rows of sub-block i, columns of sub-block j (i >= j)
        diff = gam[i][:, None] - gam[j][None, :]
        if i == j:
            diff = jnp.where(ri > ci, diff, -jnp.inf)  # mask before exp: strict lower only
        scale = (betas[i] * inv_norm[i])[:, None] * inv_norm[j][None, :]
        return _dot(ks[i], ks[j].T, dtype) * scale * jnp.exp(diff)

    A = {(i, j): a_block(i, j) for i in range(nsub) for j in range(i)}
    # The block combination's [16, 16] products run on TF32 tensor cores when the model's operands are bf16
    # (fla's choice; W and U are stored in bf16 anyway); fp32 runs keep exact products.
    tf32 = jnp.dtype(dtype) != jnp.dtype(f32)
    inv = {}
    for i in range(nsub):
        inv[i, i] = _unit_lower_inverse(a_block(i, i))
        for j in range(i - 1, -1, -1):
            # Block forward substitution: T_ij = -T_ii Σ_{j<=m<i} A_im T_mj.
            acc = sum(_dot(A[i, m], inv[m, j], f32, tf32) for m in range(j, i))
            inv[i, j] = -_dot(inv[i, i], acc, f32, tf32)
    return inv


def _prep_kernel(k_ref, v_ref, *refs, group, dtype, gates):
    """One (row, value head, chunk): γ, the blocked (I+A)⁻¹ (`_chunk_inverse`), U_i = Σ_j (T_ij β_j) V_j,
    W_i = Σ_j (T_ij β_j n_j e^{γ_j}) K_j and the per-token key scale n e^{γ_last-γ} for the scan.

    Keys and values stay raw in their input dtype (the matmul operands as loaded). The scan scales V' rather
    than reading scaled keys Kd = n e^{γ_last-γ} K stored here: that saves a [T, dk] store and load."""
    b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    hk = h // group
    nsub = CHUNK // SUB
    rows = [pl.ds(c * CHUNK + i * SUB, SUB) for i in range(nsub)]
    if gates is None:  # g, beta [B, Tp, Hv] fp32
        g_ref, beta_ref, w_ref, u_ref, kscale_ref, gam_ref = refs
        gate_rows = [(g_ref[b, r, h], beta_ref[b, r, h]) for r in rows]
    else:  # from the projection in place (`GateSource`): T its rows, b_offset its b columns, Hv heads
        src_ref, alog_ref, dtb_ref, nvalid_ref, w_ref, u_ref, kscale_ref, gam_ref = refs
        gate_rows = [_source_gates(src_ref, alog_ref, dtb_ref, nvalid_ref, b, h, c * CHUNK + i * SUB, *gates)
                     for i in range(nsub)]
    ks = [k_ref[b, r, hk, :] for r in rows]  # raw [SUB, dk]
    inv_norm = [_inv_norm(x) for x in ks]  # [SUB]
    betas = [beta for _, beta in gate_rows]
    gam = []
    last = jnp.zeros((), f32)  # γ_last once all rows are in
    for r, (g, _) in zip(rows, gate_rows):
        gam.append(jnp.cumsum(g) + last)
        last = last + jnp.sum(g)
        gam_ref[b, r, h] = gam[-1]
    inv = _chunk_inverse(ks, inv_norm, betas, gam, dtype)
    w_scale = [betas[j] * inv_norm[j] * jnp.exp(gam[j]) for j in range(nsub)]
    for i in range(nsub):
        u = sum(_dot(inv[i, j] * betas[j][None, :], v_ref[b, rows[j], h, :], dtype) for j in range(i + 1))
        w = sum(_dot(inv[i, j] * w_scale[j][None, :], ks[j], dtype) for j in range(i + 1))
        u_ref[b, rows[i], h, :] = u.astype(u_ref.dtype)
        w_ref[b, rows[i], h, :] = w.astype(w_ref.dtype)
        kscale_ref[b, rows[i], h] = inv_norm[i] * jnp.exp(last - gam[i])


def _source_gates(src_ref, alog_ref, dtb_ref, nvalid_ref, b, h, t0, T: int, b_offset: int, Hv: int):
    """g, beta [SUB] fp32 of value head h at tokens t0 .. t0+SUB-1 from the projection src [B, T, N] (b at
    column b_offset + h, a at b_offset + Hv + h): tokens at or past the row's num_valid get 0 and 0."""
    from jax.experimental.pallas import triton as plt  # masked loads (also in interpret mode)

    t = t0 + lax.iota(jnp.int32, SUB)
    rows, inside = pl.ds(t0, SUB), t < T  # the last chunk may reach past the row
    b_raw = plt.load(src_ref.at[b, rows, b_offset + h], mask=inside, other=0)
    a_raw = plt.load(src_ref.at[b, rows, b_offset + Hv + h], mask=inside, other=0)
    g, beta = gate_values(b_raw, a_raw, alog_ref[h], dtb_ref[h], src_ref.dtype)
    real = t < nvalid_ref[b]  # padded steps neither decay nor write
    return jnp.where(real, g, 0.0), jnp.where(real, beta, 0.0)


def _scan_kernel(w_ref, u_ref, k_ref, kscale_ref, gam_ref, s0_ref, q_ref, qf_ref, intra_ref, o_ref, sT_ref, *, N,
                 BV, group, dtype):
    """One (row, value head, dv block): the chunks in order with the state [dk, BV] in registers. The only
    sequential part: V' = U - W S and S <- e^{γ_last} S + Kᵀ(s ⊙ V') with s = n e^{γ_last-γ} the per-token key
    scale, applied to the [CHUNK, BV] V' (cheaper than scaling the [CHUNK, dk] raw keys). The output's products
    run in the loop while the state is in registers, O = qf ⊙ (Q S_enter) + intra V' with qf and intra from
    `_output_parts_kernel` and Q raw; they do not feed the state, so they run beside the chain's. Triton's loop
    pipelining loads the next chunks' W, U and K ahead (`gdn_chunked_pallas` picks its depth); the per-chunk
    scalars, which feed no product operand and which the pipelining leaves in the loop, are loaded one chunk
    ahead here and carried."""
    b, h, iv = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    hk = h // group
    cols = pl.ds(iv * BV, BV)
    small = functools.partial(_chunk_scalars, kscale_ref, gam_ref, qf_ref, b, h, N)

    def chunk(n, carry):
        S, (kscale, g_last, qf) = carry[0], carry[1:]
        rows = pl.ds(n * CHUNK, CHUNK)
        v_new = u_ref[b, rows, h, cols].astype(f32) - _dot(w_ref[b, rows, h, :], S, dtype)  # [C, BV]
        o = qf[:, None] * _dot(q_ref[b, rows, hk, :], S, dtype)
        o_ref[b, rows, h, cols] = (o + _dot(intra_ref[b, rows, h, :], v_new, dtype)).astype(o_ref.dtype)
        return (S * jnp.exp(g_last) + _dot(k_ref[b, rows, hk, :].T, v_new * kscale[:, None], dtype), *small(n + 1))

    sT_ref[b, h, :, cols] = lax.fori_loop(0, N, chunk, (s0_ref[b, h, :, cols].astype(f32), *small(0)))[0]


def scan_pipeline_depth(stages: int, dk: int, BV: int, itemsize: int) -> int:
    """The scan's pipelining depth: `stages`, lowered until its buffers fit SCAN_SHARED_MEMORY_BUDGET.

    Triton keeps stages - 1 chunks of the loop's tile loads in shared memory: W, K and Q [CHUNK, dk], U
    [CHUNK, BV] and intra [CHUNK, CHUNK], all `itemsize` bytes: fp32 inputs at dk = 128 and 3 stages ask
    2 x 116 KiB, past the H200's 227 KiB; bf16 asks half."""
    per_chunk = CHUNK * (3 * dk + BV + CHUNK) * itemsize
    while stages > 1 and (stages - 1) * per_chunk > SCAN_SHARED_MEMORY_BUDGET:
        stages -= 1
    return stages


def _chunk_scalars(kscale_ref, gam_ref, qf_ref, b, h, N, n):
    """The scan's per-chunk loads that feed no product operand directly, of chunk min(n, N - 1): the key scale
    [CHUNK], γ_last and the output's query factor [CHUNK]."""
    n = jnp.minimum(n, N - 1)
    rows = pl.ds(n * CHUNK, CHUNK)
    return kscale_ref[b, rows, h], gam_ref[b, n * CHUNK + CHUNK - 1, h], qf_ref[b, rows, h]


def _output_parts_kernel(q_ref, k_ref, gam_ref, intra_ref, qf_ref, *, group, scale, dtype):
    """One (row, value head, chunk): the state-independent parts of the output for the fused `_scan_kernel`:
    intra = (QKᵀ ⊙ Dec) [CHUNK, CHUNK] in dtype (L2-normed, scaled queries and keys, Dec_ij = e^{γ_i-γ_j} for
    i >= j, zero above) and the per-token query factor qf = scale e^γ / |q| [CHUNK] fp32. The product takes
    the raw q and k as loaded; the norms scale it after, in fp32."""
    b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    hk = h // group
    rows = pl.ds(c * CHUNK, CHUNK)
    r = lax.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 0)
    cc = lax.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 1)
    q, k = q_ref[b, rows, hk, :], k_ref[b, rows, hk, :]
    inv_q, inv_k = _inv_norm(q), _inv_norm(k)
    gam = gam_ref[b, rows, h]
    decay = jnp.exp(jnp.where(r >= cc, gam[:, None] - gam[None, :], -jnp.inf))
    intra = _dot(q, k.T, dtype) * (scale * inv_q)[:, None] * inv_k[None, :] * decay
    intra_ref[b, rows, h, :] = intra.astype(intra_ref.dtype)
    qf_ref[b, rows, h] = scale * inv_q * jnp.exp(gam)


def gdn_chunked_pallas(q, k, v, g, beta, initial_state=None, interpret=None, block_v: int | None = None,
                       warps: tuple[int, int, int] = (2, 4, 4), gate=None, scan_stages: int | None = None,
                       out_dtype=None, gates: GateSource | None = None):
    """The chunked form (see the module docstring). Returns (o fp32, final state fp32).

    out_dtype: o's dtype without gate= (default fp32; fla's `chunk_gated_delta_rule` returns it in the
    inputs' dtype, which `bench kernels` asks for to compare the same work: the fp32 store is twice the
    bytes). With gate= the output is in z's dtype, as the layer's norm computes it.

    gates = `GateSource(...)` with g = beta = None: the prep kernel computes g and beta from the projection.

    gate = `OutputGate(z, weight, eps[, z_offset])`, or that tuple: the GDN layer's gated RMS norm applied
    to o (in XLA), returned in z.dtype: `norms.gated_rms_norm(o.astype(z.dtype), z, weight, eps, z.dtype)`.

    Tuning: block_v the scan's dv tile; warps per (prep, scan, output parts) kernel (the prep kernel runs
    fastest on 2); scan_stages Triton's pipelining depth of the scan's chunk loop (default: 3 when the scan
    has at most one program per SM, where deeper loads hide latency best, else 2, where two programs an SM
    win on occupancy; either lowered to what fits the shared memory, `scan_pipeline_depth`)."""
    prep_warps, scan_warps, out_warps = warps
    B, T, Hk, dk = q.shape
    Hv, dv = v.shape[2], v.shape[3]
    q, k, v, s0 = _pad_heads(q, k, v, initial_state)
    dkp, dvp = q.shape[-1], v.shape[-1]
    pad = (-T) % CHUNK
    gate_args = gate_kernel_args(g, beta, gates, B, T, Hv)  # padded steps get g = beta = 0 in the kernel
    gate_info = None if gates is None else (T, gates.b_offset, Hv)
    if pad:  # padded steps: zero k, v, beta and g neither decay nor write the state
        padt = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
        q, k, v = (padt(x) for x in (q, k, v))
        if gates is None:
            gate_args = tuple(padt(x) for x in gate_args)
    Tp, N = T + pad, (T + pad) // CHUNK
    # Intermediates are stored in the matmul operand dtype: the later kernels cast them to it anyway.
    dtype = jnp.promote_types(v.dtype, q.dtype)
    interpret = interpret_default(interpret)
    group = Hv // Hk
    sds = jax.ShapeDtypeStruct
    BV = block_v or _value_block(dvp, B * Hv)
    w, u, kscale, gam = pl.pallas_call(
        functools.partial(_prep_kernel, group=group, dtype=dtype, gates=gate_info),
        out_shape=(sds((B, Tp, Hv, dkp), dtype), sds((B, Tp, Hv, dvp), dtype), sds((B, Tp, Hv), f32),
                   sds((B, Tp, Hv), f32)),
        grid=(B, Hv, N), interpret=interpret, compiler_params=triton_params(prep_warps),
    )(k, v, *gate_args)
    if scan_stages is None:
        scan_stages = 3 if B * Hv * (dvp // BV) <= DEEP_PIPELINE_MAX_PROGRAMS else 2
    scan_stages = scan_pipeline_depth(scan_stages, dkp, BV, jnp.dtype(dtype).itemsize)
    if gate is not None and out_dtype is not None:
        raise ValueError("out_dtype is for the plain output; with gate= the output is in z's dtype")
    o_dtype = gate[0].dtype if gate is not None else (out_dtype or f32)
    intra, qf = pl.pallas_call(
        functools.partial(_output_parts_kernel, group=group, scale=dk**-0.5, dtype=dtype),
        out_shape=(sds((B, Tp, Hv, CHUNK), dtype), sds((B, Tp, Hv), f32)),
        grid=(B, Hv, N), interpret=interpret, compiler_params=triton_params(out_warps),
    )(q, k, gam)
    o, sT = pl.pallas_call(
        functools.partial(_scan_kernel, N=N, BV=BV, group=group, dtype=dtype),
        out_shape=(sds((B, Tp, Hv, dvp), o_dtype), sds((B, Hv, dkp, dvp), f32)),
        grid=(B, Hv, dvp // BV), interpret=interpret,
        compiler_params=triton_params(scan_warps, num_stages=scan_stages),
    )(w, u, k, kscale, gam, s0, q, qf, intra)
    o = o[:, :T, :, :dv]
    if gate is not None:
        o = _gated_norm_heads(o, OutputGate(*gate), Hv, dv)
    return o, sT[:, :, :dk, :dv]


def _gated_norm_heads(o, gate: OutputGate, Hv: int, dv: int):
    """The gated norm in XLA, for the scan's o [B, T, Hv, dv] (in z's dtype): z whole heads [B, T, Hv, dv] or
    columns z_offset .. z_offset + Hv * dv of a [B, T, C] array."""
    z = gate.z
    if z.ndim == 3:
        z = z[..., gate.z_offset : gate.z_offset + Hv * dv].reshape(*o.shape)
    return gated_norm(o.astype(f32), z, gate.weight, float(gate.eps), dv, z.dtype).astype(z.dtype)
