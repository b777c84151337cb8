"""State pools: paged attention KV (trunk + MTP layer), GDN slots, per-slot sampling state.

Host side: a `FreeList` hands out persistent request slots (KV pages: `prefix_cache.PageCache`).
Device side: `EngineState`, one pytree donated to every jitted step.
  - attention layer i: k, v pools [num_pages, page_size, Hkv, D]; page 0 is the null page that padded
    tokens write to and no real request owns.
  - GDN layer i: conv [num_slots, Kc-1+K, C] (window at offset num_accepted-1) and ssm
    [num_slots, 1+K, Hv, dk, dv] fp32 (checkpoint num_accepted-1 is the committed state); slot 0 is
    the null slot of padded rows.
  - last_sampled [num_slots], draft_tokens [num_slots, K], num_accepted [num_slots] in [1, 1+K], stopped,
    and the penalties' output_counts [num_slots, V] and prompt_tokens [num_slots, ceil(V/32)].
Beside it, never an argument of a step program (each argument costs every launch's dispatch): the prefix cache's
snapshots (`init_snapshots`), per GDN layer conv [N, Kc-1, C] and ssm [N, Hv, dk, dv] fp32, the state after a
cached prefix (`cache_manager.py`); snapshot 0 is the null one padding copies write.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ..model.config import FULL_ATTENTION, ModelConfig
from .config import EngineConfig

Array = Any
NULL_PAGE = 0


class FreeList:
    """Ids 1..n-1 handed out lowest first; id 0 is reserved (the null page / null slot)."""

    def __init__(self, n: int, what: str):
        self.what = what
        self._free = list(range(n - 1, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"need {n} {self.what}, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, ids: list[int]) -> None:
        self._free.extend(reversed(ids))


@struct.dataclass
class PagedKV:
    k: Array  # [num_pages, page_size, Hkv, D]
    v: Array


@struct.dataclass
class GDNSlots:
    conv: Array  # [num_slots, Kc-1+K, C]
    ssm: Array  # [num_slots, 1+K, Hv, dk, dv] fp32


@struct.dataclass
class GDNSnapshots:
    conv: Array  # [num_snapshots, Kc-1, C]
    ssm: Array  # [num_snapshots, Hv, dk, dv] fp32


@struct.dataclass
class EngineState:
    layers: tuple  # per trunk layer: PagedKV or GDNSlots
    mtp_layers: tuple  # PagedKV per MTP layer (empty without MTP)
    last_sampled: Array  # [num_slots] int32
    draft_tokens: Array  # [num_slots, K] int32
    num_accepted: Array  # [num_slots] int32
    # Tokens each slot has committed (its request's num_computed), written by every step: a launch
    # scheduled before the previous one's results are back (async scheduling with MTP) starts its rows
    # there instead of at the host's guess (device_step.packed_step).
    num_computed: Array  # [num_slots] int32
    # The slot's request sampled one of its stop tokens: its rows in launches already booked run on the null
    # slot, so the slot keeps the state after its last token (the prefix cache keeps it); a new request's
    # first row clears it (device_step.packed_step).
    stopped: Array  # [num_slots] bool
    # Penalties (penalties.py): each slot's request's output token counts and its prompt's tokens as bits.
    output_counts: Array  # [num_slots, V] int32
    prompt_tokens: Array  # [num_slots, ceil(V/32)] int32


def init_engine_state(
    cfg: ModelConfig, ecfg: EngineConfig, num_pages: int, num_speculative_tokens: int = 0, with_mtp: bool = False,
    garbage_seed: int | None = None,
) -> EngineState:
    """Allocate the device pools. garbage_seed fills every buffer with random garbage (slot-hygiene tests)."""
    dt = ecfg.jnp_dtype
    S, K = ecfg.num_slots, num_speculative_tokens

    def paged():
        shape = (num_pages, ecfg.kv_page_size, cfg.num_key_value_heads, cfg.head_dim)
        return PagedKV(k=jnp.zeros(shape, dt), v=jnp.zeros(shape, dt))

    def gdn():
        return GDNSlots(
            conv=jnp.zeros((S, cfg.linear_conv_kernel_dim - 1 + K, cfg.conv_dim), dt),
            ssm=jnp.zeros((S, 1 + K, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim), jnp.float32),
        )

    state = EngineState(
        layers=tuple(paged() if t == FULL_ATTENTION else gdn() for t in cfg.layer_types),
        mtp_layers=tuple(paged() for _ in range(cfg.mtp_num_hidden_layers if with_mtp else 0)),
        last_sampled=jnp.zeros((S,), jnp.int32),
        draft_tokens=jnp.zeros((S, K), jnp.int32),
        num_accepted=jnp.ones((S,), jnp.int32),
        num_computed=jnp.zeros((S,), jnp.int32),
        stopped=jnp.zeros((S,), bool),
        output_counts=jnp.zeros((S, cfg.vocab_size), jnp.int32),
        prompt_tokens=jnp.zeros((S, -(-cfg.vocab_size // 32)), jnp.int32),
    )
    if garbage_seed is None:
        return state
    rng = np.random.default_rng(garbage_seed)
    leaves, treedef = jax.tree.flatten(state)
    noisy = []
    for x in leaves:
        if jnp.issubdtype(x.dtype, jnp.integer):
            noisy.append(jnp.asarray(rng.integers(-5, 1000, x.shape), x.dtype))
        else:
            noisy.append(jnp.asarray(rng.standard_normal(x.shape) * 3.0, x.dtype))
    return jax.tree.unflatten(treedef, noisy)


def init_snapshots(cfg: ModelConfig, ecfg: EngineConfig, num_snapshots: int) -> tuple:
    """The prefix cache's snapshot pools: a GDNSnapshots per GDN layer (empty for num_snapshots 0)."""
    if not num_snapshots:
        return ()
    return tuple(GDNSnapshots(
        conv=jnp.zeros((num_snapshots, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim), ecfg.jnp_dtype),
        ssm=jnp.zeros((num_snapshots, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim),
                      jnp.float32)) for _ in cfg.gdn_layer_ids)


__all__ = ["EngineState", "FreeList", "GDNSlots", "GDNSnapshots", "PagedKV", "init_engine_state", "init_snapshots"]
