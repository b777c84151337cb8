"""Gated full attention of Qwen3.5 (docs/qwen35-architecture.md §4) over this step's tokens and an optional dense KV cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .cache import KVCache
from .config import ModelConfig
from .mlp import linear, project
from .norms import rms_norm_1p, upcast
from .rope import apply_rope, rope_cos_sin


def project_qkv_gate(p, cfg: ModelConfig, x, positions):
    """x: [B, T, H] (input-normed) -> q [B,T,Hq,D], k/v [B,T,Hkv,D] (normed, rotated), gate [B,T,Hq*D]."""
    B, T, _ = x.shape
    D = cfg.head_dim
    # q_proj packs [query_h ‖ gate_h] per head; splitting the flat output in two halves would be wrong.
    Hq, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    qg, k, v = project(x, p, (2 * Hq * D, Hkv * D, Hkv * D))  # q_proj (with the gate), k_proj, v_proj
    qg = qg.reshape(B, T, Hq, 2 * D)
    query, gate = qg[..., :D], qg[..., D:].reshape(B, T, -1)
    q = rms_norm_1p(query, p.q_norm, cfg.rms_norm_eps)
    k = rms_norm_1p(k.reshape(B, T, Hkv, D), p.k_norm, cfg.rms_norm_eps)
    v = v.reshape(B, T, Hkv, D)
    cos, sin = rope_cos_sin(cfg, positions, x.dtype)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, gate


def gqa_attention(q, k, v, q_positions, k_positions, k_valid=None):
    """Causal GQA softmax attention.

    q: [B, T, Hq, D]; k, v: [B, S, Hkv, D]; q_positions: [B, T]; k_positions: [B, S];
    k_valid: optional [B, S] bool. Key s is visible to query t iff k_pos[s] <= q_pos[t] (and valid).
    Returns [B, T, Hq, D] in q.dtype; softmax in fp32, probabilities cast back as HF eager does.
    """
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    qg = q.reshape(B, T, Hkv, Hq // Hkv, D)  # query head h reads kv head h // (Hq/Hkv)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k) * (D**-0.5)
    visible = k_positions[:, None, :] <= q_positions[:, :, None]  # [B, T, S]
    if k_valid is not None:
        visible = visible & k_valid[:, None, :]
    scores = upcast(scores)
    # The dtype's minimum, not -inf: a row with no visible key (a padding row) gets finite weights.
    scores = jnp.where(visible[:, None, None], scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(B, T, Hq, D)


def write_kv(kv: KVCache, k, v, start) -> KVCache:
    """Write k, v [B, T, Hkv, D] at positions start[b] .. start[b]+T-1 of each sequence."""

    def put(cache_b, new_b, s):
        return jax.lax.dynamic_update_slice(cache_b, new_b.astype(cache_b.dtype), (s, 0, 0))

    return KVCache(k=jax.vmap(put)(kv.k, k, start), v=jax.vmap(put)(kv.v, v, start))


def attention_layer(p, cfg: ModelConfig, x, positions, kv: KVCache | None, start):
    """Gated attention. x: [B, T, H]; positions: [B, T]; kv: dense cache or None; start: [B] cache lengths.

    Returns (out [B, T, H], updated kv or None).
    """
    q, k, v, gate = project_qkv_gate(p, cfg, x, positions)
    if kv is None:
        attn = gqa_attention(q, k, v, positions, positions)
    else:
        kv = write_kv(kv, k, v, start)
        S = kv.k.shape[1]
        k_pos = jnp.broadcast_to(jnp.arange(S, dtype=positions.dtype), (x.shape[0], S))
        attn = gqa_attention(q, kv.k, kv.v, positions, k_pos)
    B, T = x.shape[:2]
    o = attn.reshape(B, T, -1) * jax.nn.sigmoid(gate)
    return linear(o, p.o_proj), kv
