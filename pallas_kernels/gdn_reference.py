"""The gated delta rule (the GDN recurrence) in XLA: the definition the kernels are tested against, the forms the
model oracle and training run, and the ragged form that serves where the Pallas kernels do not (CPU).

Math of docs/qwen35-architecture.md §6.5. Dense forms, [B, T] rows:

    q, k: [B, T, Hk, dk] (post conv+SiLU, not yet L2-normed); v: [B, T, Hv, dv]
    g: [B, T, Hv] fp32 log decay (<= 0); beta: [B, T, Hv] fp32
    initial_state: [B, Hv, dk, dv] fp32 or None (zeros)
    -> (o [B, T, Hv, dv] fp32, final_state [B, Hv, dk, dv] fp32)

q and k are L2-normalised inside (eps 1e-6 inside the sqrt) and q is scaled by dk^-1/2. Value head j
reads key head j // (Hv // Hk) (repeat-interleave). Per step, with S in [dk, dv]:
    S = exp(g) S;  S += k ⊗ beta (v - Sᵀk);  o = Sᵀ q

Ragged form (`gdn_ragged_reference`), one flat stream of a step's tokens: token t belongs to row token_row[t]
(-1: padding, with g = beta = 0), row r owns tokens query_start_loc[r] .. query_start_loc[r+1]-1 and starts
from its own state; tokens never mix across rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .gdn_common import row_offsets

CHUNK_SIZE = 64
f32 = jnp.float32


def _prepare_dense(q, k, v, g, beta, initial_state):
    """Shared preamble: heads to Hv, fp32, L2 norm, query scale, head-major [B, H, T, d]; zero state if None."""
    B, T, Hk, dk = q.shape
    Hv, dv = v.shape[2], v.shape[3]
    if Hv != Hk:
        q = jnp.repeat(q, Hv // Hk, axis=2)
        k = jnp.repeat(k, Hv // Hk, axis=2)
    f32 = jnp.promote_types(v.dtype, jnp.float32)  # fp32, or fp64 in fp64 parity runs
    q, k, v = (x.astype(f32).transpose(0, 2, 1, 3) for x in (q, k, v))
    g, beta = (x.astype(f32).transpose(0, 2, 1) for x in (g, beta))
    q = q * jax.lax.rsqrt(jnp.sum(q * q, -1, keepdims=True) + 1e-6) * (dk**-0.5)
    k = k * jax.lax.rsqrt(jnp.sum(k * k, -1, keepdims=True) + 1e-6)
    if initial_state is None:
        initial_state = jnp.zeros((B, Hv, dk, dv), f32)
    return q, k, v, g, beta, initial_state.astype(f32)


def _recurrent_scan(q, k, v, g, beta, initial_state, keep_states: bool):
    q, k, v, g, beta, state = _prepare_dense(q, k, v, g, beta, initial_state)

    def step(S, xs):
        q_t, k_t, v_t, g_t, b_t = xs  # [B,H,dk], [B,H,dk], [B,H,dv], [B,H], [B,H]
        S = S * jnp.exp(g_t)[..., None, None]
        pred = jnp.einsum("bhkv,bhk->bhv", S, k_t)
        S = S + k_t[..., :, None] * (b_t[..., None] * (v_t - pred))[..., None, :]
        o_t = jnp.einsum("bhkv,bhk->bhv", S, q_t)
        return S, (o_t, S) if keep_states else o_t

    time_major = lambda x: jnp.moveaxis(x, 2, 0)  # noqa: E731  [B,H,T,...] -> [T,B,H,...]
    state, ys = jax.lax.scan(step, state, (time_major(q), time_major(k), time_major(v), time_major(g), time_major(beta)))
    if keep_states:
        o, states = ys
        return jnp.moveaxis(o, 0, 1), state, jnp.moveaxis(states, 0, 1)  # states: [B, T, H, dk, dv]
    return jnp.moveaxis(ys, 0, 1), state  # o: [T,B,H,dv] -> [B,T,H,dv]


def gdn_recurrent_reference(q, k, v, g, beta, initial_state=None):
    """Token-by-token lax.scan: the definition. See the module docstring for shapes."""
    return _recurrent_scan(q, k, v, g, beta, initial_state, keep_states=False)


def gdn_recurrent_checkpoints(q, k, v, g, beta, initial_state=None):
    """The recurrence keeping the state after every step: (o, final_state, states [B, T, Hv, dk, dv]).
    Speculative verification writes one checkpoint per window position from these."""
    return _recurrent_scan(q, k, v, g, beta, initial_state, keep_states=True)


def gdn_chunked_reference(q, k, v, g, beta, initial_state=None, chunk_size: int = CHUNK_SIZE):
    """Chunked (WY / UT-transform) form, lax.scan over chunks. Same math as the recurrence.

    Inside a chunk of C steps with cumulative log decay γ: Dec_ij = exp(γ_i - γ_j) for i >= j (masked to
    -inf before exp, never factored as exp(γ_i)·exp(-γ_j), which overflows); Tm = I + strict_lower(βKKᵀ⊙Dec)
    solved as unit-lower-triangular; U = Tm⁻¹(βV), W = Tm⁻¹(β e^γ K); per chunk with entering state S:
    Vn = U - W S; O = (e^γ Q) S + (QKᵀ⊙Dec) Vn; S <- e^{γ_last} S + (e^{γ_last-γ} K)ᵀ Vn.
    """
    q, k, v, g, beta, state = _prepare_dense(q, k, v, g, beta, initial_state)
    B, H, T, dk = q.shape
    dv = v.shape[-1]
    # Short inputs (decode, verify windows) use a chunk of the next power of two >= T: a single-token
    # step padded to 64 would cost 64x the work in the intra-chunk solve and products.
    C = min(chunk_size, 1 << max(T - 1, 0).bit_length())
    pad = (-T) % C
    if pad:
        # Zero k, v, beta and g on padded steps: they neither decay nor write the state.
        padt = lambda x: jnp.pad(x, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3))  # noqa: E731
        q, k, v, g, beta = (padt(x) for x in (q, k, v, g, beta))
    N = (T + pad) // C
    chunks = lambda x: x.reshape(B, H, N, C, *x.shape[3:])  # noqa: E731
    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))

    gamma = jnp.cumsum(g, axis=-1)  # [B,H,N,C]
    causal = jnp.tril(jnp.ones((C, C), bool))
    log_dec = jnp.where(causal, gamma[..., :, None] - gamma[..., None, :], -jnp.inf)
    dec = jnp.exp(log_dec)  # [B,H,N,C,C], zero above the diagonal
    k_beta = k * beta[..., None]
    system = jnp.einsum("...id,...jd->...ij", k_beta, k) * dec
    system = jnp.where(jnp.tril(jnp.ones((C, C), bool), -1), system, 0.0) + jnp.eye(C, dtype=system.dtype)
    rhs = jnp.concatenate([v * beta[..., None], k_beta * jnp.exp(gamma)[..., None]], axis=-1)
    solved = jax.lax.linalg.triangular_solve(system, rhs, left_side=True, lower=True, unit_diagonal=True)
    u, w = solved[..., :dv], solved[..., dv:]
    intra = jnp.einsum("...id,...jd->...ij", q, k) * dec  # includes the diagonal
    q_dec = q * jnp.exp(gamma)[..., None]
    k_dec = k * jnp.exp(gamma[..., -1:] - gamma)[..., None]
    chunk_decay = jnp.exp(gamma[..., -1])  # [B,H,N]

    def step(S, xs):
        u_c, w_c, intra_c, q_c, k_c, decay_c = xs
        v_new = u_c - jnp.einsum("bhcd,bhdv->bhcv", w_c, S)
        o_c = jnp.einsum("bhcd,bhdv->bhcv", q_c, S) + jnp.einsum("bhij,bhjv->bhiv", intra_c, v_new)
        S = S * decay_c[..., None, None] + jnp.einsum("bhcd,bhcv->bhdv", k_c, v_new)
        return S, o_c

    chunk_major = lambda x: jnp.moveaxis(x, 2, 0)  # noqa: E731
    state, o = jax.lax.scan(
        step, state, tuple(chunk_major(x) for x in (u, w, intra, q_dec, k_dec, chunk_decay))
    )
    o = jnp.moveaxis(o, 0, 2).reshape(B, H, N * C, dv)[:, :, :T]
    return o.transpose(0, 2, 1, 3), state


def _prepare_ragged(q, k, v, g, beta):
    """Heads to Hv, fp32 (or wider), L2-normed q and k, q scaled: [T, Hv, d] each, g and beta [T, Hv]."""
    Hk, dk = q.shape[1], q.shape[2]
    Hv = v.shape[1]
    if Hv != Hk:
        q = jnp.repeat(q, Hv // Hk, axis=1)
        k = jnp.repeat(k, Hv // Hk, axis=1)
    wide = jnp.promote_types(v.dtype, f32)
    q, k, v, g, beta = (a.astype(wide) for a in (q, k, v, g, beta))
    q = q * lax.rsqrt(jnp.sum(q * q, -1, keepdims=True) + 1e-6) * (dk**-0.5)
    k = k * lax.rsqrt(jnp.sum(k * k, -1, keepdims=True) + 1e-6)
    return q, k, v, g, beta


def gdn_ragged_reference(q, k, v, g, beta, token_row, query_start_loc, initial_state, num_checkpoints: int = 1):
    """The recurrence token by token (lax.scan over the stream), each token updating its row's state.

    q, k [T, Hk, dk], v [T, Hv, dv], g, beta [T, Hv] fp32, initial_state [R, Hv, dk, dv] fp32 -> o [T, Hv, dv]
    fp32 (zeros on padding), final states [R, Hv, dk, dv], and the states after each of a row's first W =
    num_checkpoints tokens [R, W, Hv, dk, dv] (the final state past the row's end)."""
    R = initial_state.shape[0]
    W = num_checkpoints
    q, k, v, g, beta = _prepare_ragged(q, k, v, g, beta)
    valid, row, offset = row_offsets(token_row, query_start_loc)
    states = initial_state.astype(q.dtype)
    checkpoints = jnp.zeros((R, W, *states.shape[1:]), states.dtype)

    def step(carry, xs):
        states, checkpoints = carry
        q_t, k_t, v_t, g_t, b_t, ok, r, i = xs  # [Hv, d] / [Hv]
        S = states[r] * jnp.exp(g_t)[:, None, None]
        pred = jnp.einsum("hkv,hk->hv", S, k_t)
        S = S + k_t[:, :, None] * (b_t[:, None] * (v_t - pred))[:, None, :]
        o_t = jnp.einsum("hkv,hk->hv", S, q_t)
        states = states.at[r].set(jnp.where(ok, S, states[r]))
        c = jnp.minimum(i, W - 1)
        checkpoints = checkpoints.at[r, c].set(jnp.where(ok & (i < W), S, checkpoints[r, c]))
        return (states, checkpoints), jnp.where(ok, o_t, 0)

    (states, checkpoints), o = lax.scan(step, (states, checkpoints), (q, k, v, g, beta, valid, row, offset))
    n = query_start_loc[1:] - query_start_loc[:-1]
    past_end = (jnp.arange(W)[None, :] >= n[:, None])[..., None, None, None]
    checkpoints = jnp.where(past_end, states[:, None], checkpoints)
    return o, states, checkpoints
