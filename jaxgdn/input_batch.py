"""Host-side assembly of one step's arrays from the scheduler output, padded to buckets.

The flat ragged layout follows vLLM: input_ids[T], query_start_loc[R+1], seq_lens[R], idx_mapping[R],
cu_num_logits[R+1], per-slot prefill_len[S]. The host places only prompt tokens (positions below
prefill_len); sampled and draft tokens are placed on device by the input-assembly kernel. T, R and the
row width Q and block-table width MP are padded to powers of two (one jit trace per bucket) unless
enforce_eager.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .cache import NULL_PAGE
from .engine_config import EngineConfig
from .request import RowKind
from .scheduler import ScheduledRow, runs_verify_path


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    n = max(n, minimum)
    return 1 << (n - 1).bit_length()


WHOLE_PROMPT_MIN_QUERIES = 64  # see StepArrays.whole_prompts


@dataclasses.dataclass
class StepArrays:
    """Numpy arrays of one step; field names match the device step's arguments."""

    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    query_start_loc: np.ndarray  # [R+1]
    seq_lens: np.ndarray  # [R]
    idx_mapping: np.ndarray  # [R]
    cu_num_logits: np.ndarray  # [R+1]
    prefill_len: np.ndarray  # [S]
    token_index: np.ndarray  # [R, Q]
    row_positions: np.ndarray  # [R, Q]
    kv_slots: np.ndarray  # [R, Q]
    block_tables: np.ndarray  # [R, MP]
    fresh: np.ndarray  # [R] bool
    verify_path: np.ndarray  # [R] bool: GDN writes per-position checkpoints
    pad_tail: np.ndarray  # [R] bool: a prompt tail padded with -1 placeholder drafts
    next_token: np.ndarray  # [R] the token after a non-sampling chunk (for the MTP's last cell)
    samples: np.ndarray  # [R] bool
    token_budget: np.ndarray  # [R] tokens the row may emit in a launch of several steps (runner._advance_rows)
    rebase: np.ndarray  # [R] bool: the row starts where the device's count says (async scheduling with MTP)
    row_kind: np.ndarray  # [R] int32 RowKind
    temperature: np.ndarray  # [R] sampling parameters per row
    top_k: np.ndarray  # [R]
    top_p: np.ndarray  # [R]
    seeds: np.ndarray  # [R] uint32
    request_ids: np.ndarray  # [R] uint32

    @property
    def whole_prompts(self) -> bool:
        """Every row starts at position 0 (its sequence is this step's tokens: seq_lens == its cells), in a
        bucket of at least WHOLE_PROMPT_MIN_QUERIES cells per row. The device step then attends to the
        step's own K/V without reading pages (`paged_forward.paged_attention`), as its own compiled program;
        shorter buckets (decode, verify) keep one program whatever their rows are."""
        if self.token_index.shape[1] < WHOLE_PROMPT_MIN_QUERIES:
            return False
        return bool(np.all(self.seq_lens == np.sum(self.token_index >= 0, axis=1)))

    @property
    def shape_key(self) -> tuple[int, int, int, int]:
        """(T, R, Q, MP): one compiled program per distinct key."""
        return (self.input_ids.shape[0], self.idx_mapping.shape[0], self.token_index.shape[1],
                self.block_tables.shape[1])


