"""The model over one engine step's flat ragged token stream, reading and writing the paged KV pools and
the GDN slots.

Every token mixer reads the stream as it is: tokens [T] with the row of each (token_row, -1 for padding)
and each row's tokens at query_start_loc[r] .. query_start_loc[r+1]-1. Attention writes this step's K/V at
each token's pool slot and attends over the row's pages (`pallas_kernels/ragged_attention.py`); a GDN layer
convolves and runs the recurrence of each row from its slot's state (`pallas_kernels/gdn_ragged.py`) and
commits the new state. No [rows, width] padding exists anywhere: a step's activations are O(T) whatever
the rows' widths and contexts. Padding tokens are no-ops: their KV writes go to the null page, their GDN
steps neither decay nor write, and padding rows use the null slot.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from pallas_kernels.gdn_ragged import gdn_ragged_reference, ragged_causal_conv
from pallas_kernels.gdn_ragged_pallas import gdn_ragged_pallas
from pallas_kernels.gdn_ragged_pallas import kernels_support as gdn_kernels_support
from pallas_kernels.prompt_qkv import prompt_qkv, prompt_qkv_supports
from pallas_kernels.ragged_attention import kernel_supports as ragged_kernel_supports
from pallas_kernels.ragged_attention import ragged_paged_attention, ragged_paged_attention_reference

from ..model.attention import project_qkv_gate
from ..model.config import FULL_ATTENTION, ModelConfig
from ..model.forward import residual_block
from ..model.gdn import gdn_output, gdn_projections, split_qkv
from ..model.mlp import linear
from ..model.mtp import mtp_fc_input
from ..model.norms import rms_norm_1p
from ..model.parallel import embed
from ..model.params import ModelParams
from ..model.policy import KernelPolicy
from ..model.rope import rope_cos_sin
from .pools import read_conv, read_ssm, write_conv, write_kv, write_ssm
from .state import EngineState, GDNSlots, PagedKV

Array = Any


@struct.dataclass
class StepMeta:
    """A step's layout on the device (shapes are the program's: T tokens, R rows, MP pages a row)."""

    positions: Array  # [T] absolute position of each token (0 for padding)
    token_row: Array  # [T] row of each token, -1 for padding
    kv_slots: Array  # [T] flat KV pool slot each token writes (page * page_size + offset); null page for padding
    query_start_loc: Array  # [R+1] row r owns tokens [qsl[r], qsl[r+1])
    seq_lens: Array  # [R] tokens of the row's sequence after this step
    idx_mapping: Array  # [R] persistent request slot (0 = null slot)
    block_tables: Array  # [R, MP] page ids of each row (0 = null page beyond the allocation)
    fresh: Array  # [R] bool: the row starts from an empty state (first chunk of a (re)computation)
    verify_path: Array  # [R] bool: GDN state writes one checkpoint per window position (spec rows)
    block_row: Array  # [NB] the attention kernel's query blocks: row of each (-1: unused)
    block_start: Array  # [NB] first token of each block

    @property
    def valid(self):
        return self.token_row >= 0


def uses_attention_kernel(cfg: ModelConfig, page_size: int, policy: KernelPolicy) -> bool:
    """Whether the ragged attention runs the Pallas kernel: policy.attention_kernels, where its tiles fit."""
    return policy.attention_kernels and ragged_kernel_supports(cfg.head_dim, page_size, cfg.num_attention_heads,
                                                               cfg.num_key_value_heads)


def use_prompt_qkv_kernel(p, cfg: ModelConfig, policy: KernelPolicy) -> bool:
    """Whether q/k/v come from the fused projection through one kernel (`pallas_kernels/prompt_qkv.py`: the
    split, q/k norms and RoPE): policy.attention_kernels, fused weights, halves of RoPE that are tiles."""
    return policy.attention_kernels and p.fused is not None and prompt_qkv_supports(cfg.head_dim, cfg.rotary_dim)


def project_qkv_gate_flat(p, cfg: ModelConfig, h, positions, policy: KernelPolicy):
    """`attention.project_qkv_gate` of the stream h [T, H], positions [T]: q [T, Hq, D], k, v [T, Hkv, D],
    gate [T, Hq*D]; through the one kernel where `use_prompt_qkv_kernel`."""
    T, H = h.shape
    if not use_prompt_qkv_kernel(p, cfg, policy):
        q, k, v, gate = project_qkv_gate(p, cfg, h.reshape(1, T, H), positions[None])
        return q[0], k[0], v[0], gate[0]
    Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    y = linear(h, p.fused)
    cos, sin = rope_cos_sin(cfg, positions[None], h.dtype)
    q, k, v = prompt_qkv(y[None], p.q_norm, p.k_norm, cfg.rms_norm_eps, cos, sin, Hq, Hkv, D)
    gate = y[:, : 2 * Hq * D].reshape(T, Hq, 2 * D)[..., D:].reshape(T, Hq * D)
    return q[0], k[0], v[0], gate


def attention_ragged(p, cfg: ModelConfig, h, meta: StepMeta, kv: PagedKV, policy: KernelPolicy):
    """Gated attention of the flat stream h [T, H] (or a DeferredNorm of it): write this step's K/V at each
    token's slot, attend over each row's pages. Returns (out [T, H], new pools)."""
    T = meta.positions.shape[0]
    q, k, v, gate = project_qkv_gate_flat(p, cfg, h, meta.positions, policy)
    k_pool, v_pool = write_kv(kv, meta.kv_slots, k, v, policy.attention_kernels)
    if uses_attention_kernel(cfg, kv.k.shape[1], policy):
        attn = ragged_paged_attention(q, k_pool, v_pool, meta.positions, meta.block_tables, meta.seq_lens,
                                      meta.query_start_loc, meta.block_row, meta.block_start)
    else:
        attn = ragged_paged_attention_reference(q, k_pool, v_pool, meta.token_row, meta.positions, meta.block_tables,
                                                meta.seq_lens)
    o = attn.reshape(T, -1) * jax.nn.sigmoid(gate)
    return linear(o, p.o_proj), PagedKV(k=k_pool, v=v_pool)


def uses_gdn_kernels(cfg: ModelConfig, policy: KernelPolicy) -> bool:
    """Whether the ragged GDN recurrence runs the Pallas kernels (`pallas_kernels/gdn_ragged_pallas.py`):
    policy.gdn_kernels, head sizes that are Triton tiles."""
    return policy.gdn_kernels and gdn_kernels_support(cfg.linear_key_head_dim, cfg.linear_value_head_dim)


def gdn_ragged(p, cfg: ModelConfig, h, meta: StepMeta, slots: GDNSlots, num_accepted, policy: KernelPolicy):
    """The GDN layer over the flat stream h [T, H]: projections, each row's conv from its window, the
    recurrence from its committed state, the gated norm and out_proj; the rows' new states (and a verify
    row's checkpoints) go into the slot pool. Returns (out [T, H], new slots)."""
    T = meta.positions.shape[0]
    kc = cfg.linear_conv_kernel_dim
    W = slots.ssm.shape[1]  # 1 + K checkpoints
    _, mixed, z, g, beta = gdn_projections(p, cfg, h.reshape(1, T, h.shape[-1]))
    valid = meta.valid[:, None]
    g, beta = jnp.where(valid, g[0], 0.0), jnp.where(valid, beta[0], 0.0)  # padding neither decays nor writes
    offset = num_accepted[meta.idx_mapping] - 1  # [R] each row's committed checkpoint
    windows = read_conv(slots, meta, offset, kc)
    u, window, buffers = ragged_causal_conv(mixed[0], p.conv1d, windows, meta.token_row, meta.query_start_loc, W)
    conv = write_conv(slots, meta, window, buffers if W > 1 else None)
    q, k, v = (x[0] for x in split_qkv(cfg, u[None]))
    if uses_gdn_kernels(cfg, policy):  # the pool read and written in place
        o, ssm = gdn_ragged_pallas(q, k, v, g, beta, slots.ssm, meta.query_start_loc, meta.idx_mapping, offset,
                                   meta.fresh, meta.verify_path)
    else:
        start = read_ssm(slots, meta, offset)
        o, final, states = gdn_ragged_reference(q, k, v, g, beta, meta.token_row, meta.query_start_loc, start, W)
        ssm = write_ssm(slots, meta, final, states if W > 1 else None)
    out = gdn_output(p, cfg, o[None], z, h.dtype)[0]
    return out, GDNSlots(conv=conv, ssm=ssm)


