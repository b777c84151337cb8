"""The model over one engine step, reading and writing the paged KV pools and the GDN slots.

A ragged step (width 0) is a flat stream: tokens [T] with the row of each (token_row, -1 for padding) and
each row's tokens at query_start_loc[r] .. query_start_loc[r+1]-1. Attention writes this step's K/V at each
token's pool slot and attends over the row's pages (`pallas_kernels/ragged_attention.py`); a GDN layer
convolves and runs the recurrence of each row from its slot's state (`pallas_kernels/gdn_ragged_chunked.py`, or
`gdn_reference.py`'s XLA form) and commits the new state. No [rows, width] padding exists: a step's activations
are O(T) whatever the rows' widths and contexts.

A uniform step (width > 0: R rows of `width` tokens, plain decode rows or MTP verify windows) is the same
stream viewed as [R, width] (`RowView`). Launches of several decode or verify steps run in this form
(`programs.StepShape.width`) so that their token mixers can be the one-kernel decode forms, which hold a
row's few tokens in registers: the decode attention kernel, and the GDN mixer or the pooled conv and
recurrence kernels, each reading and writing the pools in place.

Which mixer a layer runs is one table, `pick_mixer`: from the layer's kind, the step's width and rows, the
KernelPolicy and the config. Padding is a no-op everywhere: its KV writes go to the null page, its GDN steps
neither decay nor write, and padding rows use the null slot.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from pallas_kernels.decode_attention import DecodeAttentionLayout, decode_attention_pooled, decode_attention_supports
from pallas_kernels.gdn_common import SHORT_ROW, GateSource, tiles_supported
from pallas_kernels.gdn_conv import causal_conv_pooled, conv_kernel_supports, ragged_causal_conv
from pallas_kernels.gdn_decode import gdn_mixer_pooled, gdn_recurrent_pooled, mixer_kernel_supports
from pallas_kernels.gdn_ragged_chunked import gdn_ragged_chunked
from pallas_kernels.gdn_reference import gdn_ragged_reference
from pallas_kernels.prompt_qkv import prompt_qkv, prompt_qkv_supports
from pallas_kernels.ragged_attention import kernel_supports as ragged_kernel_supports
from pallas_kernels.ragged_attention import ragged_paged_attention, ragged_paged_attention_reference

from ..model.attention import project_qkv_gate
from ..model.config import FULL_ATTENTION, ModelConfig
from ..model.forward import residual_block
from ..model.gdn import gdn_output, gdn_projections, split_qkv
from ..model.mlp import linear, linear_parts
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
    """Whether the ragged GDN recurrence runs the Pallas kernels (`pallas_kernels/gdn_ragged_chunked.py`):
    policy.gdn_kernels, head sizes that are Triton tiles."""
    return policy.gdn_kernels and tiles_supported(cfg.linear_key_head_dim, cfg.linear_value_head_dim)


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
        o, ssm = gdn_ragged_chunked(q, k, v, g, beta, slots.ssm, meta.query_start_loc, meta.idx_mapping, offset,
                                    meta.fresh, meta.verify_path)
    else:
        start = read_ssm(slots, meta, offset)
        o, final, states = gdn_ragged_reference(q, k, v, g, beta, meta.token_row, meta.query_start_loc, start, W)
        ssm = write_ssm(slots, meta, final, states if W > 1 else None)
    out = gdn_output(p, cfg, o[None], z, h.dtype)[0]
    return out, GDNSlots(conv=conv, ssm=ssm)


@struct.dataclass
class RowView:
    """A uniform step's [R, Q] view (device arrays)."""

    token_index: Array  # [R, Q] flat token index of each cell, -1 for padding
    positions: Array  # [R, Q] absolute positions (0 for padding)
    kv_slots: Array  # [R, Q] flat KV pool slot (page * page_size + offset) each cell writes; null page for padding
    block_tables: Array  # [R, MP] page ids of each row (0 = null page beyond the allocation)
    seq_lens: Array  # [R] tokens of the sequence after this step
    idx_mapping: Array  # [R] persistent request slot (0 = null slot)
    fresh: Array  # [R] bool: the row starts from an empty state (first chunk of a (re)computation)
    verify_path: Array  # [R] bool: GDN state writes one checkpoint per window position (spec rows)

    @property
    def valid(self):
        return self.token_index >= 0

    @property
    def num_valid(self):
        return jnp.sum(self.valid, axis=1).astype(jnp.int32)


