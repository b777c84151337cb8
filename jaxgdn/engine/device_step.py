"""The device side of an engine step, traced into each step program.

step = input assembly kernel -> model over the ragged (or uniform) rows (paged KV + GDN slots) -> logits at
logits_indices -> position-keyed sampling and draft verification -> per-slot bookkeeping (last_sampled,
num_accepted, num_computed) -> MTP drafts. The only host round trip is the results coming back.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from pallas_kernels.input_assembly import combine_sampled_and_draft_tokens

from ..model.config import ModelConfig
from ..model.parallel import head_argmax, head_logits
from ..model.params import ModelParams
from ..model.policy import KernelPolicy
from .forward import StepMeta, forward, mtp_ragged
from .logprobs import Sampler, pack, score, score_stream, stream_targets
from .sampling import position_keys
from .spec_decode import verify_drafts
from .state import NULL_PAGE, EngineState, PagedKV
from .structured import allowed
from . import penalties
from .step_layout import StepArrays, unpack_step_arrays


def packed_step(params: ModelParams, state: EngineState, resident, host_input, layout: tuple, sampler: int,
                 num_steps: int = 1, width: int = 0, rebases: bool = False, **static):
    """The jitted entry: copy the step's input into its resident buffer, unpack it, run the step, and pack
    the results into one int32 buffer [R*(1+K) tokens | R num_sampled | R*K drafts | T ids] for a single
    device-to-host copy. Returns (state, flat, resident, the logits rows' hidden states [num_steps, R, 1+K, H],
    the tokens [num_steps, R, 1+K]): the last two stay on the device for a launch that scores its tokens
    (split_step.packed_score).

    host_input: int32[n], this step's packed arrays, a new device buffer every step. resident: int32[n + 1],
    donated, the same device buffer every step of this size. XLA's CUDA graphs hold the addresses of their
    buffers; reading the input from resident keeps every kernel but the first copy at fixed addresses, so
    the graph needs no update of its other nodes. (One spare element: a copy over the whole buffer would be
    simplified into reading host_input directly; the barrier keeps the readers on the copy.)
    sampler (static, logprobs.Sampler flags): GREEDY, or SAMPLE (some row samples with temperature > 0); the
    other features run split (split_step.py).
    width (static): 0 for a ragged program; > 0 for a uniform one (every real row `width` tokens), whose
    token mixers view the stream as [R, width] (`forward.RowView`, the decode kernels).
    num_steps (static): > 1 runs that many model steps in one launch of a uniform program (every row a
    1-token decode row, or every row an MTP verify window of 1+K): step j sees the arrays advanced by the
    tokens each row committed in steps 0..j-1 (_advance_rows; 1 a step for decode rows, the accepted
    drafts + 1 for verify rows, known only on the device), and its input tokens are step j-1's sample and
    drafts, placed on device from last_sampled and draft_tokens as always. flat then holds num_steps
    results of the layout above, one after the other.
    rebases (static): rows may carry the rebase flag (async scheduling with MTP): the host booked their
    previous launch as if every draft were accepted, so they start where state.num_computed says."""
    state, a, shift, resident = launch_prologue(state, resident, host_input, layout, rebases)

    def one_step(state, arrays):
        state, tokens, num_sampled, drafts, ids, rows_hidden = _device_step(params, state, arrays, sampler=sampler,
                                                                            width=width, **static)
        hiddens.append(rows_hidden)
        all_tokens.append(tokens)
        flat = jnp.concatenate([tokens.ravel(), num_sampled.ravel(), drafts.ravel(), ids.ravel()]).astype(jnp.int32)
        return state, flat, num_sampled

    page_size = _kv_page_size(state)
    # Unrolled (a Python loop): one CUDA graph holds all the steps. As a lax loop, XLA runs the body's
    # kernels one by one from the host on each iteration, which on the H200 cost more than the launches it
    # saves.
    flats, hiddens, all_tokens = [], [], []
    emitted = jnp.zeros(a.idx_mapping.shape, jnp.int32)  # [R] tokens each row sampled so far
    for j in range(num_steps):
        live = ~state.stopped[a.idx_mapping] & ((j == 0) | (emitted < a.token_budget))
        arrays = _advance_rows(a, shift + emitted, live, page_size, fresh=j == 0)
        state, flat, num_sampled = one_step(state, arrays)
        emitted = emitted + num_sampled
        flats.append(flat)
    return state, jnp.concatenate(flats), resident, jnp.stack(hiddens), jnp.stack(all_tokens)


def launch_prologue(state: EngineState, resident, host_input, layout: tuple, rebases: bool):
    """A launch's first moves: copy the input into its resident buffer, unpack it, clear the stop flags of the
    requests' first rows. Returns (state, arrays, shift [R]: where each row starts past the host's count,
    resident)."""
    resident = jax.lax.optimization_barrier(jax.lax.dynamic_update_slice(resident, host_input, (0,)))
    a = unpack_step_arrays(resident, layout)
    # A request's first row clears its slot's stop flag; the rows of a request that stopped (sampled a stop token
    # in an earlier step) run on the null slot and sample nothing: its slot keeps the state after its last token.
    S = state.stopped.shape[0]
    state = state.replace(stopped=state.stopped.at[jnp.where(a.first_row, a.idx_mapping, S)].set(False, mode="drop"))
    # Rows the host flags (rebase: their previous launch's results were not back when this one was
    # scheduled, so the host assumed every draft accepted) start where the device's count says.
    start = a.seq_lens - _row_lengths(a)
    shift = jnp.where(a.rebase, state.num_computed[a.idx_mapping] - start, 0) if rebases else 0
    return state, a, shift, resident


def first_step_arrays(state: EngineState, a: StepArrays, shift):
    """The arrays of a launch's first (or only) model step (see _advance_rows)."""
    return _advance_rows(a, shift + jnp.zeros(a.idx_mapping.shape, jnp.int32), ~state.stopped[a.idx_mapping],
                         _kv_page_size(state), fresh=True)


