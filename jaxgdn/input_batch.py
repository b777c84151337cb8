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
    row_kind: np.ndarray  # [R] int32 RowKind
    temperature: np.ndarray  # [R] sampling parameters per row
    top_k: np.ndarray  # [R]
    top_p: np.ndarray  # [R]
    seeds: np.ndarray  # [R] uint32
    request_ids: np.ndarray  # [R] uint32

    @property
    def shape_key(self) -> tuple[int, int, int, int]:
        """(T, R, Q, MP): one compiled program per distinct key."""
        return (self.input_ids.shape[0], self.idx_mapping.shape[0], self.token_index.shape[1],
                self.block_tables.shape[1])


def build_step(rows: list[ScheduledRow], ecfg: EngineConfig, slot_prefill_len: np.ndarray) -> StepArrays:
    """Flatten scheduled rows into padded arrays. slot_prefill_len: [S] per-slot prompt lengths."""
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
    need = max((-(-(r.request.num_computed + r.num_tokens + num_spec) // ps) for r in rows), default=1)
    MP = ecfg.max_pages_per_seq if ecfg.enforce_eager else min(bucket(need), ecfg.max_pages_per_seq)

    input_ids = np.zeros(T, np.int32)
    positions = np.zeros(T, np.int32)
    qsl = np.zeros(R + 1, np.int32)
    seq_lens = np.zeros(R, np.int32)
    idx = np.zeros(R, np.int32)
    cu = np.zeros(R + 1, np.int32)
    token_index = np.full((R, Q), -1, np.int32)
    row_pos = np.zeros((R, Q), np.int32)
    kv_slots = np.tile(np.arange(Q, dtype=np.int32) % ps + NULL_PAGE * ps, (R, 1))
    block_tables = np.full((R, MP), NULL_PAGE, np.int32)
    fresh = np.zeros(R, bool)
    verify_path = np.zeros(R, bool)
    pad_tail = np.zeros(R, bool)
    next_token = np.zeros(R, np.int32)
    samples = np.zeros(R, bool)
    kinds = np.full(R, int(RowKind.PAD), np.int32)
    temperature = np.zeros(R, np.float32)
    top_k = np.zeros(R, np.int32)
    top_p = np.ones(R, np.float32)
    seeds = np.zeros(R, np.uint32)
    request_ids = np.zeros(R, np.uint32)

    t = 0
    for b, row in enumerate(rows):
        req, n = row.request, row.num_tokens
        start = req.num_computed
        tokens = req.all_token_ids
        pos = np.arange(start, start + n, dtype=np.int32)
        # Host places tokens it knows to be prompt (or recompute) tokens; the kernel places the rest.
        known = pos < req.prefill_len
        input_ids[t : t + n] = np.where(known, [tokens[p] if p < len(tokens) else 0 for p in pos], 0)
        positions[t : t + n] = pos
        qsl[b + 1] = t + n
        seq_lens[b] = start + n
        idx[b] = req.slot
        n_logits = 1 + len(row.spec_tokens)
        cu[b + 1] = cu[b] + n_logits
        token_index[b, :n] = np.arange(t, t + n)
        row_pos[b, :n] = pos
        pages = np.asarray(req.pages, np.int32)
        block_tables[b, : min(len(pages), MP)] = pages[:MP]
        kv_slots[b, :n] = pages[pos // ps] * ps + pos % ps
        fresh[b] = start == 0
        verify_path[b] = runs_verify_path(row, ecfg.reproduce_pd_mtp_bug)
        pad_tail[b] = row.padded_tail
        end = start + n
        next_token[b] = tokens[end] if end < len(tokens) else (req.next_prompt_token or 0)
        samples[b] = row.samples
        kinds[b] = int(row.kind)
        sp = req.sampling_params
        temperature[b], top_k[b], top_p[b] = sp.temperature, sp.top_k, sp.top_p
        # A seeded request's noise depends only on (seed, position), so it reproduces in any batch and
        # under any request id; unseeded requests are keyed by their request id instead.
        seeds[b] = (sp.seed if sp.seed is not None else 0) & 0xFFFFFFFF
        request_ids[b] = 0 if sp.seed is not None else (req.request_id + 1) & 0xFFFFFFFF
        t += n
    qsl[n_rows + 1 :] = t
    cu[n_rows + 1 :] = cu[n_rows]
    return StepArrays(
        input_ids=input_ids, positions=positions, query_start_loc=qsl, seq_lens=seq_lens, idx_mapping=idx,
        cu_num_logits=cu, prefill_len=slot_prefill_len.astype(np.int32), token_index=token_index,
        row_positions=row_pos, kv_slots=kv_slots, block_tables=block_tables, fresh=fresh, verify_path=verify_path,
        pad_tail=pad_tail, next_token=next_token, samples=samples,
        row_kind=kinds, temperature=temperature, top_k=top_k, top_p=top_p, seeds=seeds, request_ids=request_ids,
    )
