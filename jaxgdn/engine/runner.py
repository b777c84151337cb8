"""The model runner: one jitted program per bucket for a whole engine step, with the state donated.

step = input assembly kernel -> model over the ragged rows (paged KV + GDN slots) -> logits at
logits_indices -> position-keyed sampling -> per-slot bookkeeping (last_sampled, num_accepted). The
only host round trip is the sampled tokens coming back.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import os
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.input_assembly import combine_sampled_and_draft_tokens

from ..model.config import ModelConfig
from ..model.forward import logits_from_hidden
from ..model.params import ModelParams
from ..model.policy import DEFAULT_POLICY, KernelPolicy
from .ragged_forward import StepMeta, forward_ragged, mtp_ragged
from .sampling import position_keys
from .spec_decode import verify_drafts
from .state import NULL_PAGE, EngineState, PagedKV
from .step_layout import StepArrays
from .uniform_forward import forward_uniform


def pack_step_arrays(arrays: StepArrays) -> tuple[np.ndarray, tuple]:
    """All of a step's host arrays as one int32 buffer (one host-to-device copy instead of ~20 small ones)
    and its static layout ((name, shape, dtype), ...). float32/uint32 travel bit-cast, bools as 0/1."""
    parts, layout = [], []
    for name, x in vars(arrays).items():
        if name == "row_kind":  # host-side bookkeeping only
            continue
        x = np.ascontiguousarray(x)
        if x.dtype.itemsize != 4 and x.dtype != np.bool_:
            raise TypeError(f"StepArrays.{name}: {x.dtype} does not travel in the int32 buffer")
        parts.append(x.view(np.int32).ravel() if x.dtype.itemsize == 4 else x.astype(np.int32).ravel())
        layout.append((name, x.shape, x.dtype.name))
    return np.concatenate(parts), tuple(layout)


def unpack_step_arrays(buf, layout: tuple) -> dict[str, Any]:
    """Inverse of pack_step_arrays on device: static slices of the int32 buffer, bit-cast back."""
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
    return out


def _packed_step(params: ModelParams, state: EngineState, resident, host_input, layout: tuple, stochastic: bool,
                 num_steps: int = 1, width: int = 0, rebases: bool = False, **static):
    """The jitted entry: copy the step's input into its resident buffer, unpack it, run the step, and pack
    the four results into one int32 buffer [R*(1+K) tokens | R num_sampled | R*K drafts | T ids] for a
    single device-to-host copy. Returns (state, flat, resident).

    host_input: int32[n], this step's packed arrays, a new device buffer every step. resident: int32[n + 1],
    donated, the same device buffer every step of this size. XLA's CUDA graphs hold the addresses of their
    buffers; reading the input from resident keeps every kernel but the first copy at fixed addresses, so
    the graph needs no update of its other nodes. (One spare element: a copy over the whole buffer would be
    simplified into reading host_input directly; the barrier keeps the readers on the copy.)
    stochastic (static): some row samples with temperature > 0.
    width (static): 0 for a ragged program; > 0 for a uniform one (every real row `width` tokens), whose
    token mixers view the stream as [R, width] (`uniform_forward`, the decode kernels).
    num_steps (static): > 1 runs that many model steps in one launch of a uniform program (every row a
    1-token decode row, or every row an MTP verify window of 1+K): step j sees the arrays advanced by the
    tokens each row committed in steps 0..j-1 (_advance_rows; 1 a step for decode rows, the accepted
    drafts + 1 for verify rows, known only on the device), and its input tokens are step j-1's sample and
    drafts, placed on device from last_sampled and draft_tokens as always. flat then holds num_steps
    results of the layout above, one after the other.
    rebases (static): rows may carry the rebase flag (async scheduling with MTP): the host booked their
    previous launch as if every draft were accepted, so they start where state.num_computed says."""
    resident = jax.lax.optimization_barrier(jax.lax.dynamic_update_slice(resident, host_input, (0,)))
    a = unpack_step_arrays(resident, layout)

    def one_step(state, arrays):
        state, tokens, num_sampled, drafts, ids = _device_step(params, state, arrays, stochastic=stochastic,
                                                               width=width, **static)
        flat = jnp.concatenate([tokens.ravel(), num_sampled.ravel(), drafts.ravel(), ids.ravel()]).astype(jnp.int32)
        return state, flat, num_sampled

    # Rows the host flags (rebase: their previous launch's results were not back when this one was
    # scheduled, so the host assumed every draft accepted) start where the device's count says.
    start = a["seq_lens"] - _row_lengths(a)
    shift = jnp.where(a["rebase"], state.num_computed[a["idx_mapping"]] - start, 0) if rebases else 0
    page_size = _kv_page_size(state)
    if num_steps == 1 and not rebases:
        state, flat, _ = one_step(state, a)
        return state, flat, resident
    # Unrolled (a Python loop): one CUDA graph holds all the steps. As a lax loop, XLA runs the body's
    # kernels one by one from the host on each iteration, which on the H200 cost more than the launches it
    # saves.
    flats = []
    emitted = jnp.zeros(a["idx_mapping"].shape, jnp.int32)  # [R] tokens each row sampled so far
    for j in range(num_steps):
        if j == 0 and not rebases:
            arrays = a
        else:
            live = (j == 0) | (emitted < a["token_budget"])
            arrays = _advance_rows(a, shift + emitted, live, page_size, fresh=j == 0)
        state, flat, num_sampled = one_step(state, arrays)
        emitted = emitted + num_sampled
        flats.append(flat)
    return state, jnp.concatenate(flats), resident


def _row_lengths(a: dict[str, Any]):
    """[R] tokens of each row (0 for padding rows)."""
    qsl = a["query_start_loc"]
    return qsl[1:] - qsl[:-1]


def _kv_page_size(state: EngineState) -> int:
    """Tokens per KV page, from the pool's shape (1 for a model without attention layers)."""
    pools = [layer for layer in state.layers if isinstance(layer, PagedKV)]
    return pools[0].k.shape[1] if pools else 1