def _row_lengths(a: StepArrays):
    """[R] tokens of each row (0 for padding rows)."""
    qsl = a.query_start_loc
    return qsl[1:] - qsl[:-1]


def _kv_page_size(state: EngineState) -> int:
    """Tokens per KV page, from the pool's shape (1 for a model without attention layers)."""
    pools = [layer for layer in state.layers if isinstance(layer, PagedKV)]
    return pools[0].k.shape[1] if pools else 1


def _advance_rows(a: StepArrays, shift, live, page_size: int, fresh: bool = False) -> StepArrays:
    """A step's arrays with every row moved on by shift (int32[R], on the device) positions: in a launch
    of several steps, step j's rows by the tokens they emitted in steps 0..j-1 (a decode row commits its
    one input token and samples one; a verify row commits its input token and its accepted drafts, and
    samples as many), plus any rebase (packed_step). Positions, sequence lengths and the KV slots the
    tokens write (from the rows' block tables) move by shift. A row that is not live (its emitted tokens
    reached its token_budget, or its request sampled a stop token: its request is over) writes the null page and
    samples nothing, and its GDN layers run on the null slot, so its request's state stays that after its last
    real token (a prefix-cache snapshot of it is exact); padding keeps its values; fresh: keep the host's fresh
    flags (step 0), else no row is fresh."""
    token_row = a.token_row
    valid = token_row >= 0
    row = jnp.clip(token_row, 0, a.idx_mapping.shape[0] - 1)
    positions = jnp.where(valid, a.positions + shift[row], a.positions)
    page = a.block_tables[row, jnp.clip(positions // page_size, 0, a.block_tables.shape[1] - 1)]
    page = jnp.where(live[row], page, NULL_PAGE)
    kv_slots = jnp.where(valid, page * page_size + positions % page_size, a.kv_slots)
    seq_lens = jnp.where(a.idx_mapping > 0, a.seq_lens + shift, a.seq_lens)
    return a.replace(positions=positions, kv_slots=kv_slots, seq_lens=seq_lens,
                     idx_mapping=jnp.where(live, a.idx_mapping, 0),
                     fresh=a.fresh if fresh else jnp.zeros_like(a.fresh), samples=a.samples & live)


def _step_meta(a: StepArrays) -> StepMeta:
    return StepMeta(positions=a.positions, token_row=a.token_row, kv_slots=a.kv_slots,
                    query_start_loc=a.query_start_loc, seq_lens=a.seq_lens, idx_mapping=a.idx_mapping,
                    block_tables=a.block_tables, fresh=a.fresh, verify_path=a.verify_path,
                    block_row=a.block_row, block_start=a.block_start)


@struct.dataclass
class Forwarded:
    """What a step's model forward leaves for its sampling and its commit (device arrays)."""

    ids: jax.Array  # [T] the tokens the model consumed
    hidden: jax.Array  # [T, H] after the final norm
    tok_at: jax.Array  # [R, 1+K] flat token index of each logits row
    drafts: jax.Array  # [R, K] the drafts each row verifies
    n_draft: jax.Array  # [R]


@struct.dataclass
class SamplingRows:
    """A step's per-row sampling inputs, [R] unless noted: all a sampler program (`sample_part`) reads besides the
    state's penalty counts and the launch's extras."""

    hidden: jax.Array  # [R, 1+K, H] the logits rows' hidden states
    drafts: jax.Array  # [R, K]
    n_draft: jax.Array
    idx: jax.Array  # slots
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    keys_at: jax.Array  # [R, 1+K] positions of the tokens each logits row samples
    seeds: jax.Array
    request_ids: jax.Array

    @classmethod
    def of(cls, a: StepArrays, f: Forwarded) -> "SamplingRows":
        return cls(hidden=f.hidden[f.tok_at], drafts=f.drafts, n_draft=f.n_draft, idx=a.idx_mapping,
                   temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, keys_at=a.positions[f.tok_at] + 1,
                   seeds=a.seeds, request_ids=a.request_ids)


def _device_step(params: ModelParams, state: EngineState, a: StepArrays, *, cfg: ModelConfig,
                 policy: KernelPolicy, reproduce_pd_mtp_bug: bool, sampler: int = Sampler.SAMPLE, width: int = 0):
    """A fused step (sampler GREEDY or SAMPLE): (state, tokens [R, 1+K], num_sampled [R], drafts [R, K], ids [T],
    the logits rows' hidden states [R, 1+K, H])."""
    state, f = forward_part(params, state, a, cfg=cfg, policy=policy, reproduce_pd_mtp_bug=reproduce_pd_mtp_bug,
                            width=width)
    rows = SamplingRows.of(a, f)
    tokens, num_sampled, _ = sample_part(params, state, rows, None, sampler=sampler, cfg=cfg, policy=policy)
    state, new_drafts, num_sampled = commit_part(params, state, a, f, tokens, num_sampled, cfg=cfg, policy=policy,
                                                 count_outputs=False)
    return state, tokens, num_sampled, new_drafts, f.ids, rows.hidden


def forward_part(params: ModelParams, state: EngineState, a: StepArrays, *, cfg: ModelConfig, policy: KernelPolicy,
                 reproduce_pd_mtp_bug: bool, width: int = 0) -> tuple[EngineState, Forwarded]:
    """Input assembly and the model over the step's rows: (state with the pools written, Forwarded)."""
    K = state.draft_tokens.shape[1]
    W = 1 + K
    R = a.idx_mapping.shape[0]
    S = state.last_sampled.shape[0]
    idx = a.idx_mapping
    # Placeholder drafts of a padded prompt tail reach the device as -1 (vLLM #54137 lost them).
    draft_tokens = state.draft_tokens.at[jnp.where(a.pad_tail, idx, S)].set(-1, mode="drop")
    num_logits = R * W
    ids, logits_indices = combine_sampled_and_draft_tokens(
        a.input_ids, idx, state.last_sampled, a.query_start_loc, a.seq_lens, a.prefill_len,
        draft_tokens, a.cu_num_logits, num_logits=num_logits, unguarded=reproduce_pd_mtp_bug, impl=policy.input_impl,
    )
    hidden, state = forward(params, cfg, ids, _step_meta(a), state.replace(draft_tokens=draft_tokens), policy, width)
    # Logits rows as [R, 1+K]: row b's i-th logits row is cu[b] + i; it reads the token at flat index
    # logits_indices[cu[b] + i], and the draft it verifies sits at the next flat index.
    cu = a.cu_num_logits
    n_draft = jnp.maximum(cu[1:] - cu[:-1] - 1, 0)
    rows = jnp.clip(cu[:-1, None] + jnp.arange(W)[None, :], 0, num_logits - 1)
    tok_at = logits_indices[rows]
    drafts = ids[jnp.clip(tok_at[:, 1:], 0, ids.shape[0] - 1)]  # [R, K]
    return state, Forwarded(ids=ids, hidden=hidden, tok_at=tok_at, drafts=drafts, n_draft=n_draft)


def sample_part(params: ModelParams, state: EngineState, rows: SamplingRows, extras, *, sampler: int,
                cfg: ModelConfig, policy: KernelPolicy):
    """Sample and verify each row's tokens: (tokens [R, 1+K], num_sampled [R], scores: [logprobs.pack of the
    sampled tokens] with sampler & LOGPROBS, else []). extras: .penalties, .logit_bias and .bitmask (penalties.py,
    host_masks.py), read with sampler & PENALIZE / GUIDED."""
    stochastic = bool(sampler & Sampler.SAMPLE)
    R, W = rows.keys_at.shape
    # Greedy programs need only the argmax, which tensor parallelism forms without gathering the logits.
    if stochastic or sampler & (Sampler.LOGPROBS | Sampler.GUIDED | Sampler.PENALIZE):
        logits, greedy = head_logits(params, rows.hidden, cfg.vocab_size, policy).astype(jnp.float32), None  # [R, W, V]
    else:
        logits, greedy = None, head_argmax(params, rows.hidden, cfg.vocab_size, policy)  # [R, W]
    raw_logits = logits  # what logprobs report
    if sampler & Sampler.PENALIZE:
        logits = penalties.apply(logits, state.output_counts[rows.idx], state.prompt_tokens[rows.idx], rows.drafts,
                                 rows.n_draft, extras.penalties, extras.logit_bias)
    if sampler & Sampler.GUIDED:  # tokens outside a constrained row's grammar are never sampled or accepted
        logits = jnp.where(allowed(extras.bitmask, logits.shape[-1]).reshape(logits.shape), logits, -jnp.inf)
    keys = position_keys(jnp.repeat(rows.seeds, W), jnp.repeat(rows.request_ids, W),
                         rows.keys_at.reshape(-1)).reshape(R, W)
    tokens, num_sampled = verify_drafts(logits, rows.drafts, rows.n_draft, rows.temperature, rows.top_k, rows.top_p,
                                        keys, stochastic, argmax=greedy, vocab_size=cfg.vocab_size)
    scores = [pack(score(raw_logits.reshape(R * W, -1), tokens.reshape(-1)))] if sampler & Sampler.LOGPROBS else []
    return tokens, num_sampled, scores


def stream_part(params: ModelParams, f: Forwarded, a: StepArrays, *, cfg: ModelConfig, policy: KernelPolicy):
    """logprobs.pack of the scores of every token's successor in the stream (prompt logprobs)."""
    targets = stream_targets(f.ids, a.token_row, a.next_token)
    return pack(score_stream(params, f.hidden, targets, cfg.vocab_size, policy))


def commit_part(params: ModelParams, state: EngineState, a: StepArrays, f: Forwarded, tokens, num_sampled, *,
                cfg: ModelConfig, policy: KernelPolicy, count_outputs: bool):
    """Book the sampled tokens in the per-slot state (last_sampled, stop flags, accepted and computed counts,
    with count_outputs the penalties' output counts) and propose the next drafts: (state, drafts [R, K],
    num_sampled [R], 0 for rows that do not sample)."""
    K = state.draft_tokens.shape[1]
    W = 1 + K
    R = a.idx_mapping.shape[0]
    S = state.last_sampled.shape[0]
    idx = a.idx_mapping
    real = idx > 0
    samples = a.samples & real
    num_sampled = jnp.where(samples, num_sampled, 0)
    last_token = jnp.take_along_axis(tokens, jnp.maximum(num_sampled - 1, 0)[:, None], 1)[:, 0]
    last_sampled = state.last_sampled.at[jnp.where(samples, idx, S)].set(last_token, mode="drop")
    sampled = jnp.arange(W)[None, :] < num_sampled[:, None]  # [R, W] the tokens the row emitted
    hit = jnp.any(sampled & jnp.any(tokens[..., None] == a.stop_ids[:, None, :], -1), -1)  # [R]
    stopped = state.stopped.at[jnp.where(samples & hit, idx, S)].set(True, mode="drop")
    output_counts = state.output_counts
    if count_outputs:
        output_counts = penalties.count(output_counts, jnp.where(samples, idx, S), tokens, num_sampled)
    # Rollback is selection: the next step reads checkpoint num_accepted - 1.
    committed = jnp.where(a.verify_path, jnp.maximum(num_sampled, 1), 1)
    num_accepted = state.num_accepted.at[jnp.where(real, idx, S)].set(committed, mode="drop")
    # The row's committed tokens: its tokens but the rejected drafts (as the host's num_computed).
    num_rejected = jnp.where(samples, f.n_draft - (num_sampled - 1), 0)
    num_computed = state.num_computed.at[jnp.where(real, idx, S)].set(a.seq_lens - num_rejected, mode="drop")

    new_drafts = jnp.zeros((R, K), jnp.int32)
    mtp_layers, draft_tokens = state.mtp_layers, state.draft_tokens
    if K and params.mtp is not None:
        new_drafts, mtp_layers = _propose_drafts(params, cfg, a, _step_meta(a), f.ids, f.hidden, tokens, num_sampled,
                                                 f.n_draft, samples, last_token, mtp_layers, K, policy)
        draft_tokens = draft_tokens.at[jnp.where(samples, idx, S)].set(new_drafts, mode="drop")
    state = state.replace(mtp_layers=mtp_layers, last_sampled=last_sampled, draft_tokens=draft_tokens,
                          num_accepted=num_accepted, num_computed=num_computed, stopped=stopped,
                          output_counts=output_counts)
    return state, new_drafts, num_sampled


def _propose_drafts(params, cfg, a, meta: StepMeta, ids, hidden, tokens, num_sampled, n_draft, samples, last_token,
                    mtp_layers, K, policy: KernelPolicy):
    """MTP drafting after verification (vLLM's eagle/MTP proposer, shift-left form), on the flat stream.

    Token t of a row gets (trunk hidden at its position p, token at p + 1): the next input token of the
    row, and for the row's last kept token the token just sampled (or, for a prefill chunk, the next
    prompt token). Rejected drafts are dropped (no row: they write the null page and attend to nothing).
    Draft 0 comes from the last kept token; drafts 1..K-1 chain one token a row at a time on the MTP's own
    output hidden. Drafts are greedy (argmax)."""
    T = ids.shape[0]
    R = meta.idx_mapping.shape[0]
    qsl = meta.query_start_loc
    num_rejected = jnp.where(samples, n_draft - (num_sampled - 1), 0)
    keep = _row_lengths(a) - num_rejected  # tokens whose token was accepted (or is a prompt token)
    valid = meta.valid
    row = jnp.clip(meta.token_row, 0, R - 1)
    offset = jnp.arange(T, dtype=jnp.int32) - qsl[row]
    kept = valid & (offset < keep[row])
    next_in_row = ids[jnp.clip(jnp.arange(T) + 1, 0, T - 1)]
    last_next = jnp.where(samples, last_token, a.next_token)
    eagle_ids = jnp.where(offset == keep[row] - 1, last_next[row], next_in_row)
    mtp_meta = meta.replace(  # dropped tokens write to the null page (flat slot 0)
        token_row=jnp.where(kept, meta.token_row, -1), kv_slots=jnp.where(kept, meta.kv_slots, 0),
        seq_lens=meta.seq_lens - num_rejected)
    m, mtp_layers = mtp_ragged(params, cfg, hidden, eagle_ids, mtp_meta, mtp_layers, policy)
    last = jnp.clip(qsl[:-1] + keep - 1, 0, T - 1)  # [R] each row's last kept token
    h = m[last]  # [R, H]
    pos = meta.positions[last]  # [R]
    draft = head_argmax(params, h, cfg.vocab_size, policy)
    drafts = [draft]
    ps = mtp_layers[0].k.shape[1]
    MP = meta.block_tables.shape[1]
    rows = jnp.arange(R, dtype=jnp.int32)
    for _ in range(K - 1):  # one token a row: a step of R tokens, row r's at index r
        pos = pos + 1
        page_idx = pos // ps
        in_range = samples & (page_idx < MP)
        page = meta.block_tables[rows, jnp.clip(page_idx, 0, MP - 1)]
        chain = StepMeta(positions=pos, token_row=jnp.where(in_range, rows, -1),
                         kv_slots=jnp.where(in_range, page * ps + pos % ps, 0),
                         query_start_loc=jnp.arange(R + 1, dtype=jnp.int32), seq_lens=jnp.where(samples, pos + 1, 0),
                         idx_mapping=meta.idx_mapping, block_tables=meta.block_tables, fresh=meta.fresh,
                         verify_path=meta.verify_path, block_row=jnp.where(in_range, rows, -1), block_start=rows)
        h, mtp_layers = mtp_ragged(params, cfg, h, draft, chain, mtp_layers, policy)
        draft = head_argmax(params, h, cfg.vocab_size, policy)
        drafts.append(draft)
    return jnp.stack(drafts, axis=1), mtp_layers
