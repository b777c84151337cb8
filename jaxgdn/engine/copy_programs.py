"""The state copy programs' functions (jitted and compiled by `state_copies.StateCopies`): gathers from and writes
into an engine's pools for PD handoffs (export, import, in-process transfer), prefix-cache snapshots and page copies.
Pure functions of the state and int32 index arrays; padding entries name the null page, slot or snapshot."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ..model.config import ModelConfig
from .state import EngineState, PagedKV


def attention_pools(cfg: ModelConfig, state: EngineState) -> list[PagedKV]:
    return [state.layers[i] for i in cfg.attention_layer_ids]


def _stack(xs: list, like) -> jax.Array:
    return jnp.stack(xs) if xs else jnp.zeros((0,), like)


def gather_pages(cfg: ModelConfig, state: EngineState, pages) -> tuple:
    """pages [P] -> (kv_k, kv_v) [n_attention, P, page_size, Hkv, D], (mtp_k, mtp_v) [n_mtp, P, ...] ((0,) without MTP)."""
    attn, mtp = attention_pools(cfg, state), list(state.mtp_layers)
    dt = attn[0].k.dtype if attn else jnp.float32
    return (_stack([kv.k[pages] for kv in attn], dt), _stack([kv.v[pages] for kv in attn], dt),
            _stack([kv.k[pages] for kv in mtp], dt), _stack([kv.v[pages] for kv in mtp], dt))


def gather_slots(cfg: ModelConfig, state: EngineState, slots) -> tuple:
    """slots [H] -> their committed GDN state after a prefill (checkpoint 0, conv window at offset 0):
    conv [n_gdn, H, Kc-1, C], ssm [n_gdn, H, Hv, dk, dv] fp32."""
    kc1 = cfg.linear_conv_kernel_dim - 1
    gdn = [state.layers[i] for i in cfg.gdn_layer_ids]
    return (_stack([g.conv[slots, :kc1] for g in gdn], jnp.float32),
            _stack([g.ssm[slots, 0] for g in gdn], jnp.float32))


def write_pages(cfg: ModelConfig, state: EngineState, kv_k, kv_v, mtp_k, mtp_v, pages) -> EngineState:
    """Write pages' KV [.., P, ...] (gather_pages' layout) at pages [P] of every attention pool."""
    layers = list(state.layers)
    for a, i in enumerate(cfg.attention_layer_ids):
        kv = layers[i]
        layers[i] = PagedKV(k=kv.k.at[pages].set(kv_k[a].astype(kv.k.dtype)),
                            v=kv.v.at[pages].set(kv_v[a].astype(kv.v.dtype)))
    mtp = tuple(PagedKV(k=kv.k.at[pages].set(mtp_k[m].astype(kv.k.dtype)),
                        v=kv.v.at[pages].set(mtp_v[m].astype(kv.v.dtype))) for m, kv in enumerate(state.mtp_layers))
    return dataclasses.replace(state, layers=tuple(layers), mtp_layers=mtp)


def write_slots(cfg: ModelConfig, state: EngineState, conv, ssm, slots, lengths, clear_drafts: bool = True) -> EngineState:
    """Start slots [H] after lengths [H] tokens with committed GDN state conv [n_gdn, H, Kc-1, C], ssm [n_gdn, H, ...]
    at checkpoint 0 (num_accepted 1; clear_drafts: drafts -1). The other checkpoints are written before they are
    read."""
    kc1 = cfg.linear_conv_kernel_dim - 1
    layers = list(state.layers)
    for g, i in enumerate(cfg.gdn_layer_ids):
        pool = layers[i]
        layers[i] = pool.replace(conv=pool.conv.at[slots, :kc1].set(conv[g].astype(pool.conv.dtype)),
                                 ssm=pool.ssm.at[slots, 0].set(ssm[g].astype(pool.ssm.dtype)))
    drafts = state.draft_tokens.at[slots].set(-1) if clear_drafts else state.draft_tokens
    return dataclasses.replace(state, layers=tuple(layers), draft_tokens=drafts,
                               num_accepted=state.num_accepted.at[slots].set(1),
                               num_computed=state.num_computed.at[slots].set(lengths))


def export_arrays(cfg: ModelConfig, state: EngineState, pages, slot, from_pools=None) -> tuple:
    """A handoff's six arrays (HANDOFF_ARRAYS) of the request at pages [P] and slot [1]; from_pools: the conv
    channel order of the pools to undo (tensor parallelism; the handoff carries the single-device order)."""
    conv, ssm = gather_slots(cfg, state, slot)
    conv = conv[:, 0] if from_pools is None else conv[:, 0][..., np.argsort(np.asarray(from_pools))]
    return (*gather_pages(cfg, state, pages), conv, ssm[:, 0])


def import_arrays(cfg: ModelConfig, state: EngineState, arrays: tuple, pages, slot, length, to_pools=None) -> EngineState:
    """Write a handoff's arrays (export_arrays' layout, single-device conv order; to_pools: the pools' order) at
    pages [P] and slot [1]."""
    kv_k, kv_v, mtp_k, mtp_v, conv, ssm = arrays
    if to_pools is not None:
        conv = conv[..., np.asarray(to_pools)]
    state = write_pages(cfg, state, kv_k, kv_v, mtp_k, mtp_v, pages)
    return write_slots(cfg, state, conv[:, None], ssm[:, None], slot, length)


def transfer(cfg: ModelConfig, state: EngineState, source: EngineState, src_pages, pages, src_slots, slots,
             lengths) -> EngineState:
    """Copy requests from source's pools (a prefill worker on the same devices, the same layout) into state's."""
    state = write_pages(cfg, state, *gather_pages(cfg, source, src_pages), pages)
    return write_slots(cfg, state, *gather_slots(cfg, source, src_slots), slots, lengths)


def save_snapshots(cfg: ModelConfig, snapshots: tuple, state: EngineState, slots, snapshot_ids) -> tuple:
    """Copy each slot's committed GDN state [COPIES] into snapshots [COPIES]. Returns the snapshot pools."""
    kc1 = cfg.linear_conv_kernel_dim - 1
    offset = state.num_accepted[slots] - 1  # [M] the committed checkpoint
    new = []
    for i, snap in zip(cfg.gdn_layer_ids, snapshots):
        pool = state.layers[i]
        window = jax.vmap(lambda c, o: jax.lax.dynamic_slice_in_dim(c, o, kc1, axis=0))(pool.conv[slots], offset)
        new.append(snap.replace(conv=snap.conv.at[snapshot_ids].set(window),
                                ssm=snap.ssm.at[snapshot_ids].set(pool.ssm[slots, offset])))
    return tuple(new)


def restore_snapshots(cfg: ModelConfig, state: EngineState, snapshots: tuple, snapshot_ids, slots, lengths) -> EngineState:
    """Copy snapshots [COPIES] into each slot's checkpoint 0; the slot resumes after lengths [COPIES] tokens."""
    conv = jnp.stack([s.conv[snapshot_ids] for s in snapshots])
    ssm = jnp.stack([s.ssm[snapshot_ids] for s in snapshots])
    return write_slots(cfg, state, conv, ssm, slots, lengths, clear_drafts=False)


def copy_pages(state: EngineState, src, dst) -> EngineState:
    """Copy KV pages src [COPIES] onto pages dst [COPIES] in every attention pool (the trunk's and the MTP layer's)."""
    copy = lambda kv: kv.replace(k=kv.k.at[dst].set(kv.k[src]), v=kv.v.at[dst].set(kv.v[src]))  # noqa: E731
    layers = tuple(copy(x) if isinstance(x, PagedKV) else x for x in state.layers)
    return dataclasses.replace(state, layers=layers, mtp_layers=tuple(copy(x) for x in state.mtp_layers))
