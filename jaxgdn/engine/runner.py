"""The model runner: compiles the engine's step programs (one per packed layout and static setting) and runs
steps on them, with the device state donated to each and the results brought back in one transfer.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import os
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..model.config import ModelConfig
from ..model.params import ModelParams
from ..model.policy import DEFAULT_POLICY, KernelPolicy
from .device_step import Forwarded
from .logprobs import Sampler, Scores
from .state import EngineState
from .program_cache import enable_compilation_cache, program_cache  # noqa: F401 (found here too)
from .split_step import extras_size, is_split, pack_extras, rows_shapes, sampler_variant
from .step_functions import (  # noqa: F401 (the caches' functions are found here too)
    _COMPILED, _STEP_FUNCTIONS, LIBRARY_GEMM_OPTIONS, _compile_and_keep, _jitted_step, _layout_size, _release_step,
    clear_compiled_programs, layout_tokens)
from .step_layout import StepArrays, pack_step_arrays, unpack_step_arrays
from .tensor_parallel import mesh_size


class LaunchArgs(NamedTuple):
    """What one launch of a step program took besides the device state: the packed host input (int32[n])
    and the static arguments (see device_step.packed_step)."""

    host_buf: np.ndarray
    layout: tuple
    sampler: int
    num_steps: int
    width: int


class ModelRunner:
    """Holds params and the device state; compiles step programs (one per packed layout and static
    setting) and runs steps on them. Counts compiles, and those after `started` is set (start-up's)."""

    MAX_RESIDENT_INPUTS = 64

    def __init__(self, params: ModelParams, cfg: ModelConfig, state: EngineState | None, *,
                 policy: KernelPolicy = DEFAULT_POLICY, reproduce_pd_mtp_bug: bool = False, device=None,
                 rebases: bool = False, mesh=None):
        self.device = device  # None: JAX's default device
        self.mesh = mesh if mesh_size(mesh) > 1 else None  # tensor parallelism: params and state on it
        # where the step's int32 input and result buffers live (replicated over a mesh)
        if self.mesh is not None:
            self.buffer_sharding = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        elif device is not None:
            self.buffer_sharding = jax.sharding.SingleDeviceSharding(device)
        else:
            self.buffer_sharding = None
        self.params = params
        self.cfg = cfg
        self.state = state
        self.last_device_args: LaunchArgs | None = None  # the last launch's, for benchmarks to replay
        # One resident input buffer per input size (int32[n + 1]), donated to the step and returned by it,
        # so it keeps one device address: see device_step.packed_step. Most recently used last; enforce_eager's exact
        # shapes make many sizes, so only the newest MAX_RESIDENT_INPUTS are kept.
        self._resident_inputs: dict[int, Any] = {}
        self.timings: collections.Counter = collections.Counter()  # seconds per phase of run(), summed
        # rebases: the engine books MTP verify launches before the previous one is back (async scheduling)
        self._static = (cfg, policy, reproduce_pd_mtp_bug, rebases)
        self.policy = policy
        self._settings = [(*self._static, library, self.mesh) for library in (False, True)]
        (self._step, self._split), (self._library_step, self._library_split) = (
            _jitted_step(self, *settings) for settings in self._settings)
        self._programs: dict[tuple, Any] = {}  # (layout, sampler, num_steps, width) -> compiled program
        self._signature = None  # the weights' and state's shapes and device (set at the first compile)
        self.num_compiles = 0
        self.compiles_after_startup = 0
        self.started = False  # the engine sets it once start-up's programs are compiled

    def program(self, layout: tuple, split: bool = False):
        """The jitted step (split: the split launch's functions) that runs a launch of this packed layout: the
        library-GEMM program for token buckets of at least the policy's library_gemms_min_tokens, else the default
        one."""
        threshold = self.policy.library_gemms_min_tokens
        library = threshold is not None and layout_tokens(layout) >= threshold
        return (self._library_split if library else self._split) if split else (
            self._library_step if library else self._step)

    @property
    def num_programs(self) -> int:
        return len(self._programs)

    @property
    def program_keys(self) -> list[tuple]:
        """(layout, sampler, num_steps, width) of every compiled program."""
        return list(self._programs)

    def lower(self, *key, state=None):
        """The lowered program of a launch key (on `state`, default the runner's; shapes are all that matter): a
        fused step's (layout, sampler, num_steps, width), a split launch's ("forward" | "stream" | "commit",
        layout) or ("sample", rows, variant), or a fused launch's scores ("score", num_steps, rows) (split_step.py)."""
        buf = lambda n: jax.ShapeDtypeStruct((n,), jnp.int32, sharding=self.buffer_sharding)  # noqa: E731
        state = self.state if state is None else state
        if not isinstance(key[0], str):
            layout, sampler, num_steps, width = key
            size = _layout_size(layout)
            return self.program(layout).lower(self.params, state, buf(size + 1), buf(size), layout, int(sampler),
                                              num_steps, width)
        part, arg = key[:2]
        K = state.draft_tokens.shape[1]
        if part == "score":
            n, R = arg, key[2]
            hidden = jax.ShapeDtypeStruct((n, R, 1 + K, self.cfg.hidden_size), self.params.embed_tokens.dtype,
                                          sharding=self.buffer_sharding)
            tokens = jax.ShapeDtypeStruct((n, R, 1 + K), jnp.int32, sharding=self.buffer_sharding)
            return self._split.score.lower(self.params, hidden, tokens)
        if part == "sample":
            rows = rows_shapes(arg, K, self.cfg, self.params.embed_tokens.dtype, self.buffer_sharding)
            size = extras_size(arg, 1 + K, self.cfg.vocab_size, key[2])
            return self._split.sample.lower(self.params, state, rows, buf(size), key[2])
        split, size = self.program(arg, split=True), _layout_size(arg)
        if part == "forward":
            return split.forward.lower(self.params, state, buf(size + 1), buf(size), arg)
        a, f = self._carry_shapes(arg, K)
        if part == "stream":
            return split.stream.lower(self.params, a, f)
        R = a.idx_mapping.shape[0]
        ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.buffer_sharding)  # noqa: E731
        return split.commit.lower(self.params, state, a, f, ints(R, 1 + K), ints(R))

    def _carry_shapes(self, layout: tuple, K: int):
        """The (arrays, Forwarded) a split launch's forward of this layout leaves, as ShapeDtypeStructs."""
        size = _layout_size(layout)
        a = jax.eval_shape(lambda b: unpack_step_arrays(b, layout), jax.ShapeDtypeStruct((size + 1,), jnp.int32))
        T, R = layout_tokens(layout), a.idx_mapping.shape[0]
        s = lambda shape, dtype=jnp.int32: jax.ShapeDtypeStruct(shape, dtype, sharding=self.buffer_sharding)  # noqa: E731
        a = jax.tree.map(lambda x: s(x.shape, x.dtype), a)
        f = Forwarded(ids=s((T,)), hidden=s((T, self.cfg.hidden_size), self.params.embed_tokens.dtype),
                      tok_at=s((R, 1 + K)), drafts=s((R, K)), n_draft=s((R,)))
        return a, f

    def _signature_of(self, state) -> tuple:
        """What a program's arguments look like: the weights' and state's tree and shapes, the devices."""
        leaves, tree = jax.tree_util.tree_flatten((self.params, state))
        return (tree, tuple((x.shape, str(x.dtype)) for x in leaves), str(self.device), self.mesh)

    def _shared_key(self, key: tuple, state=None) -> tuple:
        """A launch key in the process-wide cache: with the static settings and the arguments' shapes (of
        `state`, default the runner's)."""
        if state is not None:
            return (self._static, *key, self._signature_of(state))
        if self._signature is None:
            self._signature = self._signature_of(self.state)
        return (self._static, *key, self._signature)

    def _build(self, key: tuple, state=None):
        """The compiled program of a launch key on `state` (default the runner's): loaded from the program
        cache on disk, else lowered and compiled here and stored there."""
        disk = program_cache()
        shared = self._shared_key(key, state)
        program = disk.load(shared) if disk else None
        return program if program is not None else _compile_and_keep(self.lower(*key, state=state), shared, disk)

    def _cached(self, key: tuple):
        """The launch's program from this runner's or the process-wide cache, or None."""
        program = self._programs.get(key)
        if program is None and (program := _COMPILED.get(self._shared_key(key))) is not None:
            self._programs[key] = program
        return program

    def _store(self, key: tuple, program) -> None:
        self._programs[key] = _COMPILED[self._shared_key(key)] = program
        self.num_compiles += 1
        self.compiles_after_startup += self.started

    def compiled(self, layout: tuple, sampler: int, num_steps: int = 1, width: int = 0):
        """The compiled program of a launch, compiling it now if it is new (counted after start-up)."""
        return self.compiled_key((layout, int(sampler), num_steps, width))

    def compiled_key(self, key: tuple):
        """The compiled program of a launch key (see lower), compiling it now if it is new."""
        program = self._cached(key)
        if program is None:
            program = self._build(key)
            self._store(key, program)
        return program

    def compile_on(self, key: tuple, state) -> Any:
        """The program of a launch key compiled for another state's shapes (memory planning), through the program
        cache."""
        return self._build(key, state)

    def precompile(self, keys: list[tuple], on_compiled=None, workers: int | None = None) -> None:
        """Compile the programs of keys ((layout, sampler, num_steps, width), ...) not compiled yet:
        lowered one at a time here, compiled on a pool of threads (XLA compiles outside the GIL).
        on_compiled(): called after each (and for each found compiled already)."""
        todo = []
        for key in dict.fromkeys(keys):
            if self._cached(key) is None:
                todo.append(key)
            elif on_compiled:
                on_compiled()
        if not todo:
            return
        disk = program_cache()
        with concurrent.futures.ThreadPoolExecutor(workers or min(len(todo), os.cpu_count() or 1)) as pool:
            loaded = dict(zip(todo, pool.map(lambda k: disk.load(self._shared_key(k)), todo))) if disk else {}
            futures = {}
            for key in todo:  # loaded ones first, then each miss lowered here and compiled on the pool
                if loaded.get(key) is None:
                    futures[pool.submit(_compile_and_keep, self.lower(*key), self._shared_key(key), disk)] = key
                else:
                    self._store(key, loaded[key])
                    if on_compiled:
                        on_compiled()
            for future in concurrent.futures.as_completed(futures):
                self._store(futures[future], future.result())
                if on_compiled:
                    on_compiled()

    def close(self) -> None:
        """Free what this runner holds: its compiled programs (those no other runner uses go with them), its
        device state and input buffers, and its reference to the weights."""
        self._programs.clear()
        for settings in self._settings:
            _release_step(self, settings)
        self._step = self._library_step = self._split = self._library_split = None
        buffers = [self.state, list(self._resident_inputs.values())]
        self._resident_inputs.clear()
        self.state = self.params = self.last_device_args = None
        for x in jax.tree_util.tree_leaves(buffers):  # owned by this runner alone (the weights may be shared)
            if isinstance(x, jax.Array) and not x.is_deleted():
                x.delete()

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
        host_buf, layout, sampler, num_steps, width = self.last_device_args
        fixed = None if fresh_input else self.put(host_buf)

        def run(n):
            for _ in range(n):
                step_input = self.put(host_buf) if fresh_input else fixed
                flat, _, _ = self._launch(step_input, layout, sampler, num_steps, width)
            jax.block_until_ready(flat)

        run(2)
        t0 = time.perf_counter()
        run(iters)
        return (time.perf_counter() - t0) / (iters * num_steps) * 1e3

    def _launch(self, step_input, layout: tuple, sampler: int, num_steps: int = 1, width: int = 0):
        """Launch the compiled step on a device input (int32[n]) with this size's resident buffer, which
        the step donates and returns; self.state advances. Returns (the step's flat result buffer, the logits
        rows' hidden states, the tokens): see packed_step."""
        program = self.compiled(layout, sampler, num_steps, width)
        resident = self._resident(step_input.shape[0])
        self.state, flat, self._resident_inputs[step_input.shape[0]], hidden, tokens = program(
            self.params, self.state, resident, step_input)
        return flat, hidden, tokens

    def _resident(self, size: int):
        """The resident input buffer of this size (int32[size + 1]), taken out until the launch returns it."""
        resident = self._resident_inputs.pop(size, None)
        while len(self._resident_inputs) >= self.MAX_RESIDENT_INPUTS:
            del self._resident_inputs[next(iter(self._resident_inputs))]  # the least recently used size
        return resident if resident is not None else self.put(np.zeros(size + 1, np.int32))

    def put(self, host_buf: np.ndarray):
        """A host int32 buffer on the step's device(s): the same on every device of a mesh, which may span
        processes (each process passes the same buffer)."""
        if self.mesh is None:
            return jax.device_put(host_buf, self.buffer_sharding)
        return jax.make_array_from_callback(host_buf.shape, self.buffer_sharding, lambda index: host_buf[index])

    def dispatch(self, arrays: StepArrays, num_steps: int = 1, width: int = 0,
                 sampler: int = Sampler.GREEDY) -> "PendingStep":
        """Copy the step's arrays to the device and launch its program without waiting for it.
        num_steps > 1: that many steps of a uniform program (width > 0) in the one launch (see device_step.packed_step).
        sampler: the scores the rows need (logprobs.launch_sampler); SAMPLE, GUIDED and PENALIZE are added from
        the arrays. A launch with STREAM, GUIDED or PENALIZE runs split (split_step.py)."""
        if np.any((arrays.temperature > 0) & arrays.samples):
            sampler |= Sampler.SAMPLE
        if arrays.bitmask is not None:
            sampler |= Sampler.GUIDED
        if arrays.penalties is not None:
            sampler |= Sampler.PENALIZE
        sampler = int(sampler)
        t0 = time.perf_counter()
        host_buf, layout = pack_step_arrays(arrays)
        step_input = self.put(host_buf)
        t1 = time.perf_counter()
        if is_split(sampler):
            flats = self._launch_split(step_input, layout, sampler, arrays)
        else:
            fused = int(sampler & Sampler.SAMPLE)
            self.last_device_args = LaunchArgs(host_buf, layout, fused, num_steps, width)
            flat, hidden, tokens = self._launch(step_input, layout, fused, num_steps, width)
            flats = [flat]
            if sampler & Sampler.LOGPROBS:
                score = self.compiled_key(("score", num_steps, arrays.idx_mapping.shape[0]))
                flats.append(score(self.params, hidden, tokens))
        # Queue the results' device-to-host copy behind the step now, so fetch finds them on the host
        # instead of starting the copy and waiting for it.
        for flat in flats:
            flat.copy_to_host_async()
        self.timings["transfer"] += t1 - t0
        self.timings["dispatch"] += time.perf_counter() - t1
        return PendingStep(flats, arrays.idx_mapping.shape[0], self.state.draft_tokens.shape[1], num_steps, sampler,
                           arrays.input_ids.shape[0])

    def _launch_split(self, step_input, layout: tuple, sampler: int, arrays: StepArrays) -> list:
        """A split launch (split_step.py): forward, sample, (prompt scores,) commit. Returns its result buffers in
        packed_step's order."""
        R, K = arrays.idx_mapping.shape[0], self.state.draft_tokens.shape[1]
        size = step_input.shape[0]
        resident = self._resident(size)
        variant = sampler_variant(sampler)
        self.state, a, f, rows, self._resident_inputs[size] = self.compiled_key(("forward", layout))(
            self.params, self.state, resident, step_input)
        extras = self.put(pack_extras(arrays, 1 + K, self.cfg.vocab_size, variant))
        tokens, num_sampled, hidden, stacked = self.compiled_key(("sample", R, variant))(
            self.params, self.state, rows, extras)
        logprobs = sampler & Sampler.LOGPROBS
        scores = [self.compiled_key(("score", 1, R))(self.params, hidden, stacked)] if logprobs else []
        stream = [self.compiled_key(("stream", layout))(self.params, a, f)] if sampler & Sampler.STREAM else []
        self.state, flat = self.compiled_key(("commit", layout))(self.params, self.state, a, f, tokens, num_sampled)
        return [flat] + scores + stream

    def fetch(self, pending: "PendingStep") -> list["StepResult"]:
        """Wait for a dispatched launch and copy its results to the host (one transfer): one StepResult
        per model step of the launch."""
        t0 = time.perf_counter()
        flats = [to_host(x) for x in pending.flats]
        self.timings["wait"] += time.perf_counter() - t0
        R, K, T, n = pending.num_rows, pending.num_speculative_tokens, pending.num_tokens, pending.num_steps
        W = 1 + K
        main, *extra = flats
        sampled = np.split(extra.pop(0), n) if pending.sampler & Sampler.LOGPROBS else [None] * n
        stream = Scores.unpack(extra.pop(0), T) if pending.sampler & Sampler.STREAM else None
        results = []
        for step, scores in zip(np.split(main, n), sampled):
            tokens, num_sampled, drafts, ids = np.split(step, np.cumsum([R * W, R, R * K]))
            results.append(StepResult(tokens.reshape(R, W), num_sampled, drafts.reshape(R, K), ids,
                                      Scores.unpack(scores, R * W) if scores is not None else None, stream))
        return results


def to_host(x) -> np.ndarray:
    """A replicated device array on the host, from this process's first copy where the array spans processes."""
    return np.asarray(x if x.is_fully_addressable else x.addressable_data(0))


@dataclasses.dataclass
class PendingStep:
    # device int32 buffers that make [R*(1+K) tokens | R num_sampled | R*K drafts | T ids | scores] per model step
    flats: list
    num_rows: int
    num_speculative_tokens: int
    num_steps: int = 1
    sampler: int = Sampler.GREEDY
    num_tokens: int = 0  # T


@dataclasses.dataclass
class StepResult:
    tokens: np.ndarray  # [R, 1+K] sampled tokens per row (first num_sampled valid)
    num_sampled: np.ndarray  # [R] 0 for rows that do not sample
    drafts: np.ndarray  # [R, K] MTP drafts for the next step
    input_ids: np.ndarray  # [T] the assembled tokens the model consumed
    sampled_scores: Scores | None = None  # of tokens [R*(1+K)] (row-major), with sampler & LOGPROBS
    stream_scores: Scores | None = None  # of each of the T tokens' successors, with STREAM
