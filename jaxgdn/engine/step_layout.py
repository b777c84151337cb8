"""Host-side assembly of one step's arrays from the scheduler output, in the shape of a fixed program.

The flat ragged layout follows vLLM: input_ids[T], positions[T], query_start_loc[R+1], seq_lens[R],
idx_mapping[R], cu_num_logits[R+1], per-slot prefill_len[S], plus the row of each token (token_row[T], -1
for padding) and each row's block table [R, max_pages_per_seq]. The host places only prompt tokens
(positions below prefill_len); sampled and draft tokens are placed on device by the input-assembly kernel.
T and R are the program's (`programs.StepShape`): the step's tokens and rows come first, padding after.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pallas_kernels.ragged_attention import num_query_blocks, query_blocks

from .config import EngineConfig
from .programs import StepShape
from .request import Request, RowKind
from .scheduler import ScheduledRow, runs_verify_path
from .state import NULL_PAGE


HOST_ONLY = ("row_kind", "bitmask", "penalties", "logit_bias")  # StepArrays fields not in the packed buffer
DEVICE_STOPS = 4  # stop tokens per row the device checks (the host checks them all)


class StopTable:
    """Each slot's stop tokens the device checks ([S, DEVICE_STOPS], -1 padded), written when a request's first
    row is built (`build_step`), as BlockTables holds the slots' pages."""

    def __init__(self, num_slots: int, eos_token_ids: tuple):
        self.table = np.full((num_slots, DEVICE_STOPS), -1, np.int32)
        self.eos_token_ids = tuple(eos_token_ids)

    def admit(self, req: Request) -> None:
        self.table[req.slot] = device_stop_ids(req.sampling_params, self.eos_token_ids)


def device_stop_ids(params, eos_token_ids: tuple) -> np.ndarray:
    """[DEVICE_STOPS] the stop tokens the device checks for a request, -1 padded: its EOS tokens (unless
    ignore_eos), then its stop_token_ids. Each is a token the host finishes the request on
    (`Update.finish_if_done`), so a slot the device flags never has a request that goes on."""
    ids = list(dict.fromkeys((() if params.ignore_eos else tuple(eos_token_ids)) + tuple(params.stop_token_ids)))
    out = np.full(DEVICE_STOPS, -1, np.int32)
    out[: min(len(ids), DEVICE_STOPS)] = ids[:DEVICE_STOPS]
    return out


@struct.dataclass
class StepArrays:
    """One step's arrays: numpy on the host, then (`pack_step_arrays` / `unpack_step_arrays`) device arrays
    inside the step program, with row_kind, host bookkeeping only, None there."""

    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    token_row: np.ndarray  # [T] row of each token, -1 for padding
    kv_slots: np.ndarray  # [T] flat KV pool slot (page * page_size + offset); the null page for padding
    query_start_loc: np.ndarray  # [R+1]
    seq_lens: np.ndarray  # [R]
    idx_mapping: np.ndarray  # [R]
    cu_num_logits: np.ndarray  # [R+1]
    prefill_len: np.ndarray  # [S]
    block_tables: np.ndarray  # [R, MP]
    block_row: np.ndarray  # [NB] the attention kernel's query blocks (`ragged_attention.query_blocks`)
    block_start: np.ndarray  # [NB]
    fresh: np.ndarray  # [R] bool
    verify_path: np.ndarray  # [R] bool: GDN writes per-position checkpoints
    pad_tail: np.ndarray  # [R] bool: a prompt tail padded with -1 placeholder drafts
    next_token: np.ndarray  # [R] the token after a non-sampling chunk (for the MTP's last cell)
    samples: np.ndarray  # [R] bool
    token_budget: np.ndarray  # [R] tokens the row may emit in a launch of several steps (device_step._advance_rows)
    stop_ids: np.ndarray  # [R, DEVICE_STOPS] tokens that end the row's request (-1: none), checked on the device
    first_row: np.ndarray  # [R] bool: the request's first row since it was admitted (clears its slot's stop flag)
    rebase: np.ndarray  # [R] bool: the row starts where the device's count says (async scheduling with MTP)
    row_kind: np.ndarray  # [R] int32 RowKind
    temperature: np.ndarray  # [R] sampling parameters per row
    top_k: np.ndarray  # [R]
    top_p: np.ndarray  # [R]
    seeds: np.ndarray  # [R] uint32
    request_ids: np.ndarray  # [R] uint32
    # [R * (1+K), ceil(V/32)] int32: the tokens each logits row may take (host_masks.launch_bitmask); None: any
    bitmask: np.ndarray | None = None
    # penalties.penalty_arrays: [R, 3] f32 presence, frequency, repetition; [R, 2, B] logit bias ids and values
    penalties: np.ndarray | None = None
    logit_bias: np.ndarray | None = None


