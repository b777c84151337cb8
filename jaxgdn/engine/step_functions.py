"""The jitted step functions of each static setting and the caches of compiled programs: JAX's persistent
compilation cache, the process-wide cache of compiled programs and the program cache on disk. `runner.ModelRunner`
builds and runs programs through them.
"""

from __future__ import annotations

import collections
import functools
import weakref
from typing import Any

import jax
import numpy as np

from ..model.config import ModelConfig
from ..model.policy import KernelPolicy
from .device_step import packed_step
from .program_cache import ProgramCache
from .split_step import make_split_programs
from .tensor_parallel import TP, local_config, mesh_size, sharded_step


def _compile_and_keep(lowered, shared_key: tuple, disk: ProgramCache | None):
    """lowered.compile(), stored under shared_key in the program cache disk (None: off)."""
    program = lowered.compile()
    if disk:
        disk.store(shared_key, program)
    return program


# XLA compiler options of the programs for steps of at least EngineConfig.library_gemms_min_tokens tokens:
# their matrix products go to cuBLAS(Lt) instead of XLA's Triton GEMMs. XLA folds a product's residual add
# into the cuBLASLt call (beta = 1) only for products its GEMM rewriter sees as library calls; a product
# first claimed for Triton and later handed to cuBLAS by the autotuner misses that rewrite.
LIBRARY_GEMM_OPTIONS = {"xla_gpu_enable_triton_gemm": False}


def _layout_size(layout: tuple) -> int:
    return sum(int(np.prod(shape, dtype=np.int64)) for _, shape, _ in layout)


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
    """One jitted step function per static setting, and the split launch's functions (split_step.py).
    library_gemms: compile the step and forward with LIBRARY_GEMM_OPTIONS (no effect off the GPU). mesh: a
    tensor-parallel mesh of more than one device runs them per shard (`tensor_parallel.sharded_step`); None or
    one device, the plain step."""
    tp = mesh_size(mesh)
    if tp > 1:
        cfg, policy = local_config(cfg, tp), policy.replace(tp_axis=TP)
    step = functools.partial(packed_step, cfg=cfg, policy=policy, reproduce_pd_mtp_bug=reproduce_pd_mtp_bug,
                             rebases=rebases)
    options = LIBRARY_GEMM_OPTIONS if library_gemms else None
    fused = jax.jit(sharded_step(step, mesh) if tp > 1 else step, donate_argnums=(1, 2), static_argnums=(4, 5, 6, 7),
                    compiler_options=options)
    return fused, make_split_programs(cfg, policy, reproduce_pd_mtp_bug, rebases, options, mesh if tp > 1 else None)
