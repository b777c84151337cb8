"""What the GDN kernels share: the recurrence's step on a state tile, the gates, the gated norm, the chunked
form's blocked triangular inverse, and the sizes that decide which kernel a row runs.

The math is `gdn_reference`'s: q and k L2-normed (eps 1e-6 inside the sqrt), q scaled by dk^-1/2, value head j
reads key head j // (Hv // Hk); per token, with S [dk, dv]: S = e^g S; S += k ⊗ β(v - Sᵀk); o = Sᵀq.
Matmuls take their operands in the input dtype with fp32 accumulation (bf16 tensor cores for bf16 models, exact
fp32 for fp32 runs), as fla does; the state, decays and the triangular inverse stay fp32.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

f32 = jnp.float32
SHORT_ROW = 16  # rows of up to this many tokens run the token loop; longer rows the chunked form
CHUNK = 64  # tokens per chunk of the chunked form
SUB = 16  # rows per block of the in-chunk triangular solve (Triton's smallest dot tile)


def tiles_supported(dk: int, dv: int) -> bool:
    """The kernels read the state pool in place, which cannot be padded: head dims must be Triton tiles."""
    return all(d >= 16 and d == pl.next_power_of_2(d) for d in (dk, dv))


def inv_norm(x):
    """1 / |x| over the last axis, in fp32 (with l2norm's epsilon)."""
    return lax.rsqrt(jnp.sum(jnp.square(x.astype(f32)), axis=-1) + 1e-6)


def l2norm(x):
    return x * inv_norm(x)[..., None]


def dot(a, b, dtype, tf32: bool = False):
    """a @ b with operands cast to dtype, fp32 accumulation; HIGHEST keeps fp32 operands off TF32 unless
    tf32 (Pallas' Triton lowering maps DEFAULT to TF32; interpret mode computes fp32 either way)."""
    precision = lax.Precision.DEFAULT if tf32 else lax.Precision.HIGHEST
    return jnp.dot(a.astype(dtype), b.astype(dtype), preferred_element_type=f32, precision=precision)


def softplus(x):
    """jax.nn.softplus's form, log(1 + e^x) = max(x, 0) + log1p(e^-|x|): jax.nn.softplus itself is a
    custom_jvp, which the Triton lowering rejects."""
    return jnp.maximum(x, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(x)))


def gate_values(b, a, A_log, dt_bias, dtype):
    """`jaxgdn.model.gdn.gdn_gates` inside a kernel: b, a the projection's raw values (any shape), A_log and dt_bias
    one head's scalars, dtype the projection's. Returns (g log decay, beta), fp32; beta = sigmoid(b) rounded
    to dtype as the layer computes it there."""
    beta = jax.nn.sigmoid(b.astype(f32)).astype(dtype).astype(f32)
    g = -jnp.exp(A_log.astype(f32)) * softplus(a.astype(f32) + dt_bias.astype(f32))
    return g, beta


def value_block(dv: int, programs: int, target_programs: int = 256) -> int:
    """dv tile: 64 (fewer recomputations) unless that leaves the GPU short of programs; >= 16."""
    bv = min(dv, 64)
    while bv > 16 and programs * (dv // bv) < target_programs:
        bv //= 2
    return bv


def delta_step(q, k, v, g, beta, scale, S):
    """One token of the recurrence on a [dk, BV] state tile: q, k [dk] (raw: L2-normed here), v [BV],
    g, beta scalars. Decay, delta-rule write; returns (S, output row [BV] fp32)."""
    q = l2norm(q.astype(f32)) * scale
    k = l2norm(k.astype(f32))
    S = S * jnp.exp(g)
    pred = jnp.sum(S * k[:, None], axis=0)  # Sᵀk: [BV]
    S = S + k[:, None] * (beta * (v.astype(f32) - pred))[None, :]
    return S, jnp.sum(S * q[:, None], axis=0)


def gated_norm(o, z, weight, eps: float, dv: int, dtype):
    """`norms.gated_rms_norm(o.astype(dtype), z, weight)` in a kernel, over o's last axis: o [..., BV] fp32
    (whole heads; padded columns zero, dv the real width), z [..., BV] the gate, weight [BV]. fp32 result."""
    o = o.astype(dtype).astype(f32)  # the layer casts the core output to its activation dtype first
    normed = (o * lax.rsqrt(jnp.sum(o * o, axis=-1, keepdims=True) / dv + eps)).astype(dtype).astype(f32)
    z = z.astype(f32)
    return weight.astype(f32) * normed * (z * jax.nn.sigmoid(z))


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


def unit_lower_inverse(a):
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


def chunk_inverse(ks, inv_norms, betas, gam, dtype):
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
        scale = (betas[i] * inv_norms[i])[:, None] * inv_norms[j][None, :]
        return dot(ks[i], ks[j].T, dtype) * scale * jnp.exp(diff)

    A = {(i, j): a_block(i, j) for i in range(nsub) for j in range(i)}
    # The block combination's [16, 16] products run on TF32 tensor cores when the model's operands are bf16
    # (fla's choice; W and U are stored in bf16 anyway); fp32 runs keep exact products.
    tf32 = jnp.dtype(dtype) != jnp.dtype(f32)
    inv = {}
    for i in range(nsub):
        inv[i, i] = unit_lower_inverse(a_block(i, i))
        for j in range(i - 1, -1, -1):
            # Block forward substitution: T_ij = -T_ii Σ_{j<=m<i} A_im T_mj.
            acc = sum(dot(A[i, m], inv[m, j], f32, tf32) for m in range(j, i))
            inv[i, j] = -dot(inv[i, i], acc, f32, tf32)
    return inv


def row_offsets(token_row, query_start_loc):
    """A ragged stream's (valid [T], row [T] clipped into [0, R), offset of each token in its row [T])."""
    R = query_start_loc.shape[0] - 1
    T = token_row.shape[0]
    valid = token_row >= 0
    row = jnp.clip(token_row, 0, R - 1)
    offset = jnp.arange(T, dtype=jnp.int32) - query_start_loc[row]
    return valid, row, offset
