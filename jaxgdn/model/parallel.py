"""Tensor parallelism inside a step: the collectives of a model that runs per shard under `shard_map`.

With `policy.tp_axis` set, every weight is the shard's block (`engine/tensor_parallel.py` lays them out):
column-parallel in-projections (heads, the MLP's intermediate columns, the vocabulary) and row-parallel
out-projections, so a mixer's or an MLP's output is a partial sum that one all-reduce completes. Without it
(one device) each function is the plain single-device form.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .mlp import linear
from .params import ModelParams
from .policy import KernelPolicy


def all_reduce(x, policy: KernelPolicy):
    """The sum of x over the shards: a row-parallel product's output completed."""
    return jax.lax.psum(x, policy.tp_axis) if policy.tp_axis else x


def embed(params: ModelParams, ids, vocab_size: int, policy: KernelPolicy):
    """Embedding rows of ids [...] -> [..., H]: with a vocabulary split over the shards, each looks up the ids in
    its range and the all-reduce sums the one non-zero row per id."""
    table = params.embed_tokens
    ids = jnp.clip(ids, 0, vocab_size - 1)
    if not policy.tp_axis:
        return table[ids]
    local = ids - jax.lax.axis_index(policy.tp_axis) * table.shape[0]
    mine = (local >= 0) & (local < table.shape[0])
    rows = table[jnp.clip(local, 0, table.shape[0] - 1)]
    return jax.lax.psum(jnp.where(mine[..., None], rows, 0), policy.tp_axis)


def head_logits(params: ModelParams, hidden, vocab_size: int, policy: KernelPolicy):
    """hidden [..., H] -> logits [..., V] over the whole vocabulary (the shards' columns gathered, the rows that
    pad the vocabulary to a multiple of the shards dropped)."""
    logits = linear(hidden, params.head_weight())
    if not policy.tp_axis:
        return logits
    return jax.lax.all_gather(logits, policy.tp_axis, axis=logits.ndim - 1, tiled=True)[..., :vocab_size]


def head_argmax(params: ModelParams, hidden, vocab_size: int, policy: KernelPolicy):
    """argmax of head_logits [...] int32, exact without gathering the logits: each shard's best (value, index)
    is gathered and the first shard holding the maximum wins, which is jnp.argmax's first-index rule."""
    logits = linear(hidden, params.head_weight())
    if not policy.tp_axis:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    first = jax.lax.axis_index(policy.tp_axis) * logits.shape[-1]
    padding = first + jnp.arange(logits.shape[-1]) >= vocab_size
    logits = jnp.where(padding, -jnp.inf, logits)
    local = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    best = jnp.max(logits, axis=-1).astype(jnp.float32)
    values = jax.lax.all_gather(best, policy.tp_axis, axis=best.ndim, tiled=False)  # [..., tp]
    indices = jax.lax.all_gather(local, policy.tp_axis, axis=local.ndim, tiled=False)
    shard = jnp.argmax(values, axis=-1)
    index = jnp.take_along_axis(indices, shard[..., None], axis=-1)[..., 0]
    return (shard * logits.shape[-1] + index).astype(jnp.int32)