def row_view(meta: StepMeta, width: int) -> RowView:
    """The [R, width] view of a uniform step's stream (row r's tokens are r*width .. r*width+width-1)."""
    R = meta.idx_mapping.shape[0]
    T = meta.positions.shape[0]
    token_index = jnp.where(meta.valid, jnp.arange(T, dtype=jnp.int32), -1).reshape(R, width)
    return RowView(token_index=token_index, positions=meta.positions.reshape(R, width),
                   kv_slots=meta.kv_slots.reshape(R, width), block_tables=meta.block_tables, seq_lens=meta.seq_lens,
                   idx_mapping=meta.idx_mapping, fresh=meta.fresh, verify_path=meta.verify_path)


def use_decode_attention_kernel(p, cfg: ModelConfig, queries: int, page_size: int, policy: KernelPolicy) -> bool:
    """Whether an attention layer's step of rows `queries` tokens wide runs the one decode-attention kernel:
    policy.fused_decode and attention_kernels, short rows, fused q/k/v weights (one product to read) and
    tile-sized heads and pages."""
    return (policy.fused_decode and policy.attention_kernels and queries <= policy.decode_attention_max_queries
            and p.fused is not None and decode_attention_supports(cfg.head_dim, page_size, cfg.rotary_dim))


def decode_attention_rows(p, cfg: ModelConfig, h, view: RowView, kv: PagedKV, layout: DecodeAttentionLayout):
    """The attention layer of [R, Q] rows (h [R, Q, H] or a DeferredNorm of it) with the decode kernel
    between its two products. Returns (out [R, Q, H], new pools)."""
    y, row_scale = linear_parts(h, p.fused)
    cos, sin = rope_cos_sin(cfg, view.positions, h.dtype)
    o, k_pool, v_pool = decode_attention_pooled(
        y, row_scale, p.q_norm, p.k_norm, cfg.rms_norm_eps, cos, sin, kv.k, kv.v, view.kv_slots.reshape(-1),
        view.block_tables, jnp.where(view.valid, view.positions, -1), view.seq_lens - view.num_valid,
        view.seq_lens, num_heads=cfg.num_attention_heads, dtype=h.dtype, layout=layout)
    return linear(o, p.o_proj), PagedKV(k=k_pool, v=v_pool)


def use_mixer_kernel(p, cfg: ModelConfig, rows: int, policy: KernelPolicy) -> bool:
    """Whether a GDN layer's pool-kernel step of `rows` rows runs the one mixer kernel: policy.fused_decode,
    rows in policy.mixer_rows (its one program per (row, key head) holds whole state tiles; the chain's
    kernels split dv over more programs, which pays at few rows and at many), the weights fused (the serving
    layout, so b and a sit in the product) and tile-sized heads of at most 128 x 128."""
    lo, hi = policy.mixer_rows
    return (policy.fused_decode and lo <= rows <= hi and p.fused is not None
            and mixer_kernel_supports(cfg.linear_key_head_dim, cfg.linear_value_head_dim))


def gdn_rows_pooled(p, cfg: ModelConfig, h, view: RowView, slots: GDNSlots, num_accepted, policy: KernelPolicy,
                    mixer: bool | None = None):
    """The GDN layer over [R, Q] rows (h [R, Q, H]) on the in-place pool kernels: the conv kernel reads and
    writes each row's window in the pool (`pallas_kernels/gdn_conv.py`), the pool kernel reads checkpoint
    num_accepted-1 of each row's slot and writes the new checkpoints straight into it, with no gathered copy
    of the states; with fused weights and fused_decode one kernel does the conv, gates, recurrence and gated
    norm (mixer; None: `use_mixer_kernel`). Returns (out [R, Q, H], new slots)."""
    offset = num_accepted[view.idx_mapping] - 1
    if use_mixer_kernel(p, cfg, h.shape[0], policy) if mixer is None else mixer:  # one kernel between the products
        y, row_scale = linear_parts(h, p.fused)
        out, conv, ssm = gdn_mixer_pooled(y, row_scale, p.conv1d, p.A_log, p.dt_bias, p.norm, cfg.rms_norm_eps,
                                          slots.conv, slots.ssm, view.idx_mapping, offset, view.fresh,
                                          view.verify_path, view.num_valid, dtype=h.dtype)
        return linear(out, p.out_proj), GDNSlots(conv=conv, ssm=ssm)
    source, _, z, g, beta = gdn_projections(p, cfg, h, view.num_valid)
    u, conv = causal_conv_pooled(source, cfg.conv_dim, p.conv1d, slots.conv, view.idx_mapping, offset, view.fresh,
                                 view.verify_path, view.num_valid)
    rows = (slots.ssm, view.idx_mapping, offset, view.fresh, view.verify_path)
    if p.fused is not None and policy.pool_gates:  # b and a sit in the product: the kernel forms the gates
        gates = GateSource(source, cfg.conv_dim + cfg.linear_value_dim, p.A_log, p.dt_bias, view.num_valid)
        o, ssm = gdn_recurrent_pooled(u, None, None, *rows, gates=gates)
    else:
        o, ssm = gdn_recurrent_pooled(u, g, beta, *rows)
    return gdn_output(p, cfg, o, z, h.dtype), GDNSlots(conv=conv, ssm=ssm)


