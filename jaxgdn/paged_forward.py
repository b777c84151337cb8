"""The model over one ragged engine step: rows read and write the paged KV pools and the GDN slots.

A step's flat token stream is viewed as [R, Q] (row, offset in the row's query window; `token_index`
maps each cell to its flat token or -1). Each row's attention reads a contiguous view of its KV pages
and each GDN row starts from its own slot's committed state, so the dense layer functions of the model
run unchanged on the view. Padded cells are no-ops: their KV writes go to the null page, their GDN
steps neither decay nor write, and their slots are the null slot.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.common import on_gpu
from pallas_kernels.conv_pallas import causal_conv_pooled, conv_kernel_supports
from pallas_kernels.decode_attention import decode_attention_pooled, decode_attention_supports
from pallas_kernels.gdn import use_pooled_recurrent
from pallas_kernels.gdn_mixer import gdn_mixer_pooled, mixer_kernel_supports
from pallas_kernels.gdn_pallas import GateSource, gdn_recurrent_pooled
from pallas_kernels.paged_attention import kernel_supports as paged_kernel_supports
from pallas_kernels.paged_attention import paged_attention_pallas, write_kernel_supports, write_kv_pallas
from pallas_kernels.prompt_qkv import prompt_qkv, prompt_qkv_supports

from .attention import fresh_prompt_attention, gqa_attention, project_qkv_gate
from .cache import EngineState, GDNSlots, PagedKV
from .config import FULL_ATTENTION, ModelConfig
from .engine_config import env_switch
from .gdn import causal_conv_silu, conv_checkpoint_inputs, gdn_layer, gdn_output, gdn_projections
from .mlp import linear, linear_parts
from .model import residual_block
from .mtp import mtp_fc_input
from .norms import rms_norm_1p
from .params import ModelParams
from .pytree import pytree_dataclass
from .rope import rope_cos_sin
from .state import GDNState

Array = Any


@pytree_dataclass
class RowView:
    """Per-step metadata of the [R, Q] view (device arrays; shapes are the jit bucket)."""

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


def write_kv(kv: PagedKV, slots, k, v, impl: str):
    """Write k, v [N, Hkv, D] at flat pool slots [N]. The Pallas kernel (in place) on a GPU or with
    impl "pallas" where a token's K is one Triton tile; XLA's scatter otherwise. Returns the two pools."""
    P, ps, Hkv, D = kv.k.shape
    if (impl == "pallas" or on_gpu()) and write_kernel_supports(Hkv, D):
        return write_kv_pallas(kv.k, kv.v, slots, k, v)
    scatter = lambda pool, x: pool.reshape(P * ps, Hkv, D).at[slots].set(x.astype(pool.dtype)).reshape(pool.shape)  # noqa: E731
    return scatter(kv.k, k), scatter(kv.v, v)


# With fused_decode (`EngineConfig.fused_decode_kernels`), decode and verify rows (at most
# DECODE_ATTENTION_MAX_QUERIES cells each) run the attention layer between its two products as one kernel
# (`pallas_kernels/decode_attention.py`) on a GPU or with impl "pallas"; without, the XLA path (or the paged
# flash kernel with impl "pallas").
DECODE_ATTENTION_MAX_QUERIES = 8


def use_decode_attention_kernel(p, cfg: ModelConfig, queries: int, page_size: int, impl: str,
                                whole_prompts: bool, fused_decode: bool = True) -> bool:
    """Whether an attention layer's step of rows `queries` cells wide runs the one decode-attention kernel:
    fused_decode on, short rows that read pages (not a step of whole prompts), fused q/k/v weights (one
    product to read) and tile-sized heads and pages."""
    return (fused_decode and (impl == "pallas" or on_gpu()) and not whole_prompts
            and queries <= DECODE_ATTENTION_MAX_QUERIES and p.fused is not None
            and decode_attention_supports(cfg.head_dim, page_size, cfg.rotary_dim))


def use_prompt_qkv_kernel(p, cfg: ModelConfig, queries: int, impl: str) -> bool:
    """Whether rows wider than decode rows (prefill) take q/k/v from the fused projection through the one
    kernel (`pallas_kernels/prompt_qkv.py`: the split, q/k norms and RoPE) on a GPU or with impl "pallas"."""
    return ((impl == "pallas" or on_gpu()) and queries > DECODE_ATTENTION_MAX_QUERIES and p.fused is not None
            and prompt_qkv_supports(cfg.head_dim, cfg.rotary_dim))


def project_qkv_gate_paged(p, cfg: ModelConfig, h, positions, impl: str):
    """`attention.project_qkv_gate` of [R, Q] rows (h [R, Q, H], positions [R, Q]), through the one kernel
    where `use_prompt_qkv_kernel`: q [R,Q,Hq,D], k, v [R,Q,Hkv,D], gate [R,Q,Hq*D]."""
    R, Q, _ = h.shape
    if not use_prompt_qkv_kernel(p, cfg, Q, impl):
        return project_qkv_gate(p, cfg, h, positions)
    Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    y = linear(h, p.fused)
    cos, sin = rope_cos_sin(cfg, positions, h.dtype)
    q, k, v = prompt_qkv(y, p.q_norm, p.k_norm, cfg.rms_norm_eps, cos, sin, Hq, Hkv, D)
    gate = y[..., : 2 * Hq * D].reshape(R, Q, Hq, 2 * D)[..., D:].reshape(R, Q, Hq * D)
    return q, k, v, gate


def paged_attention(p, cfg: ModelConfig, h, view: RowView, kv: PagedKV, impl: str = "xla", whole_prompts=False,
                    fused_decode: bool = True):
    """Gated attention for [R, Q] rows: write this step's K/V into the pool (write_kv), attend over each
    row's pages. impl "xla" gathers each row's pages into a contiguous view; "pallas" runs the paged flash
    kernel (`pallas_kernels/paged_attention.py`, pages read in place) where head_dim and page size allow.
    With fused_decode, short rows run everything between the two products as one kernel
    (`use_decode_attention_kernel`).
    Wider rows take q/k/v from the fused projection through one kernel on a GPU (`use_prompt_qkv_kernel`).
    whole_prompts (static; the host sets it, see `StepArrays.whole_prompts`): every row starts at
    position 0 (seq_lens == num_valid), and impl "xla" reads the step's own K/V instead of the pages
    (`fresh_prompt_attention`: cuDNN's flash attention on a GPU)."""
    R, Q, _ = h.shape
    if use_decode_attention_kernel(p, cfg, Q, kv.k.shape[1], impl, whole_prompts, fused_decode):
        y, row_scale = linear_parts(h, p.fused)
        cos, sin = rope_cos_sin(cfg, view.positions, h.dtype)
        o, k_pool, v_pool = decode_attention_pooled(
            y, row_scale, p.q_norm, p.k_norm, cfg.rms_norm_eps, cos, sin, kv.k, kv.v, view.kv_slots.reshape(-1),
            view.block_tables, jnp.where(view.valid, view.positions, -1), view.seq_lens - view.num_valid,
            view.seq_lens, num_heads=cfg.num_attention_heads, dtype=h.dtype)
        return linear(o, p.o_proj), PagedKV(k=k_pool, v=v_pool)
    q, k, v, gate = project_qkv_gate_paged(p, cfg, h, view.positions, impl)
    P, ps, Hkv, D = kv.k.shape
    k_pool, v_pool = write_kv(kv, view.kv_slots.reshape(-1), k.reshape(-1, Hkv, D), v.reshape(-1, Hkv, D), impl)
    if impl == "pallas" and paged_kernel_supports(D, ps):
        q_pos = jnp.where(view.valid, view.positions, -1)  # padding cells see no key
        attn = paged_attention_pallas(q.astype(h.dtype), k_pool, v_pool, view.block_tables, q_pos, view.seq_lens)
        o = attn.reshape(R, Q, -1) * jax.nn.sigmoid(gate)
        return linear(o, p.o_proj), PagedKV(k=k_pool, v=v_pool)
    if whole_prompts:
        # Every row starts at position 0, so its keys are its own K/V of this step, as stored (the pool's
        # dtype): a flash kernel attends to them without the paged form's [Q, MP * page_size] scores.
        k_own, v_own = (x.astype(k_pool.dtype).astype(h.dtype) for x in (k, v))
        attn = fresh_prompt_attention(q, k_own, v_own, view.num_valid, view.positions, view.valid)
    else:
        attn = _attention_over_pages(q, k_pool, v_pool, view, h.dtype)
    o = attn.reshape(R, Q, -1) * jax.nn.sigmoid(gate)
    return linear(o, p.o_proj), PagedKV(k=k_pool, v=v_pool)


def _attention_over_pages(q, k_pool, v_pool, view: RowView, dtype):
    """XLA attention of [R, Q] rows over a gathered contiguous view of their pages -> [R, Q, Hq, D]."""
    R = q.shape[0]
    P, ps, Hkv, D = k_pool.shape
    MP = view.block_tables.shape[1]
    k_view = k_pool[view.block_tables].reshape(R, MP * ps, Hkv, D)
    v_view = v_pool[view.block_tables].reshape(R, MP * ps, Hkv, D)
    k_pos = jnp.broadcast_to(jnp.arange(MP * ps, dtype=jnp.int32), (R, MP * ps))
    k_valid = k_pos < view.seq_lens[:, None]
    # Unwritten pages may hold anything (even NaN): zero them so masked probabilities stay exact zeros.
    v_view = jnp.where(k_valid[..., None, None], v_view, 0).astype(dtype)
    k_view = jnp.where(k_valid[..., None, None], k_view, 0).astype(dtype)
    return gqa_attention(q, k_view, v_view, view.positions, k_pos, k_valid)


def _read_conv(slots: GDNSlots, view: RowView, offset, kc: int):
    """[R, Kc-1, C]: each row's conv window at checkpoint offset; zeros for fresh rows."""
    conv = jax.vmap(lambda c, o: jax.lax.dynamic_slice_in_dim(c, o, kc - 1, axis=0))(slots.conv[view.idx_mapping], offset)
    return jnp.where(view.fresh[:, None, None], 0, conv)


def _write_conv(slots: GDNSlots, view: RowView, window, verify_buffer):
    """Non-verify rows write their new window at offset 0; verify rows the whole Kc-1+K buffer."""
    idx = view.idx_mapping
    kc1 = window.shape[1]
    if verify_buffer is None and kc1 == slots.conv.shape[1]:  # no spec window (K = 0): one scatter
        return slots.conv.at[idx].set(window.astype(slots.conv.dtype))
    conv = slots.conv[idx].at[:, :kc1].set(window.astype(slots.conv.dtype))
    if verify_buffer is not None:
        conv = jnp.where(view.verify_path[:, None, None], verify_buffer.astype(slots.conv.dtype), conv)
    return slots.conv.at[idx].set(conv)


def read_gdn_state(slots: GDNSlots, view: RowView, num_accepted, kc: int) -> GDNState:
    """Each row's committed state: checkpoint num_accepted-1 and the conv window at that offset; zeros
    for fresh rows, so whatever a slot held before admission never leaks in."""
    idx = view.idx_mapping
    offset = num_accepted[idx] - 1  # [R] in [0, K]
    ssm = jax.vmap(lambda s, o: s[o])(slots.ssm[idx], offset)
    return GDNState(conv=_read_conv(slots, view, offset, kc), ssm=jnp.where(view.fresh[:, None, None, None], 0, ssm))


def write_gdn_state(slots: GDNSlots, view: RowView, new: GDNState, checkpoints: GDNState | None) -> GDNSlots:
    """Prefill/decode rows commit their final state to checkpoint 0 and window to conv offset 0.
    Verify-path rows write every checkpoint (state after each window position) and the whole
    Kc-1+K conv buffer; the next step selects with num_accepted."""
    idx = view.idx_mapping
    final_ssm = slots.ssm[idx].at[:, 0].set(new.ssm.astype(slots.ssm.dtype))
    if checkpoints is not None:
        v = view.verify_path
        final_ssm = jnp.where(v[:, None, None, None, None], checkpoints.ssm.astype(slots.ssm.dtype), final_ssm)
    conv = _write_conv(slots, view, new.conv, None if checkpoints is None else checkpoints.conv)
    return GDNSlots(conv=conv, ssm=slots.ssm.at[idx].set(final_ssm))


# With fused_decode (`EngineConfig.fused_decode_kernels`), the GDN mixer kernel (`pallas_kernels/gdn_mixer.py`)
# for steps of MIXER_MIN_ROWS to MIXER_MAX_ROWS rows on the pool kernel path; without, the unfused chain (product scale,
# gates, conv kernel, pool kernel, gated norm) always.
# Its one program per (row, key head) holds whole state tiles: on the H200 at the 0.8B widths, alone, 6.3 us a
# layer at batch 1 and 7.8 at batch 8 against ~9 (r21's in-model inventory) and an estimated ~12 for the
# chain's five kernels, but 48.8 at batch 64 against 41 for the chain's conv and pool kernels, which split dv
# over more programs (bench/results/gdn-mixer-probe_gpu_20261202.json). In the model (device ms a step):
# batch 8 1.097 against 1.130, batch 16 1.249 against 1.290, batch 1 even (decode-forms-*-probe_gpu_20261202.json).
# Holding a [dk, 64] or [dk, 32] block of the state at a time (r40, commit afae672) did not make it pay above 16
# rows: alone 46.3 us a layer at batch 64 against the chain's ~41; in the step, mixer up to 128 rows, batch 64
# 1.763 against 1.717 ms (gdn-mixer-blocks-probe-r40, decode-forms-*-r40_gpu_20261204.json).
MIXER_MAX_ROWS = 16
# Steps of fewer rows run the chain since r42: with the gates in the pool kernel (r41) the chain's kernels, which
# split dv over programs, take less there than the mixer's one program a (row, head). Decode steps on the chain
# against the mixer, one process each (device ms): batch 1 0.791 / 0.797 against 0.820 / 0.821, batch 2 0.929
# against 0.948, batch 4 0.968 against 0.980; batch 8 1.039 / 1.038 against 1.025 / 1.022, batch 16 1.185 / 1.184
# against 1.169 / 1.170 (bench/results/decode-forms-*-r42{,b}_gpu_20261204.json). 5 to 7 rows are not measured:
# the bound splits the gap.
MIXER_MIN_ROWS = 6

# Steps of the unfused chain (more than MIXER_MAX_ROWS rows) with fused weights form the gates g and beta inside
# the pool kernel from the product's b and a columns (`gdn_recurrent_pooled(gates=...)`), where XLA ran them as a
# kernel of their own (1.4 us a layer at batch 64, bench/results/decode-kernels-r30-probe_gpu_20261203.json).
# batch 64 1.726 against 1.759 / 1.756 ms a step (off / on / off, bench/results/decode-pool-gates-*-r41_gpu_20261204.json).
# `$JAXGDN_POOL_GATES` ('on', the default, or 'off'; read once at import) switches it.
POOL_KERNEL_GATES = env_switch("JAXGDN_POOL_GATES")


def use_mixer_kernel(p, cfg: ModelConfig, rows: int, fused_decode: bool = True) -> bool:
    """Whether a GDN layer's pool-kernel step of `rows` rows runs the one mixer kernel: fused_decode on,
    MIXER_MIN_ROWS to MIXER_MAX_ROWS rows, the weights fused (the serving layout, so b and a sit in the product)
    and tile-sized heads of at most 128 x 128."""
    return (fused_decode and MIXER_MIN_ROWS <= rows <= MIXER_MAX_ROWS and p.fused is not None
            and mixer_kernel_supports(cfg.linear_key_head_dim, cfg.linear_value_head_dim))


def gdn_rows(p, cfg: ModelConfig, h, view: RowView, slots: GDNSlots, num_accepted, gdn_impl: str,
             fused_decode: bool = True):
    """The GDN layer over [R, Q] rows starting from and committing to the slot pool.

    With gdn_impl "pallas_pool", short rows (decode, spec verification) run the in-place pool kernel: it
    reads checkpoint num_accepted-1 of each row's slot and writes the new checkpoints straight into the
    pool, with no gathered copy of the states, after the conv kernel did the same for the conv windows
    (`pallas_kernels/conv_pallas.py`); with fused weights and fused_decode one kernel does the conv, gates,
    recurrence and gated norm (`use_mixer_kernel`). Otherwise the states are gathered, run, and scattered back."""
    kc = cfg.linear_conv_kernel_dim
    K = slots.ssm.shape[1] - 1
    Q = h.shape[1]
    if not use_pooled_recurrent(gdn_impl, Q, cfg.linear_key_head_dim, cfg.linear_value_head_dim):
        start = read_gdn_state(slots, view, num_accepted, kc)
        res = gdn_layer(p, cfg, h, start, impl=gdn_impl, num_valid=view.num_valid, spec_window=K)
        out, new, checkpoints = res if K else (*res, None)
        return out, write_gdn_state(slots, view, new, checkpoints)
    offset = num_accepted[view.idx_mapping] - 1
    if use_mixer_kernel(p, cfg, h.shape[0], fused_decode):  # everything between the two products in one kernel
        y, row_scale = linear_parts(h, p.fused)
        out, conv, ssm = gdn_mixer_pooled(y, row_scale, p.conv1d, p.A_log, p.dt_bias, p.norm, cfg.rms_norm_eps,
                                          slots.conv, slots.ssm, view.idx_mapping, offset, view.fresh,
                                          view.verify_path, view.num_valid, dtype=h.dtype)
        return linear(out, p.out_proj), GDNSlots(conv=conv, ssm=ssm)
    source, mixed, z, g, beta = gdn_projections(p, cfg, h, view.num_valid)
    if conv_kernel_supports(cfg.conv_dim):  # the conv's window read, compute and write in one kernel
        u, conv = causal_conv_pooled(source, cfg.conv_dim, p.conv1d, slots.conv, view.idx_mapping, offset, view.fresh,
                                     view.verify_path, view.num_valid)
    else:
        start_window = _read_conv(slots, view, offset, kc)
        u, window = causal_conv_silu(mixed, start_window, p.conv1d, view.num_valid)
        conv = _write_conv(slots, view, window, conv_checkpoint_inputs(start_window, mixed, K) if K else None)
    rows = (slots.ssm, view.idx_mapping, offset, view.fresh, view.verify_path)
    if p.fused is not None and POOL_KERNEL_GATES:  # b and a sit in the product: the kernel forms the gates
        gates = GateSource(source, cfg.conv_dim + cfg.linear_value_dim, p.A_log, p.dt_bias, view.num_valid)
        o, ssm = gdn_recurrent_pooled(u, None, None, *rows, gates=gates)
    else:
        o, ssm = gdn_recurrent_pooled(u, g, beta, *rows)
    return gdn_output(p, cfg, o, z, h.dtype), GDNSlots(conv=conv, ssm=ssm)


def forward_paged(params: ModelParams, cfg: ModelConfig, input_ids, view: RowView, state: EngineState, gdn_impl: str,
                  attention_impl: str = "xla", rows_are_flat: bool | None = None, whole_prompts: bool = False,
                  fused_decode: bool = True):
    """input_ids: [T] flat tokens. Returns (hidden [T, H] after the final norm, the same hidden as
    [R, Q, H], new EngineState). whole_prompts (static): see `paged_attention`; fused_decode (static): see
    `use_mixer_kernel` and `use_decode_attention_kernel`.

    rows_are_flat (static; default: single-token rows (Q == 1) or a single row (R == 1), when R*Q <= T):
    flat tokens [0, R*Q) are the [R, Q] view row by row (rows sit at cumulative offsets from 0, padding
    cells after a row's real tokens), so the two forms are reshapes instead of a gather and a scatter
    around every token mixer, and the trunk runs on those R*Q tokens only. That matters twice: a decode
    step's flat bucket T is at least 8, and a weight product over 8 rows for one real one runs a GEMM
    tile where a single row gets XLA's faster GEMV form; a long prompt's scatter and gather cost a pass
    over the activations per layer. Tokens from R*Q to T (never a row's) come back as zeros; padding
    cells and rows carry the padding tokens' values, which no layer mixes into a real token (padded GDN
    steps neither decay nor write, attention masks them, their KV writes go to the null page)."""
    T = input_ids.shape[0]
    R, Q = view.token_index.shape
    if rows_are_flat is None:
        rows_are_flat = (Q == 1 or R == 1) and R * Q <= T
    trunk_ids = input_ids[: R * Q] if rows_are_flat else input_ids
    token_cell = None
    if not rows_are_flat:
        # Back to flat tokens by a gather, not a scatter: each flat token reads its cell (R*Q: none, zeros).
        # The inverse map is one small int scatter per step; XLA's scatter of the activations cost 67 us a
        # layer at 8x1024 on the H200 (input_scatter_fusion in prefill-r9's profile).
        flat_index = jnp.where(view.valid, view.token_index, T).reshape(-1)
        token_cell = jnp.full((T,), R * Q, jnp.int32).at[flat_index].set(jnp.arange(R * Q, dtype=jnp.int32),
                                                                         mode="drop")
    # Norms and MLPs run on the flat tokens; only the token mixers see the [R, Q] view, whose padding
    # (R*Q can be several times T in a mixed prefill/decode step) would otherwise multiply their cost.
    x = params.embed_tokens[jnp.clip(trunk_ids, 0, cfg.vocab_size - 1)]  # [T or R*Q, H]
    new_layers = []
    for i, layer_type in enumerate(cfg.layer_types):
        x, new_state = _paged_layer(params.layers[i], x, state.layers[i], view, state.num_accepted, token_cell,
                                    cfg=cfg, attention=layer_type == FULL_ATTENTION, gdn_impl=gdn_impl,
                                    attention_impl=attention_impl, whole_prompts=whole_prompts,
                                    fused_decode=fused_decode)
        new_layers.append(new_state)
    hidden = rms_norm_1p(x, params.norm, cfg.rms_norm_eps)
    hidden_flat = jnp.pad(hidden, [(0, T - hidden.shape[0]), (0, 0)])
    return hidden_flat, _row_maps(view, hidden.shape[0], token_cell)[0](hidden), dataclasses.replace(
        state, layers=tuple(new_layers))


def _row_maps(view: RowView, num_tokens: int, token_cell):
    """(to_rows, to_flat) between flat tokens [N, ...] and the [R, Q] view [R, Q, ...]: reshapes when
    token_cell is None (N = R*Q), else a gather each way (N = T; token_cell [T] each flat token's cell,
    R*Q for none, whose tokens come back as zeros)."""
    R, Q = view.token_index.shape
    if token_cell is None:
        to_rows = lambda a: a.reshape(R, Q, *a.shape[1:])  # noqa: E731
        to_flat = lambda y: y.reshape(R * Q, *y.shape[2:])  # noqa: E731
    else:
        cell = jnp.clip(view.token_index, 0, num_tokens - 1)
        to_rows = lambda a: a[cell]  # noqa: E731
        to_flat = lambda y: jnp.take(y.reshape(R * Q, *y.shape[2:]), token_cell, axis=0, mode="fill", fill_value=0)  # noqa: E731
    # to_rows maps every array of its input: a normed activation may be a DeferredNorm (x and its 1/rms).
    return (lambda x: jax.tree_util.tree_map(to_rows, x)), to_flat


@functools.partial(jax.jit, static_argnames=("cfg", "attention", "gdn_impl", "attention_impl", "whole_prompts",
                                             "fused_decode"))
def _paged_layer(p, x, layer_state, view: RowView, num_accepted, token_cell, *, cfg: ModelConfig, attention: bool,
                 gdn_impl: str, attention_impl: str, whole_prompts: bool, fused_decode: bool):
    """One decoder layer of `forward_paged` on flat tokens x [N, H] (N = R*Q when token_cell is None: the
    rows are the flat tokens reshaped; else N = T and token_cell [T] is each flat token's cell of the
    [R, Q] view, R*Q for none). Returns (x, the layer's new state).

    Its own jit, called inside the step's trace: all layers of a kind share one traced and lowered
    function instead of tracing and lowering the layer (and every Pallas kernel in it, each lowered to
    Triton IR) once per layer per step. The step program then calls it (HLO `call`), which XLA inlines
    before it optimizes, so the compiled step is unchanged. A warm start (persistent cache) pays that
    tracing and lowering every time: 18 chunked GDN calls in one program take 1.43 s to trace and 2.55 s
    to lower against 0.10 and 0.15 s through one nested jit, on 2 CPU cores lowering for CUDA
    (bench/results/step-trace-time-pallas-sites_cpu_20261201.json)."""
    to_rows, to_flat = _row_maps(view, x.shape[0], token_cell)

    def mixer(h_flat):
        h = to_rows(h_flat)
        if attention:
            out, new_state = paged_attention(p.mixer, cfg, h, view, layer_state, attention_impl, whole_prompts,
                                             fused_decode)
        else:
            out, new_state = gdn_rows(p.mixer, cfg, h, view, layer_state, num_accepted, gdn_impl, fused_decode)
        return to_flat(out), new_state

    return residual_block(p, cfg, x, mixer)


def mtp_paged(params: ModelParams, cfg: ModelConfig, hidden, next_ids, view: RowView, mtp_layers: tuple,
              attention_impl: str = "xla", whole_prompts: bool = False, fused_decode: bool = True):
    """The MTP head over [R, Q] cells: cell (r, j) gets the trunk hidden at its position and the token
    after it. Writes the MTP layer's own paged KV. Returns (mtp hidden [R, Q, H] after mtp.norm, layers).
    whole_prompts, fused_decode (static): see `paged_attention`."""
    mtp = params.mtp
    x = mtp_fc_input(params, cfg, hidden, next_ids)
    new_layers = []
    for layer, kv in zip(mtp.layers, mtp_layers):
        x, kv = residual_block(layer, cfg, x, lambda h, layer=layer, kv=kv: paged_attention(
            layer.mixer, cfg, h, view, kv, attention_impl, whole_prompts, fused_decode))
        new_layers.append(kv)
    return rms_norm_1p(x, mtp.norm, cfg.rms_norm_eps), tuple(new_layers)