def build_step(rows: list[ScheduledRow], ecfg: EngineConfig, slot_prefill_len: np.ndarray,
               rebase: list[bool] | None = None) -> StepArrays:
    """Flatten scheduled rows into padded arrays. slot_prefill_len: [S] per-slot prompt lengths. rebase:
    per row, whether its previous launch is still in flight (its num_computed is the host's guess)."""
    num_spec = ecfg.num_speculative_tokens
    n_rows = len(rows)
    n_tokens = sum(r.num_tokens for r in rows)
    max_q = max((r.num_tokens for r in rows), default=1)
    if ecfg.enforce_eager:
        T, R, Q = n_tokens, n_rows, max_q
    else:
        T = bucket(n_tokens, 8)
        R = bucket(n_rows)
        Q = min(bucket(max_q), T)
    if num_spec:  # verification checkpoints read the first 1+K cells of every row
        Q = max(Q, 1 + num_spec)
        T = max(T, Q)
    ps = ecfg.kv_page_size
    # Block tables as wide as this step's longest row needs (+K for the MTP chain's draft positions),
    # padded to a power of two: attention reads MP pages per row, so a max_model_len-wide table would
    # make every decode step read the whole context window.
    # (+ the later steps of a launch of several steps: each moves the window on by at most its width)
    need = max((-(-(r.request.num_computed + r.num_tokens * r.launch_steps + num_spec) // ps) for r in rows),
               default=1)
    MP = ecfg.max_pages_per_seq if ecfg.enforce_eager else min(bucket(need), ecfg.max_pages_per_seq)

    input_ids = np.zeros(T, np.int32)
    positions = np.zeros(T, np.int32)
    qsl = np.zeros(R + 1, np.int32)
    cu = np.zeros(R + 1, np.int32)
    token_index = np.full((R, Q), -1, np.int32)
    row_pos = np.zeros((R, Q), np.int32)
    kv_slots = np.tile(np.arange(Q, dtype=np.int32) % ps + NULL_PAGE * ps, (R, 1))
    block_tables = np.full((R, MP), NULL_PAGE, np.int32)

    def per_row(values, dtype, fill=0):
        out = np.full(R, fill, dtype)
        out[:n_rows] = values
        return out

    # Per-row scalars are collected as Python lists and written once; only prompt tokens and page lists
    # are copied row by row (a decode row costs a few list appends, not a dozen numpy calls).
    reqs = [r.request for r in rows]
    sps = [q.sampling_params for q in reqs]
    n_tok = np.array([r.num_tokens for r in rows], np.int32)
    start = np.array([q.num_computed for q in reqs], np.int32)
    qsl[1 : n_rows + 1] = np.cumsum(n_tok)
    qsl[n_rows + 1 :] = n_tokens
    cu[1 : n_rows + 1] = np.cumsum([1 + len(r.spec_tokens) for r in rows])
    cu[n_rows + 1 :] = cu[n_rows]
    for b, row in enumerate(rows):
        req = row.request
        block_tables[b, : min(len(req.pages), MP)] = req.pages[:MP]
        # Host places tokens it knows to be prompt (or recompute) tokens; the kernel places the rest.
        known_end = min(req.num_computed + row.num_tokens, req.prefill_len)
        if known_end > req.num_computed:
            t = qsl[b]
            input_ids[t : t + known_end - req.num_computed] = req.token_array(req.num_computed, known_end)
    # Flat token j belongs to row row_of[j] at column col[j] of the [R, Q] view: cell row_of * Q + col of
    # the flattened view (flat indices: these writes take 0.17-0.25 ms at 8192 tokens against 0.34-0.35
    # with 2-D indices, on a 2-core CPU).
    row_of = np.repeat(np.arange(n_rows), n_tok)
    col = np.arange(n_tokens) - qsl[row_of]
    pos = start[row_of] + col
    positions[:n_tokens] = pos
    cell = row_of * Q + col
    np.put(token_index, cell, np.arange(n_tokens))
    np.put(row_pos, cell, pos)
    np.put(kv_slots, cell, np.take(block_tables, row_of * MP + pos // ps) * ps + pos % ps)
    # A seeded request's noise depends only on (seed, position), so it reproduces in any batch and
    # under any request id; unseeded requests are keyed by their request id instead.
    seeds = [(sp.seed if sp.seed is not None else 0) & 0xFFFFFFFF for sp in sps]
    request_ids = [0 if sp.seed is not None else (q.request_id + 1) & 0xFFFFFFFF for q, sp in zip(reqs, sps)]
    next_token = [q.token_after(q.num_computed + r.num_tokens) for q, r in zip(reqs, rows)]
    return StepArrays(
        input_ids=input_ids, positions=positions, query_start_loc=qsl,
        seq_lens=per_row(start + n_tok, np.int32),
        idx_mapping=per_row([q.slot for q in reqs], np.int32),
        cu_num_logits=cu, prefill_len=slot_prefill_len.astype(np.int32),
        token_index=token_index, row_positions=row_pos, kv_slots=kv_slots, block_tables=block_tables,
        fresh=per_row(start == 0, bool),
        verify_path=per_row([runs_verify_path(r, ecfg.reproduce_pd_mtp_bug) for r in rows], bool),
        pad_tail=per_row([r.padded_tail for r in rows], bool),
        next_token=per_row(next_token, np.int32),
        samples=per_row([r.samples for r in rows], bool),
        token_budget=per_row([r.token_budget for r in rows], np.int32),
        rebase=per_row(rebase or False, bool),
        row_kind=per_row([int(r.kind) for r in rows], np.int32, fill=int(RowKind.PAD)),
        temperature=per_row([sp.temperature for sp in sps], np.float32),
        top_k=per_row([sp.top_k for sp in sps], np.int32),
        top_p=per_row([sp.top_p for sp in sps], np.float32, fill=1.0),
        seeds=per_row(seeds, np.uint32), request_ids=per_row(request_ids, np.uint32),
    )
