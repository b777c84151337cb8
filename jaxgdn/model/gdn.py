"""Gated DeltaNet layer of Qwen3.5 (docs/qwen35-architecture.md §6): projections, causal conv, gates, core, gated norm."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.conv_pallas import causal_conv_prompt, prompt_conv_supports
from pallas_kernels.gdn import gated_delta_rule, runs_chunked_pallas, use_prompt_conv_kernel
from pallas_kernels.gdn_pallas import GateSource, OutputGate

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
    reference's) and as the kernels do (`gdn_pallas.gate_values`); XLA's bf16 sigmoid would round each of
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


class GDNInputs(NamedTuple):
    """What the GDN layer's core and output read (see `gdn_inputs`)."""

    q: jax.Array  # [B, T, Hk, dk]
    k: jax.Array  # [B, T, Hk, dk]
    v: jax.Array  # [B, T, Hv, dv]
    g: jax.Array  # [B, T, Hv] fp32 log decay
    beta: jax.Array  # [B, T, Hv] fp32
    z: jax.Array  # [B, T, Hv, dv] output gate
    conv: jax.Array  # [B, Kc-1, C] the conv window after the step
    mixed: jax.Array  # [B, T, C] the pre-conv inputs
    z_source: jax.Array  # [B, T, >=C'] an array holding z in place: the fused projection's product or z
    z_offset: int  # z's first column in z_source (value head h at z_offset + h * dv)
    gates: GateSource | None  # b and a in place in the fused product, for the chunked kernel (else None)


def gdn_inputs(p, cfg: ModelConfig, x, conv_window, num_valid=None, impl: str = "auto") -> GDNInputs:
    """Projections, gates and causal conv of the GDN layer. x: [B, T, H] (input-normed); conv_window:
    [B, Kc-1, C]. Padded steps (beyond num_valid) get g = 0 and beta = 0: they neither decay nor write.
    impl: the GDN implementation; where it runs the Pallas kernels on long rows, so does the conv
    (`causal_conv_prompt`, written straight into q, k and v)."""
    source, mixed, z, g, beta = gdn_projections(p, cfg, x, num_valid)
    B, T, _ = x.shape
    z_source, z_offset = (source, cfg.conv_dim) if p.fused is not None else (z.reshape(B, T, -1), 0)
    # the fused product's columns: q‖k‖v, z, b, a (gdn_projections' sizes)
    gates = (GateSource(source, cfg.conv_dim + cfg.linear_value_dim, p.A_log, p.dt_bias, num_valid)
             if p.fused is not None else None)
    widths = (cfg.linear_key_dim, cfg.linear_key_dim, cfg.linear_value_dim)
    if use_prompt_conv_kernel(impl, T) and prompt_conv_supports(widths, T, cfg.linear_conv_kernel_dim):
        q, k, v = causal_conv_prompt(source, widths, p.conv1d, conv_window)
        heads = lambda a, h: a.reshape(B, T, h, -1)  # noqa: E731
        q, k = heads(q, cfg.linear_num_key_heads), heads(k, cfg.linear_num_key_heads)
        v = heads(v, cfg.linear_num_value_heads)
        conv = conv_window_after(conv_window, mixed, num_valid)
        return GDNInputs(q, k, v, g, beta, z, conv, mixed, z_source, z_offset, gates)
    u, conv = causal_conv_silu(mixed, conv_window, p.conv1d, num_valid)
    return GDNInputs(*split_qkv(cfg, u), g, beta, z, conv, mixed, z_source, z_offset, gates)


def gdn_output(p, cfg: ModelConfig, o, z, dtype, normed: bool = False):
    """Gated RMS norm and out_proj: o [B, T, Hv, dv] core output -> [B, T, H]. normed: o is already
    the gated norm's output (the chunked kernel applied it)."""
    B, T = o.shape[:2]
    y = o if normed else gated_rms_norm(o.astype(dtype), z, p.norm, cfg.rms_norm_eps, dtype)
    return linear(y.reshape(B, T, -1), p.out_proj)


def gdn_layer(p, cfg: ModelConfig, x, state: GDNState | None, impl: str = "auto", num_valid=None):
    """x: [B, T, H] (input-normed); state: conv window + recurrent state, or None (zeros);
    num_valid: optional [B] real tokens per row. Padded steps get g = 0 and beta = 0, so they neither
    decay nor write the state: padding is a no-op. Returns (out [B, T, H], new GDNState)."""
    B, T, _ = x.shape
    if state is None:
        state = empty_gdn_state(cfg, B, x.dtype)
    inp = gdn_inputs(p, cfg, x, state.conv, num_valid, impl)
    # Where the chunked Pallas kernel runs, it stores its output in z's dtype for the gated norm (XLA) rather
    # than in fp32: half the bytes to memory and back.
    fused_norm = runs_chunked_pallas(impl, T)
    gate = OutputGate(inp.z_source, p.norm, cfg.rms_norm_eps, inp.z_offset) if fused_norm else None
    # There, with fused weights, its prep kernel also computes g and beta from the product in place.
    gates = inp.gates if fused_norm else None
    kernel_gates = (inp.g, inp.beta) if gates is None else (None, None)
    o, ssm = gated_delta_rule(inp.q, inp.k, inp.v, *kernel_gates, state.ssm, impl=impl, gate=gate, gates=gates)
    out = gdn_output(p, cfg, o, inp.z, x.dtype, normed=fused_norm)
    return out, GDNState(conv=inp.conv, ssm=ssm)