def use_pooled_kernels(cfg: ModelConfig, width: int, policy: KernelPolicy) -> bool:
    """Whether a uniform step's GDN layers run `gdn_rows_pooled` (else the ragged form): policy.gdn_kernels,
    short rows, tile-sized heads and conv blocks."""
    return (policy.gdn_kernels and width <= SHORT_ROW
            and tiles_supported(cfg.linear_key_head_dim, cfg.linear_value_head_dim)
            and conv_kernel_supports(cfg.conv_dim))


def pick_mixer(p, cfg: ModelConfig, attention: bool, width: int, rows: int, page_size: int,
               policy: KernelPolicy) -> str:
    """The token mixer of a layer (p its mixer's weights), the one table of the forward:

    | layer     | step                                              | mixer              |
    |-----------|---------------------------------------------------|--------------------|
    | attention | uniform, `use_decode_attention_kernel`            | "decode_attention" |
    | attention | otherwise                                         | "ragged_attention" |
    | GDN       | uniform, `use_pooled_kernels`, `use_mixer_kernel` | "gdn_mixer"        |
    | GDN       | uniform, `use_pooled_kernels`                     | "gdn_pooled"       |
    | GDN       | otherwise                                         | "gdn_ragged"       |

    Inside "ragged_attention" and "gdn_ragged" the policy picks Pallas kernels or XLA references
    (`uses_attention_kernel`, `use_prompt_qkv_kernel`, `uses_gdn_kernels`)."""
    if attention:
        if width and use_decode_attention_kernel(p, cfg, width, page_size, policy):
            return "decode_attention"
        return "ragged_attention"
    if width and use_pooled_kernels(cfg, width, policy):
        return "gdn_mixer" if use_mixer_kernel(p, cfg, rows, policy) else "gdn_pooled"
    return "gdn_ragged"


@functools.partial(jax.jit, static_argnames=("cfg", "attention", "policy", "width"))
def _layer(p, x, layer_state, meta: StepMeta, num_accepted, *, cfg: ModelConfig, attention: bool,
           policy: KernelPolicy, width: int = 0):
    """One decoder layer on the stream x [T, H] (width > 0: a uniform step's). Its own jit, called inside the
    step's trace: the layers of a kind share one traced and lowered function, which XLA inlines before it
    optimizes."""
    R, T = meta.idx_mapping.shape[0], x.shape[0]
    name = pick_mixer(p.mixer, cfg, attention, width, R, layer_state.k.shape[1] if attention else 0, policy)
    to_rows = lambda a: jax.tree_util.tree_map(lambda y: y.reshape(R, width, *y.shape[1:]), a)  # noqa: E731

    def mixer(h):
        if name == "decode_attention":
            out, new_state = decode_attention_rows(p.mixer, cfg, to_rows(h), row_view(meta, width), layer_state,
                                                   policy.decode_attention_layout)
            return out.reshape(T, -1), new_state
        if name in ("gdn_mixer", "gdn_pooled"):
            out, new_state = gdn_rows_pooled(p.mixer, cfg, to_rows(h), row_view(meta, width), layer_state,
                                             num_accepted, policy, mixer=name == "gdn_mixer")
            return out.reshape(T, -1), new_state
        if name == "ragged_attention":
            return attention_ragged(p.mixer, cfg, h, meta, layer_state, policy)
        return gdn_ragged(p.mixer, cfg, h, meta, layer_state, num_accepted, policy)

    return residual_block(p, cfg, x, mixer, policy)


def forward(params: ModelParams, cfg: ModelConfig, input_ids, meta: StepMeta, state: EngineState,
            policy: KernelPolicy, width: int = 0):
    """input_ids [T] (width > 0: R rows of `width` tokens, T = R * width) -> (hidden [T, H] after the final
    norm, new EngineState)."""
    x = embed(params, input_ids, cfg.vocab_size, policy)
    new_layers = []
    for i, layer_type in enumerate(cfg.layer_types):
        x, new_state = _layer(params.layers[i], x, state.layers[i], meta, state.num_accepted, cfg=cfg,
                              attention=layer_type == FULL_ATTENTION, policy=policy, width=width)
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
