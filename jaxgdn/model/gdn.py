"""Gated DeltaNet layer of Qwen3.5 (docs/qwen35-architecture.md §6): projections, causal conv, gates, core, gated norm."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.gdn_reference import gdn_chunked_reference, gdn_recurrent_reference

from .cache import GDNState, empty_gdn_state
from .config import ModelConfig
from .mlp import linear, project, split_outputs
from .norms import gated_rms_norm, upcast


def causal_conv_silu(mixed, window, conv_weight, num_valid=None):
    """Depthwise causal conv + SiLU over full = [window ‖ mixed], which is never built: the taps read a
    zero-padded `mixed` and the window's taps, which reach only the first Kc-1 outputs, are a small
    correction added to those. XLA then fuses the conv into one pass over `mixed` (building the
    concatenation, or concatenating per tap, costs passes of its own).

    mixed: [B, T, C] new pre-conv inputs; window: [B, Kc-1, C] previous inputs (oldest first);
    conv_weight: [C, 1, Kc] with tap Kc-1 on the current token; num_valid: optional [B] count of real
    tokens per row (the rest is right padding).
    Returns (out [B, T, C] in mixed.dtype, new window [B, Kc-1, C] = the last Kc-1 real inputs).
    """
    T = mixed.shape[1]
    Kc = conv_weight.shape[-1]
    window = window.astype(mixed.dtype)
    w = upcast(conv_weight[:, 0, :])  # [C, Kc]
    padded = jnp.pad(mixed, [(0, 0), (Kc - 1, 0), (0, 0)])
    # Output t < Kc-1 also reads window[t + j] through tap j while t + j < Kc-1.
    window_taps = sum(jnp.pad(upcast(window[:, j:]), [(0, 0), (0, j), (0, 0)]) * w[:, j] for j in range(Kc - 1))
    window_taps = jnp.pad(window_taps, [(0, 0), (0, max(T - (Kc - 1), 0)), (0, 0)])[:, :T]
    acc = sum(upcast(padded[:, j : j + T]) * w[:, j] for j in range(Kc)) + window_taps
    return jax.nn.silu(acc).astype(mixed.dtype), conv_window_after(window, mixed, num_valid)


def conv_window_after(window, mixed, num_valid=None):
    """The conv window after a step: full[n : n + Kc-1] of full = [window ‖ mixed] for each row with n
    real tokens (the end of the window and/or of mixed), by two small gathers. window [B, Kc-1, C];
    mixed [B, T, C]; num_valid [B] or None (all T). Returns [B, Kc-1, C] in mixed.dtype."""
    B, T = mixed.shape[:2]
    Km1 = window.shape[1]
    window = window.astype(mixed.dtype)
    n = jnp.full((B,), T, jnp.int32) if num_valid is None else num_valid
    at = n[:, None] + jnp.arange(Km1)  # [B, Kc-1] indices into full
    from_mixed = jnp.take_along_axis(mixed, jnp.clip(at - Km1, 0, T - 1)[..., None], axis=1)
    from_window = jnp.take_along_axis(window, jnp.clip(at, 0, Km1 - 1)[..., None], axis=1)
    return jnp.where((at < Km1)[..., None], from_window, from_mixed)


def gdn_gates(p, a, b):
    """a, b: [B, T, Hv] -> (g log decay, beta) both fp32. g = -exp(A_log) * softplus(a + dt_bias).
    beta = sigmoid(b) computed in fp32 and rounded once to b's dtype, as torch's bf16 sigmoid does (the
    reference's) and as the kernels do (`gdn_common.gate_values`); XLA's bf16 sigmoid would round each of
    its ops, differing in the last bit for ~30% of values."""
    beta = upcast(jax.nn.sigmoid(upcast(b)).astype(b.dtype))
    g = -jnp.exp(upcast(p.A_log)) * jax.nn.softplus(upcast(a) + upcast(p.dt_bias))
    return g, beta


def gdn_projections(p, cfg: ModelConfig, x, num_valid=None):
    """The GDN layer's input projections and gates. x: [B, T, H] (input-normed); num_valid: optional [B]
    real tokens per row, padded steps get g = 0 and beta = 0 (they neither decay nor write).
    Returns (source [B, T, >=C] whose first C channels are the pre-conv q‖k‖v: the fused projection's
    whole product when p.fused, so a kernel reads them without a sliced copy; mixed [B, T, C] those
    channels; z [B, T, Hv, dv]; g, beta [B, T, Hv] fp32)."""
    B, T, _ = x.shape
    Hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    sizes = (cfg.conv_dim, cfg.linear_value_dim, Hv, Hv)  # in_proj_qkv, _z, _b, _a
    if p.fused is None:
        mixed, z, b, a = project(x, p, sizes)
        source = mixed
    else:
        source = linear(x, p.fused)
        mixed, z, b, a = split_outputs(source, sizes)
    g, beta = gdn_gates(p, a, b)
    if num_valid is not None:
        valid = (jnp.arange(T)[None, :] < num_valid[:, None])[..., None]
        g, beta = jnp.where(valid, g, 0.0), jnp.where(valid, beta, 0.0)
    return source, mixed, z.reshape(B, T, Hv, dv), g, beta


def split_qkv(cfg: ModelConfig, u):
    """u [B, T, C] conv output -> q, k [B, T, Hk, dk], v [B, T, Hv, dv]."""
    B, T, _ = u.shape
    Kd = cfg.linear_key_dim
    q = u[..., :Kd].reshape(B, T, cfg.linear_num_key_heads, cfg.linear_key_head_dim)
    k = u[..., Kd : 2 * Kd].reshape(B, T, cfg.linear_num_key_heads, cfg.linear_key_head_dim)
    v = u[..., 2 * Kd :].reshape(B, T, cfg.linear_num_value_heads, cfg.linear_value_head_dim)
    return q, k, v


def gdn_output(p, cfg: ModelConfig, o, z, dtype):
    """Gated RMS norm and out_proj: o [B, T, Hv, dv] core output -> [B, T, H]."""
    B, T = o.shape[:2]
    y = gated_rms_norm(o.astype(dtype), z, p.norm, cfg.rms_norm_eps, dtype)
    return linear(y.reshape(B, T, -1), p.out_proj)


def gdn_layer(p, cfg: ModelConfig, x, state: GDNState | None, num_valid=None, chunked: bool = True):
    """x: [B, T, H] (input-normed); state: conv window + recurrent state, or None (zeros);
    num_valid: optional [B] real tokens per row. Padded steps get g = 0 and beta = 0, so they neither
    decay nor write the state: padding is a no-op. chunked: the recurrence's chunked XLA form, else the
    token-by-token scan (the same math). Returns (out [B, T, H], new GDNState)."""
    B, T, _ = x.shape
    if state is None:
        state = empty_gdn_state(cfg, B, x.dtype)
    _, mixed, z, g, beta = gdn_projections(p, cfg, x, num_valid)
    u, conv = causal_conv_silu(mixed, state.conv, p.conv1d, num_valid)
    recurrence = gdn_chunked_reference if chunked else gdn_recurrent_reference
    o, ssm = recurrence(*split_qkv(cfg, u), g, beta, state.ssm)
    return gdn_output(p, cfg, o, z, x.dtype), GDNState(conv=conv, ssm=ssm)
