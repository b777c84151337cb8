"""The model over a uniform step: R rows of Q tokens each (plain decode rows, or MTP verify windows), so the
flat token stream is exactly the [R, Q] view reshaped. Launches of several decode or verify steps run in
this form (`programs.StepShape.width`) so that their token mixers can be the one-kernel decode forms, which
hold a row's few tokens in registers: the decode attention kernel, and the GDN mixer or the pooled conv and
recurrence kernels, each reading and writing the pools in place. Where those kernels do not run (off the
GPU, other head sizes, fused_decode_kernels=False) the layers take the ragged forms of `ragged_forward`.
Padding rows are no-ops: their KV writes go to the null page, their GDN steps neither decay nor write, and
their slots are the null slot.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from pallas_kernels.conv_pallas import causal_conv_pooled, conv_kernel_supports
from pallas_kernels.decode_attention import DecodeAttentionLayout, decode_attention_pooled, decode_attention_supports
from pallas_kernels.gdn import RECURRENT_MAX_T
from pallas_kernels.gdn_mixer import gdn_mixer_pooled, mixer_kernel_supports
from pallas_kernels.gdn_pallas import GateSource, gdn_recurrent_pooled, pooled_kernel_supports

from ..model.config import FULL_ATTENTION, ModelConfig
from ..model.forward import residual_block
from ..model.gdn import gdn_output, gdn_projections
from ..model.mlp import linear, linear_parts
from ..model.norms import rms_norm_1p
from ..model.parallel import embed
from ..model.params import ModelParams
from ..model.policy import KernelPolicy
from ..model.rope import rope_cos_sin
from .ragged_forward import StepMeta, attention_ragged, gdn_ragged
from .state import EngineState, GDNSlots, PagedKV

Array = Any


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


def gdn_rows_pooled(p, cfg: ModelConfig, h, view: RowView, slots: GDNSlots, num_accepted, policy: KernelPolicy):
    """The GDN layer over [R, Q] rows (h [R, Q, H]) on the in-place pool kernels: the conv kernel reads and
    writes each row's window in the pool (`pallas_kernels/conv_pallas.py`), the pool kernel reads checkpoint
    num_accepted-1 of each row's slot and writes the new checkpoints straight into it, with no gathered copy
    of the states; with fused weights and fused_decode one kernel does the conv, gates, recurrence and gated
    norm (`use_mixer_kernel`). Returns (out [R, Q, H], new slots)."""
    offset = num_accepted[view.idx_mapping] - 1
    if use_mixer_kernel(p, cfg, h.shape[0], policy):  # everything between the two products in one kernel
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
    return (policy.gdn_kernels and width <= RECURRENT_MAX_T
            and pooled_kernel_supports(cfg.linear_key_head_dim, cfg.linear_value_head_dim)
            and conv_kernel_supports(cfg.conv_dim))


@functools.partial(jax.jit, static_argnames=("cfg", "attention", "policy", "width"))
def _uniform_layer(p, x, layer_state, meta: StepMeta, num_accepted, *, cfg: ModelConfig, attention: bool,
                   policy: KernelPolicy, width: int):
    """One decoder layer of `forward_uniform` on the stream x [T, H]. Its own jit, called inside the step's
    trace: the layers of a kind share one traced and lowered function, which XLA inlines before it optimizes."""
    view = row_view(meta, width)
    R, T = view.token_index.shape[0], x.shape[0]
    to_rows = lambda a: jax.tree_util.tree_map(lambda y: y.reshape(R, width, *y.shape[1:]), a)  # noqa: E731

    def mixer(h):
        if attention:
            if use_decode_attention_kernel(p.mixer, cfg, width, layer_state.k.shape[1], policy):
                out, new_state = decode_attention_rows(p.mixer, cfg, to_rows(h), view, layer_state,
                                                       policy.decode_attention_layout)
                return out.reshape(T, -1), new_state
            return attention_ragged(p.mixer, cfg, h, meta, layer_state, policy)
        if use_pooled_kernels(cfg, width, policy):
            out, new_state = gdn_rows_pooled(p.mixer, cfg, to_rows(h), view, layer_state, num_accepted, policy)
            return out.reshape(T, -1), new_state
        return gdn_ragged(p.mixer, cfg, h, meta, layer_state, num_accepted, policy)

    return residual_block(p, cfg, x, mixer, policy)


def forward_uniform(params: ModelParams, cfg: ModelConfig, input_ids, meta: StepMeta, width: int, state: EngineState,
                    policy: KernelPolicy):
    """input_ids [T] of R rows of `width` tokens (T = R * width) -> (hidden [T, H] after the final norm, new
    EngineState)."""
    x = embed(params, input_ids, cfg.vocab_size, policy)
    new_layers = []
    for i, layer_type in enumerate(cfg.layer_types):
        x, new_state = _uniform_layer(params.layers[i], x, state.layers[i], meta, state.num_accepted, cfg=cfg,
                                      attention=layer_type == FULL_ATTENTION, policy=policy, width=width)
        new_layers.append(new_state)
    hidden = rms_norm_1p(x, params.norm, cfg.rms_norm_eps)
    return hidden, dataclasses.replace(state, layers=tuple(new_layers))
