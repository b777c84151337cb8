"""The model runner: compiles the engine's step programs (one per packed layout and static setting) and runs
steps on them, with the device state donated to each and the results brought back in one transfer.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import os
import time
import weakref
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..model.config import ModelConfig
from ..model.params import ModelParams
from ..model.policy import DEFAULT_POLICY, KernelPolicy
from .device_step import packed_step
from .logprobs import Sampler, Scores, packed_size
from .program_cache import ProgramCache
from .state import EngineState
from .step_layout import StepArrays, pack_step_arrays
from .tensor_parallel import TP, local_config, mesh_size, sharded_step


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
    # Programs that compiled in at least $JAXGDN_CACHE_MIN_COMPILE_S seconds (default 0, below JAX's own 1 s
    # floor: a GPU compiles even a small program, such as one of the preset weights' draws, in a fraction of a
    # second, and a start-up runs dozens of them).
    floor = os.environ.get("JAXGDN_CACHE_MIN_COMPILE_S", "0")
    try:
        floor_s = float(floor)
    except ValueError:
        raise ValueError(f"$JAXGDN_CACHE_MIN_COMPILE_S must be a number of seconds, got {floor!r}") from None
    jax.config.update("jax_persistent_cache_min_compile_time_secs", floor_s)
    return directory


def program_cache() -> ProgramCache | None:
    """The cache of compiled step programs beside JAX's persistent compilation cache on a GPU, or None when that
    is off or off a GPU (a loaded XLA:CPU program once failed to find one of its own kernels; there JAX's cache
    serves alone)."""
    directory = jax.config.jax_compilation_cache_dir
    if not directory or jax.devices()[0].platform != "gpu":
        return None
    return ProgramCache(os.path.join(directory, "jaxgdn-programs"), os.environ.get("XLA_FLAGS", ""))


def _compile_and_keep(lowered, shared_key: tuple, disk: ProgramCache | None):
    """lowered.compile(), stored under shared_key in the program cache disk (None: off)."""
    program = lowered.compile()
    if disk:
        disk.store(shared_key, program)
    return program


class LaunchArgs(NamedTuple):
    """What one launch of a step program took besides the device state: the packed host input (int32[n])
    and the static arguments (see device_step.packed_step)."""

    host_buf: np.ndarray
    layout: tuple
    sampler: int
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


# Compiled step programs, shared by every runner in the process with the same static settings and argument
# shapes (engines of one configuration, a PD worker pair on one device): (settings, launch key, signature).
# Weak: a program lives while a runner holds it, and goes with the last engine that used it.
_COMPILED: "weakref.WeakValueDictionary[tuple, Any]" = weakref.WeakValueDictionary()


def clear_compiled_programs() -> None:
    """Drop every compiled step and state copy program of the process (tests that build many engines)."""
    from . import state_copies

    _COMPILED.clear()
    _STEP_FUNCTIONS.clear()
    state_copies._COMPILED.clear()


# Jitted step functions by static settings, most recently used last. A jitted function keeps the programs
# compiled through it (JAX caches its traces, lowerings and executables), so the process keeps those of
# at most MAX_STEP_FUNCTIONS settings; a runner that closes drops its own unless another live runner uses them.
_STEP_FUNCTIONS: "collections.OrderedDict[tuple, Any]" = collections.OrderedDict()
_STEP_USERS: "collections.defaultdict[tuple, weakref.WeakSet]" = collections.defaultdict(weakref.WeakSet)
MAX_STEP_FUNCTIONS = 16


def _jitted_step(user, *settings):
    """The jitted step of these settings (see _make_step) for runner `user`, shared by every runner in the
    process."""
    step = _STEP_FUNCTIONS.pop(settings, None) or _make_step(*settings)
    _STEP_FUNCTIONS[settings] = step
    _STEP_USERS[settings].add(user)
    while len(_STEP_FUNCTIONS) > MAX_STEP_FUNCTIONS:
        _STEP_FUNCTIONS.popitem(last=False)
    return step


def _release_step(user, settings) -> None:
    users = _STEP_USERS[settings]
    users.discard(user)
    if not users:
        _STEP_FUNCTIONS.pop(settings, None)
        del _STEP_USERS[settings]


def _make_step(cfg: ModelConfig, policy: KernelPolicy, reproduce_pd_mtp_bug: bool, rebases: bool = False,
               library_gemms: bool = False, mesh=None):
    """One jitted step function per static setting. library_gemms: compile with LIBRARY_GEMM_OPTIONS (no
    effect off the GPU). mesh: a tensor-parallel mesh of more than one device runs the step per shard
    (`tensor_parallel.sharded_step`); None or one device, the plain step."""
    tp = mesh_size(mesh)
    if tp > 1:
        cfg, policy = local_config(cfg, tp), policy.replace(tp_axis=TP)
    step = functools.partial(packed_step, cfg=cfg, policy=policy, reproduce_pd_mtp_bug=reproduce_pd_mtp_bug,
                             rebases=rebases)
    return jax.jit(sharded_step(step, mesh) if tp > 1 else step,
                   donate_argnums=(1, 2), static_argnums=(4, 5, 6, 7),
                   compiler_options=LIBRARY_GEMM_OPTIONS if library_gemms else None)


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
        self._step, self._library_step = (_jitted_step(self, *settings) for settings in self._settings)
        self._programs: dict[tuple, Any] = {}  # (layout, sampler, num_steps, width) -> compiled program
        self._signature = None  # the weights' and state's shapes and device (set at the first compile)
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
        """(layout, sampler, num_steps, width) of every compiled program."""
        return list(self._programs)

    def lower(self, layout: tuple, sampler: int, num_steps: int = 1, width: int = 0, state=None):
        """The lowered step program of a packed layout and static setting (on `state`, default the runner's;
        shapes are all that matter)."""
        size = sum(int(np.prod(shape, dtype=np.int64)) for _, shape, _ in layout)
        buf = lambda n: jax.ShapeDtypeStruct((n,), jnp.int32, sharding=self.buffer_sharding)  # noqa: E731
        state = self.state if state is None else state
        return self.program(layout).lower(self.params, state, buf(size + 1), buf(size), layout, int(sampler),
                                          num_steps, width)

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
        key = (layout, int(sampler), num_steps, width)
        program = self._cached(key)
        if program is None:
            program = self._build(key)
            self._store(key, program)
        return program

    def compile_on(self, layout: tuple, sampler: int, state) -> Any:
        """A ragged program compiled for another state's shapes (memory planning), through the program cache."""
        return self._build((layout, int(sampler), 1, 0), state)

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
        self._step = self._library_step = None
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
                flat = self._launch(step_input, layout, sampler, num_steps, width)
            jax.block_until_ready(flat)

        run(2)
        t0 = time.perf_counter()
        run(iters)
        return (time.perf_counter() - t0) / (iters * num_steps) * 1e3

    def _launch(self, step_input, layout: tuple, sampler: int, num_steps: int = 1, width: int = 0):
        """Launch the compiled step on a device input (int32[n]) with this size's resident buffer, which
        the step donates and returns; self.state advances. Returns the step's flat result buffer."""
        program = self.compiled(layout, sampler, num_steps, width)
        size = step_input.shape[0]
        resident = self._resident_inputs.pop(size, None)
        while len(self._resident_inputs) >= self.MAX_RESIDENT_INPUTS:
            del self._resident_inputs[next(iter(self._resident_inputs))]  # the least recently used size
        if resident is None:
            resident = self.put(np.zeros(size + 1, np.int32))
        self.state, flat, self._resident_inputs[size] = program(self.params, self.state, resident, step_input)
        return flat

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
        sampler: the program variant the rows' logprobs need; SAMPLE is added where a row has temperature > 0."""
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
        self.last_device_args = LaunchArgs(host_buf, layout, sampler, num_steps, width)
        t1 = time.perf_counter()
        flat = self._launch(step_input, layout, sampler, num_steps, width)
        # Queue the results' device-to-host copy behind the step now, so fetch finds them on the host
        # instead of starting the copy and waiting for it.
        flat.copy_to_host_async()
        self.timings["transfer"] += t1 - t0
        self.timings["dispatch"] += time.perf_counter() - t1
        return PendingStep(flat, arrays.idx_mapping.shape[0], self.state.draft_tokens.shape[1], num_steps, sampler,
                           arrays.input_ids.shape[0])

    def fetch(self, pending: "PendingStep") -> list["StepResult"]:
        """Wait for a dispatched launch and copy its results to the host (one transfer): one StepResult
        per model step of the launch."""
        t0 = time.perf_counter()
        flat = to_host(pending.flat)
        self.timings["wait"] += time.perf_counter() - t0
        R, K, T = pending.num_rows, pending.num_drafts, pending.num_tokens
        W = 1 + K
        results = []
        for step in np.split(flat, pending.num_steps):
            tokens, num_sampled, drafts, ids, sampled, stream = np.split(
                step, np.cumsum([R * W, R, R * K, T, packed_size(R * W) if pending.sampler & Sampler.LOGPROBS else 0]))
            results.append(StepResult(
                tokens.reshape(R, W), num_sampled, drafts.reshape(R, K), ids,
                Scores.unpack(sampled, R * W) if sampled.size else None,
                Scores.unpack(stream, T) if stream.size else None))
        return results

    def run(self, arrays: StepArrays, width: int = 0) -> "StepResult":
        """Run one step and bring its results back. self.timings sums the seconds of each phase: transfer
        (host-to-device copy), dispatch (launch of the step program), wait (for its results)."""
        return self.fetch(self.dispatch(arrays, 1, width))[0]


def to_host(x) -> np.ndarray:
    """A replicated device array on the host, from this process's first copy where the array spans processes."""
    return np.asarray(x if x.is_fully_addressable else x.addressable_data(0))


@dataclasses.dataclass
class PendingStep:
    flat: Any  # device int32 buffer [R*(1+K) tokens | R num_sampled | R*K drafts | T ids | scores] per model step
    num_rows: int
    num_drafts: int
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
    stream_scores: Scores | None = None  # of each of the T tokens' successors, with PROMPT_LOGPROBS
