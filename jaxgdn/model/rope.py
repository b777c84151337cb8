"""Partial rotate-half RoPE of Qwen3.5 full attention (docs/qwen35-architecture.md §5).

Text-only positions: the three M-RoPE axes carry the same position, so the interleaved frequency
assignment reduces to plain 1-D partial RoPE over the first `rotary_dim` dims of each head.
"""

import jax.numpy as jnp

from .config import ModelConfig


def rope_cos_sin(cfg: ModelConfig, positions, dtype):
    """positions: [B, T] int -> cos, sin: [B, T, R] in `dtype` (frequencies duplicated, not interleaved)."""
    R = cfg.rotary_dim
    f = jnp.promote_types(dtype, jnp.float32)  # fp32 (fp64 in fp64 parity runs)
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, R, 2, dtype=f) / R))  # [R/2]
    angles = positions.astype(f)[..., None] * inv_freq  # [B, T, R/2]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def apply_rope(x, cos, sin):
    """x: [B, T, heads, D]; cos/sin: [B, T, R]. Rotates pairs (j, j + R/2) of the first R dims."""
    R = cos.shape[-1]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    x_rot, x_pass = x[..., :R], x[..., R:]
    half = R // 2
    rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    return jnp.concatenate([x_rot * cos + rotated * sin, x_pass], axis=-1)