class BlockTables:
    """The host's copy of every slot's block table, [S, max_pages_per_seq]: a row's pages are written once,
    when the scheduler allocates them, and each step copies the rows of its requests. filled[slot]: how many of
    its request's pages the slot's row holds."""

    def __init__(self, num_slots: int, max_pages: int):
        self.table = np.full((num_slots, max_pages), NULL_PAGE, np.int32)
        self.filled = np.zeros(num_slots, np.int64)

    def sync(self, req: Request, first: bool) -> None:
        """Write req's pages not in its slot's row yet (first: its first row since it was admitted: none are)."""
        n, done = len(req.pages), 0 if first else int(self.filled[req.slot])
        if n > done:
            self.table[req.slot, done:n] = req.pages[done:n]
        self.filled[req.slot] = n


def build_step(rows: list[ScheduledRow], shape: StepShape, ecfg: EngineConfig, slot_prefill_len: np.ndarray,
               tables: BlockTables, block_q: int, rebase: list[bool] | None = None,
               stops: StopTable | None = None, first: list[bool] | None = None) -> StepArrays:
    """Flatten scheduled rows into the arrays of a program of `shape`. slot_prefill_len: [S] per-slot prompt
    lengths; tables: the block tables (synced here); block_q: the attention kernel's queries per block;
    rebase: per row, whether its previous launch is still in flight (its num_computed is the host's guess);
    stops: the slots' stop tokens (None: none), written for each request's first row; first: per row, whether it is
    its request's first since the request was admitted (None: every row is)."""
    n_rows = len(rows)
    n_tok = np.array([r.num_tokens for r in rows], np.int32)
    n_tokens = int(n_tok.sum())
    T, R = shape.tokens, shape.rows
    if n_tokens > T or n_rows > R or (shape.width and np.any(n_tok != shape.width)):
        raise ValueError(f"{n_rows} rows of {n_tokens} tokens do not fit the program shape {shape}")
    ps = ecfg.kv_page_size

    def per_row(values, dtype, fill=0):
        out = np.full(R, fill, dtype)
        out[:n_rows] = values
        return out

    reqs = [r.request for r in rows]
    first = [True] * n_rows if first is None else first
    sps = [q.sampling_params for q in reqs]
    start = np.array([q.num_computed for q in reqs], np.int32)
    qsl = np.full(R + 1, n_tokens, np.int32)
    qsl[0] = 0
    qsl[1 : n_rows + 1] = np.cumsum(n_tok)
    cu = np.zeros(R + 1, np.int32)
    cu[1 : n_rows + 1] = np.cumsum([1 + len(r.spec_tokens) for r in rows])
    cu[n_rows + 1 :] = cu[n_rows]
    input_ids = np.zeros(T, np.int32)
    for b, row in enumerate(rows):
        req = row.request
        tables.sync(req, first[b])
        # Host places tokens it knows to be prompt (or recompute) tokens; the kernel places the rest.
        known_end = min(req.num_computed + row.num_tokens, req.prefill_len)
        if known_end > req.num_computed:
            t = qsl[b]
            input_ids[t : t + known_end - req.num_computed] = req.token_array(req.num_computed, known_end)
    idx_mapping = per_row([q.slot for q in reqs], np.int32)
    block_tables = tables.table[idx_mapping]  # padding rows read the null slot's row: null pages
    row_of = np.repeat(np.arange(n_rows, dtype=np.int32), n_tok)
    pos = start[row_of] + np.arange(n_tokens, dtype=np.int32) - qsl[row_of]
    token_row = np.full(T, -1, np.int32)
    token_row[:n_tokens] = row_of
    positions = np.zeros(T, np.int32)
    positions[:n_tokens] = pos
    kv_slots = np.arange(T, dtype=np.int32) % ps + NULL_PAGE * ps
    kv_slots[:n_tokens] = block_tables[row_of, pos // ps] * ps + pos % ps
    block_row, block_start = query_blocks(qsl, n_rows, block_q, num_query_blocks(T, R, block_q))
    # A seeded request's noise depends only on (seed, position), so it reproduces in any batch and
    # under any request id; unseeded requests are keyed by their request id instead. A seed's high word
    # takes the request id's place (0 below 2**32, so those seeds sample as 32-bit seeds did).
    words = [sp.seed_words for sp in sps]
    seeds = [lo for lo, _ in words]
    request_ids = [hi if sp.seed is not None else (q.request_id + 1) & 0xFFFFFFFF
                   for q, sp, (_, hi) in zip(reqs, sps, words)]
    next_token = [q.token_after(q.num_computed + r.num_tokens) for q, r in zip(reqs, rows)]
    for q, is_first in zip(reqs, first):
        if is_first and stops is not None:
            stops.admit(q)
    return StepArrays(
        input_ids=input_ids, positions=positions, token_row=token_row, kv_slots=kv_slots, query_start_loc=qsl,
        seq_lens=per_row(start + n_tok, np.int32), idx_mapping=idx_mapping, cu_num_logits=cu,
        prefill_len=slot_prefill_len.astype(np.int32), block_tables=block_tables, block_row=block_row,
        block_start=block_start, fresh=per_row(start == 0, bool),
        verify_path=per_row([runs_verify_path(r, ecfg.reproduce_pd_mtp_bug) for r in rows], bool),
        pad_tail=per_row([r.padded_tail for r in rows], bool),
        next_token=per_row(next_token, np.int32),
        samples=per_row([r.samples for r in rows], bool),
        token_budget=per_row([r.token_budget for r in rows], np.int32),
        stop_ids=(stops.table[idx_mapping] if stops is not None else np.full((R, DEVICE_STOPS), -1, np.int32)),
        first_row=per_row(first, bool),
        rebase=per_row(rebase or False, bool),
        row_kind=per_row([int(r.kind) for r in rows], np.int32, fill=int(RowKind.PAD)),
        temperature=per_row([sp.temperature for sp in sps], np.float32),
        top_k=per_row([sp.top_k for sp in sps], np.int32),
        top_p=per_row([sp.top_p for sp in sps], np.float32, fill=1.0),
        seeds=per_row(seeds, np.uint32), request_ids=per_row(request_ids, np.uint32),
    )


def empty_step(shape: StepShape, ecfg: EngineConfig, block_q: int) -> StepArrays:
    """A step of `shape` with no rows (every token and row padding): what start-up compiles each program on."""
    tables = BlockTables(ecfg.num_slots, ecfg.max_pages_per_seq)
    return build_step([], shape, ecfg, np.zeros(ecfg.num_slots, np.int32), tables, block_q)


def program_layout(shape: StepShape, ecfg: EngineConfig, block_q: int) -> tuple:
    """The static layout of a program of `shape`."""
    return pack_step_arrays(empty_step(shape, ecfg, block_q))[1]


def pack_step_arrays(arrays: StepArrays) -> tuple[np.ndarray, tuple]:
    """All of a step's host arrays as one int32 buffer (one host-to-device copy instead of ~20 small ones)
    and its static layout ((name, shape, dtype), ...). float32/uint32 travel bit-cast, bools as 0/1."""
    parts, layout = [], []
    for name, x in vars(arrays).items():
        if name in HOST_ONLY or x is None:  # the split launch's sample program takes the sampling extras
            continue
        x = np.ascontiguousarray(x)
        if x.dtype.itemsize != 4 and x.dtype != np.bool_:
            raise TypeError(f"StepArrays.{name}: {x.dtype} does not travel in the int32 buffer")
        parts.append(x.view(np.int32).ravel() if x.dtype.itemsize == 4 else x.astype(np.int32).ravel())
        layout.append((name, x.shape, x.dtype.name))
    return np.concatenate(parts), tuple(layout)


def unpack_step_arrays(buf, layout: tuple) -> StepArrays:
    """Inverse of pack_step_arrays on device: static slices of the int32 buffer, bit-cast back (row_kind,
    host bookkeeping, is None)."""
    out, offset = {}, 0
    for name, shape, dtype in layout:
        size = int(np.prod(shape, dtype=np.int64))
        x = buf[offset : offset + size].reshape(shape)
        offset += size
        if dtype == "bool":
            x = x != 0
        elif dtype != "int32":
            x = jax.lax.bitcast_convert_type(x, jnp.dtype(dtype))
        out[name] = x
    return StepArrays(**out, row_kind=None)