@functools.partial(jax.jit, static_argnames=("cfg", "attention", "policy"))
def _ragged_layer(p, x, layer_state, meta: StepMeta, num_accepted, *, cfg: ModelConfig, attention: bool,
                  policy: KernelPolicy):
    """One decoder layer on the flat stream x [T, H]. Its own jit, called inside the step's trace: the
    layers of a kind share one traced and lowered function, which XLA inlines before it optimizes."""

    def mixer(h):
        if attention:
            return attention_ragged(p.mixer, cfg, h, meta, layer_state, policy)
        return gdn_ragged(p.mixer, cfg, h, meta, layer_state, num_accepted, policy)

    return residual_block(p, cfg, x, mixer, policy)


def forward_ragged(params: ModelParams, cfg: ModelConfig, input_ids, meta: StepMeta, state: EngineState,
                   policy: KernelPolicy):
    """input_ids [T] -> (hidden [T, H] after the final norm, new EngineState)."""
    x = embed(params, input_ids, cfg.vocab_size, policy)
    new_layers = []
    for i, layer_type in enumerate(cfg.layer_types):
        x, new_state = _ragged_layer(params.layers[i], x, state.layers[i], meta, state.num_accepted, cfg=cfg,
                                     attention=layer_type == FULL_ATTENTION, policy=policy)
        new_layers.append(new_state)
    hidden = rms_norm_1p(x, params.norm, cfg.rms_norm_eps)
    return hidden, dataclasses.replace(state, layers=tuple(new_layers))


def mtp_ragged(params: ModelParams, cfg: ModelConfig, hidden, next_ids, meta: StepMeta, mtp_layers: tuple,
               policy: KernelPolicy):
    """The MTP head over the flat stream: token t gets the trunk hidden at its position and the token after
    it (next_ids [T]). Writes the MTP layer's own paged KV. Returns (mtp hidden [T, H] after mtp.norm, layers)."""
    mtp = params.mtp
    x = mtp_fc_input(params, cfg, hidden, next_ids, policy)
    new_layers = []
    for layer, kv in zip(mtp.layers, mtp_layers):
        x, kv = residual_block(layer, cfg, x, lambda h, layer=layer, kv=kv: attention_ragged(
            layer.mixer, cfg, h, meta, kv, policy), policy)
        new_layers.append(kv)
    return rms_norm_1p(x, mtp.norm, cfg.rms_norm_eps), tuple(new_layers)
