"""Dense per-sequence caches for the model's incremental forward (the engine keeps its own paged pools).

A `ModelCache` holds, per layer, either a `KVCache` (full attention) or a `GDNState` (conv window +
fp32 recurrent state), plus `lengths[B]`: how many tokens of each sequence are already in the cache.
The MTP head uses a ModelCache of its own whose layers are all KVCache.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import struct

from .config import FULL_ATTENTION, ModelConfig

Array = Any


@struct.dataclass
class KVCache:
    k: Array  # [B, S_max, Hkv, D], position p at index p
    v: Array  # [B, S_max, Hkv, D]


@struct.dataclass
class GDNState:
    conv: Array  # [B, Kc-1, C] last Kc-1 pre-conv inputs, oldest first (activation dtype)
    ssm: Array  # [B, Hv, dk, dv] recurrent state, always fp32


@struct.dataclass
class ModelCache:
    layers: tuple  # per layer: KVCache or GDNState
    lengths: Array  # [B] int32 tokens already cached


def empty_kv(cfg: ModelConfig, batch: int, max_len: int, dtype) -> KVCache:
    shape = (batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def empty_gdn_state(cfg: ModelConfig, batch: int, dtype) -> GDNState:
    return GDNState(
        conv=jnp.zeros((batch, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim), dtype),
        ssm=jnp.zeros(
            (batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim), jnp.float32
        ),
    )


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> ModelCache:
    """An empty trunk cache with room for `max_len` tokens per sequence."""
    layers = tuple(
        empty_kv(cfg, batch, max_len, dtype) if t == FULL_ATTENTION else empty_gdn_state(cfg, batch, dtype)
        for t in cfg.layer_types
    )
    return ModelCache(layers=layers, lengths=jnp.zeros((batch,), jnp.int32))


def init_mtp_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> ModelCache:
    """An empty KV cache for the MTP head's decoder layer(s)."""
    layers = tuple(empty_kv(cfg, batch, max_len, dtype) for _ in range(cfg.mtp_num_hidden_layers))
    return ModelCache(layers=layers, lengths=jnp.zeros((batch,), jnp.int32))