def _advance_rows(a: dict[str, Any], shift, live, page_size: int, fresh: bool = False) -> dict[str, Any]:
    """A step's arrays with every row moved on by shift (int32[R], on the device) positions: in a launch
    of several steps, step j's rows by the tokens they emitted in steps 0..j-1 (a decode row commits its
    one input token and samples one; a verify row commits its input token and its accepted drafts, and
    samples as many), plus any rebase (_packed_step). Positions, sequence lengths and the KV slots the
    tokens write (from the rows' block tables) move by shift. A row that is not live (its emitted tokens
    reached its token_budget: its request is over, max_tokens or max_model_len) writes the null page and
    samples nothing; padding keeps its values; fresh: keep the host's fresh flags (step 0), else no row is
    fresh."""
    token_row = a["token_row"]
    valid = token_row >= 0
    row = jnp.clip(token_row, 0, a["idx_mapping"].shape[0] - 1)
    positions = jnp.where(valid, a["positions"] + shift[row], a["positions"])
    page = a["block_tables"][row, jnp.clip(positions // page_size, 0, a["block_tables"].shape[1] - 1)]
    page = jnp.where(live[row], page, NULL_PAGE)
    kv_slots = jnp.where(valid, page * page_size + positions % page_size, a["kv_slots"])
    seq_lens = jnp.where(a["idx_mapping"] > 0, a["seq_lens"] + shift, a["seq_lens"])
    return dict(a, positions=positions, kv_slots=kv_slots, seq_lens=seq_lens,
                fresh=a["fresh"] if fresh else jnp.zeros_like(a["fresh"]), samples=a["samples"] & live)


def _step_meta(a: dict[str, Any]) -> StepMeta:
    return StepMeta(positions=a["positions"], token_row=a["token_row"], kv_slots=a["kv_slots"],
                    query_start_loc=a["query_start_loc"], seq_lens=a["seq_lens"], idx_mapping=a["idx_mapping"],
                    block_tables=a["block_tables"], fresh=a["fresh"], verify_path=a["verify_path"],
                    block_row=a["block_row"], block_start=a["block_start"])


def _device_step(params: ModelParams, state: EngineState, a: dict[str, Any], *, cfg: ModelConfig,
                 policy: KernelPolicy, unguarded: bool, stochastic: bool = True, width: int = 0):
    K = state.draft_tokens.shape[1]
    W = 1 + K
    R = a["idx_mapping"].shape[0]
    S = state.last_sampled.shape[0]
    idx = a["idx_mapping"]
    real = idx > 0
    # Placeholder drafts of a padded prompt tail reach the device as -1 (vLLM #54137 lost them).
    draft_tokens = state.draft_tokens.at[jnp.where(a["pad_tail"], idx, S)].set(-1, mode="drop")
    num_logits = R * W
    ids, logits_indices = combine_sampled_and_draft_tokens(
        a["input_ids"], idx, state.last_sampled, a["query_start_loc"], a["seq_lens"], a["prefill_len"],
        draft_tokens, a["cu_num_logits"], num_logits=num_logits, unguarded=unguarded, impl=policy.input_impl,
    )
    meta = _step_meta(a)
    if width:
        hidden, state = forward_uniform(params, cfg, ids, meta, width, state, policy)
    else:
        hidden, state = forward_ragged(params, cfg, ids, meta, state, policy)

    # Logits rows as [R, 1+K]: row b's i-th logits row is cu[b] + i; it reads the token at flat index
    # logits_indices[cu[b] + i], and the draft it verifies sits at the next flat index.
    cu = a["cu_num_logits"]
    n_logits = cu[1:] - cu[:-1]
    n_draft = jnp.maximum(n_logits - 1, 0)
    rows = jnp.clip(cu[:-1, None] + jnp.arange(W)[None, :], 0, num_logits - 1)
    tok_at = logits_indices[rows]  # [R, W] flat token index of each logits row
    logits = logits_from_hidden(params, hidden[tok_at]).astype(jnp.float32)  # [R, W, V]
    T = ids.shape[0]
    drafts = ids[jnp.clip(tok_at[:, 1:], 0, T - 1)]  # [R, K]
    keys = position_keys(jnp.repeat(a["seeds"], W), jnp.repeat(a["request_ids"], W),
                         (a["positions"][tok_at] + 1).reshape(-1)).reshape(R, W)
    tokens, num_sampled = verify_drafts(logits, drafts, n_draft, a["temperature"], a["top_k"], a["top_p"], keys,
                                         stochastic)
    samples = a["samples"] & real
    num_sampled = jnp.where(samples, num_sampled, 0)
    last_token = jnp.take_along_axis(tokens, jnp.maximum(num_sampled - 1, 0)[:, None], 1)[:, 0]
    last_sampled = state.last_sampled.at[jnp.where(samples, idx, S)].set(last_token, mode="drop")
    # Rollback is selection: the next step reads checkpoint num_accepted - 1.
    committed = jnp.where(a["verify_path"], jnp.maximum(num_sampled, 1), 1)
    num_accepted = state.num_accepted.at[jnp.where(real, idx, S)].set(committed, mode="drop")
    # The row's committed tokens: its tokens but the rejected drafts (as the host's num_computed).
    num_rejected = jnp.where(samples, n_draft - (num_sampled - 1), 0)
    num_computed = state.num_computed.at[jnp.where(real, idx, S)].set(a["seq_lens"] - num_rejected, mode="drop")

    new_drafts = jnp.zeros((R, K), jnp.int32)
    mtp_layers = state.mtp_layers
    if K and params.mtp is not None:
        new_drafts, mtp_layers = _propose_drafts(params, cfg, a, meta, ids, hidden, tokens, num_sampled, n_draft,
                                                 samples, last_token, mtp_layers, K, policy)
        draft_tokens = draft_tokens.at[jnp.where(samples, idx, S)].set(new_drafts, mode="drop")
    state = EngineState(layers=state.layers, mtp_layers=mtp_layers, last_sampled=last_sampled,
                        draft_tokens=draft_tokens, num_accepted=num_accepted, num_computed=num_computed)
    return state, tokens, num_sampled, new_drafts, ids


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
    last_next = jnp.where(samples, last_token, a["next_token"])
    eagle_ids = jnp.where(offset == keep[row] - 1, last_next[row], next_in_row)
    mtp_meta = dataclasses.replace(  # dropped tokens write to the null page (flat slot 0)
        meta, token_row=jnp.where(kept, meta.token_row, -1), kv_slots=jnp.where(kept, meta.kv_slots, 0),
        seq_lens=meta.seq_lens - num_rejected)
    m, mtp_layers = mtp_ragged(params, cfg, hidden, eagle_ids, mtp_meta, mtp_layers, policy)
    last = jnp.clip(qsl[:-1] + keep - 1, 0, T - 1)  # [R] each row's last kept token
    h = m[last]  # [R, H]
    pos = meta.positions[last]  # [R]
    draft = jnp.argmax(logits_from_hidden(params, h), axis=-1).astype(jnp.int32)
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
        draft = jnp.argmax(logits_from_hidden(params, h), axis=-1).astype(jnp.int32)
        drafts.append(draft)
    return jnp.stack(drafts, axis=1), mtp_layers


def enable_compilation_cache(directory: str | None = None) -> str | None:
    """Turn on JAX's persistent compilation cache (process-wide) unless the user already chose one.
    Directory: the argument, else $JAXGDN_CACHE_DIR, else ~/.cache/jaxgdn/jax; an empty
    $JAXGDN_CACHE_DIR turns it off. Returns the directory in use (None when off)."""
    if jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    directory = directory if directory is not None else os.environ.get(
        "JAXGDN_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "jaxgdn", "jax"))
    if not directory:
        return None
    jax.config.update("jax_compilation_cache_dir", directory)
    # Programs that compiled in at least $JAXGDN_CACHE_MIN_COMPILE_S seconds (default 0.5; JAX's own floor
    # is 1 s). 0 also caches the dozen small helper programs of a start-up (casts, concatenates): on 2 CPU
    # cores with the shipped model that took a warm start from 4.2 to 3.6 s, on the H200 it did not pay
    # (bench/results/startup-shipped-min-compile-*_cpu_*.json, startup-min-compile-*_gpu_*.json).
    floor = os.environ.get("JAXGDN_CACHE_MIN_COMPILE_S", "0.5")
    try:
        floor_s = float(floor)
    except ValueError:
        raise ValueError(f"$JAXGDN_CACHE_MIN_COMPILE_S must be a number of seconds, got {floor!r}") from None
    jax.config.update("jax_persistent_cache_min_compile_time_secs", floor_s)
    return directory


class LaunchArgs(NamedTuple):
    """What one launch of a step program took besides the device state: the packed host input (int32[n])
    and the static arguments (see _packed_step)."""

    host_buf: np.ndarray
    layout: tuple
    stochastic: bool
    num_steps: int
    width: int


# XLA compiler options of the programs for steps of at least EngineConfig.library_gemms_min_tokens tokens:
# their matrix products go to cuBLAS(Lt) instead of XLA's Triton GEMMs. XLA folds a product's residual add
# into the cuBLASLt call (beta = 1) only for products its GEMM rewriter sees as library calls; a product
# first claimed for Triton and later handed to cuBLAS by the autotuner misses that rewrite.
LIBRARY_GEMM_OPTIONS = {"xla_gpu_enable_triton_gemm": False}


def layout_tokens(layout: tuple) -> int:
    """The token bucket T of a packed step's layout (pack_step_arrays): input_ids' length."""
    return next(shape[0] for name, shape, _ in layout if name == "input_ids")


@functools.lru_cache(maxsize=None)
def _jitted_step(cfg: ModelConfig, policy: KernelPolicy, unguarded: bool, rebases: bool = False,
                 library_gemms: bool = False):
    """One jitted step function per static setting, shared by every runner in the process. library_gemms:
    compile with LIBRARY_GEMM_OPTIONS (no effect off the GPU)."""
    return jax.jit(functools.partial(_packed_step, cfg=cfg, policy=policy, unguarded=unguarded, rebases=rebases),
                   donate_argnums=(1, 2), static_argnums=(4, 5, 6, 7),
                   compiler_options=LIBRARY_GEMM_OPTIONS if library_gemms else None)


class ModelRunner:
    """Holds params and the device state; compiles step programs (one per packed layout and static
    setting) and runs steps on them. Counts compiles, and those after `started` is set (start-up's)."""

    MAX_RESIDENT_INPUTS = 64

    def __init__(self, params: ModelParams, cfg: ModelConfig, state: EngineState | None, *,
                 policy: KernelPolicy = DEFAULT_POLICY, reproduce_pd_mtp_bug: bool = False, device=None,
                 rebases: bool = False):
        self.device = device  # None: JAX's default device
        self.params = params
        self.cfg = cfg
        self.state = state
        self.last_device_args: LaunchArgs | None = None  # the last launch's, for benchmarks to replay
        # One resident input buffer per input size (int32[n + 1]), donated to the step and returned by it,
        # so it keeps one device address: see _packed_step. Most recently used last; enforce_eager's exact
        # shapes make many sizes, so only the newest MAX_RESIDENT_INPUTS are kept.
        self._resident_inputs: dict[int, Any] = {}
        self.timings: collections.Counter = collections.Counter()  # seconds per phase of run(), summed
        # rebases: the engine books MTP verify launches before the previous one is back (async scheduling)
        static = (cfg, policy, reproduce_pd_mtp_bug, rebases)
        self.policy = policy
        self._step = _jitted_step(*static)
        self._library_step = _jitted_step(*static, library_gemms=True)
        self._programs: dict[tuple, Any] = {}  # (layout, stochastic, num_steps, width) -> compiled program
        self.num_compiles = 0
        self.compiles_after_startup = 0
        self.started = False  # the engine sets it once start-up's programs are compiled

    def program(self, layout: tuple):
        """The jitted step that runs a launch of this packed layout: the library-GEMM program for token
        buckets of at least the policy's library_gemms_min_tokens, else the default one."""
        threshold = self.policy.library_gemms_min_tokens
        return self._library_step if threshold is not None and layout_tokens(layout) >= threshold else self._step

    @property
    def num_programs(self) -> int:
        return len(self._programs)

    @property
    def program_keys(self) -> list[tuple]:
        """(layout, stochastic, num_steps, width) of every compiled program."""
        return list(self._programs)

    def lower(self, layout: tuple, stochastic: bool, num_steps: int = 1, width: int = 0, state=None):
        """The lowered step program of a packed layout and static setting (on `state`, default the runner's;
        shapes are all that matter)."""
        size = sum(int(np.prod(shape, dtype=np.int64)) for _, shape, _ in layout)
        sharding = jax.sharding.SingleDeviceSharding(self.device) if self.device is not None else None
        buf = lambda n: jax.ShapeDtypeStruct((n,), jnp.int32, sharding=sharding)  # noqa: E731
        state = self.state if state is None else state
        return self.program(layout).lower(self.params, state, buf(size + 1), buf(size), layout, stochastic, num_steps,
                                          width)

    def compiled(self, layout: tuple, stochastic: bool, num_steps: int = 1, width: int = 0):
        """The compiled program of a launch, compiling it now if it is new (counted after start-up)."""
        key = (layout, stochastic, num_steps, width)
        program = self._programs.get(key)
        if program is None:
            program = self._programs[key] = self.lower(*key).compile()
            self.num_compiles += 1
            self.compiles_after_startup += self.started
        return program

    def precompile(self, keys: list[tuple], on_compiled=None, workers: int | None = None) -> None:
        """Compile the programs of keys ((layout, stochastic, num_steps, width), ...) not compiled yet:
        lowered one at a time here, compiled on a pool of threads (XLA compiles outside the GIL).
        on_compiled(): called after each."""
        todo = list(dict.fromkeys(k for k in keys if k not in self._programs))
        if not todo:
            return
        with concurrent.futures.ThreadPoolExecutor(workers or min(len(todo), os.cpu_count() or 1)) as pool:
            futures = {pool.submit(self.lower(*key).compile): key for key in todo}
            for future in concurrent.futures.as_completed(futures):
                self._programs[futures[future]] = future.result()
                self.num_compiles += 1
                if on_compiled:
                    on_compiled()

    def set_drafts(self, slot: int, drafts: list[int]) -> None:
        """Overwrite a slot's drafts (tests: adversarial drafts must change acceptance only)."""
        self.state = dataclasses.replace(self.state, draft_tokens=self.state.draft_tokens.at[slot].set(
            jnp.asarray(drafts, jnp.int32)))

    def time_device_step(self, iters: int = 20, fresh_input: bool = True) -> float:
        """ms per model step of the step program replayed back to back on the last launch's arguments (the
        state threads through; no host preparation, no token fetch): the device side of a step (a launch of
        num_steps decode steps counts num_steps). fresh_input: the input is copied to a new device buffer
        before each call, as real steps do; False: one device copy of it serves every call. The replays
        advance the device state past what the scheduler knows, so only call it on an engine whose work is
        done (benchmarks)."""
        if self.last_device_args is None:
            raise RuntimeError("time_device_step needs one step run first")
        host_buf, layout, stochastic, num_steps, width = self.last_device_args
        fixed = None if fresh_input else jax.device_put(host_buf, self.device)

        def run(n):
            for _ in range(n):
                step_input = jax.device_put(host_buf, self.device) if fresh_input else fixed
                flat = self._launch(step_input, layout, stochastic, num_steps, width)
            jax.block_until_ready(flat)

        run(2)
        t0 = time.perf_counter()
        run(iters)
        return (time.perf_counter() - t0) / (iters * num_steps) * 1e3

    def _launch(self, step_input, layout: tuple, stochastic: bool, num_steps: int = 1, width: int = 0):
        """Launch the compiled step on a device input (int32[n]) with this size's resident buffer, which
        the step donates and returns; self.state advances. Returns the step's flat result buffer."""
        program = self.compiled(layout, stochastic, num_steps, width)
        size = step_input.shape[0]
        resident = self._resident_inputs.pop(size, None)
        while len(self._resident_inputs) >= self.MAX_RESIDENT_INPUTS:
            del self._resident_inputs[next(iter(self._resident_inputs))]  # the least recently used size
        if resident is None:
            resident = jax.device_put(np.zeros(size + 1, np.int32), self.device)
        self.state, flat, self._resident_inputs[size] = program(self.params, self.state, resident, step_input)
        return flat

    def dispatch(self, arrays: StepArrays, num_steps: int = 1, width: int = 0) -> "PendingStep":
        """Copy the step's arrays to the device and launch its program without waiting for it.
        num_steps > 1: that many steps of a uniform program (width > 0) in the one launch (see _packed_step)."""
        stochastic = bool(np.any((arrays.temperature > 0) & arrays.samples))
        t0 = time.perf_counter()
        host_buf, layout = pack_step_arrays(arrays)
        step_input = jax.device_put(host_buf, self.device)
        self.last_device_args = LaunchArgs(host_buf, layout, stochastic, num_steps, width)
        t1 = time.perf_counter()
        flat = self._launch(step_input, layout, stochastic, num_steps, width)
        # Queue the results' device-to-host copy behind the step now, so fetch finds them on the host
        # instead of starting the copy and waiting for it.
        flat.copy_to_host_async()
        self.timings["transfer"] += t1 - t0
        self.timings["dispatch"] += time.perf_counter() - t1
        return PendingStep(flat, arrays.idx_mapping.shape[0], self.state.draft_tokens.shape[1], num_steps)

    def fetch(self, pending: "PendingStep") -> list["StepResult"]:
        """Wait for a dispatched launch and copy its results to the host (one transfer): one StepResult
        per model step of the launch."""
        t0 = time.perf_counter()
        flat = np.asarray(pending.flat)
        self.timings["wait"] += time.perf_counter() - t0
        R, K = pending.num_rows, pending.num_drafts
        results = []
        for step in np.split(flat, pending.num_steps):
            tokens, num_sampled, drafts, ids = np.split(step, np.cumsum([R * (1 + K), R, R * K]))
            results.append(StepResult(tokens.reshape(R, 1 + K), num_sampled, drafts.reshape(R, K), ids))
        return results

    def run(self, arrays: StepArrays, width: int = 0) -> "StepResult":
        """Run one step and bring its results back. self.timings sums the seconds of each phase: transfer
        (host-to-device copy), dispatch (launch of the step program), wait (for its results)."""
        return self.fetch(self.dispatch(arrays, 1, width))[0]


@dataclasses.dataclass
class PendingStep:
    flat: Any  # device int32 buffer [R*(1+K) tokens | R num_sampled | R*K drafts | T ids] per model step
    num_rows: int
    num_drafts: int
    num_steps: int = 1


@dataclasses.dataclass
class StepResult:
    tokens: np.ndarray  # [R, 1+K] sampled tokens per row (first num_sampled valid)
    num_sampled: np.ndarray  # [R] 0 for rows that do not sample
    drafts: np.ndarray  # [R, K] MTP drafts for the next step
    input_ids: np.ndarray  # [T] the assembled tokens the model consumed
