"""State copies: every write into an engine's pools outside a step, as small programs compiled at start-up with the
pools donated, run between launches in launch order (the device runs them in that order, which is what makes them
exact with async scheduling too).

The family (each op a record; `StateCopies.run` executes a list of them, consecutive ops of one kind batched):
  - PageCopy: a KV page onto another in every attention pool (a prefix-cache hit inside a cached partial page);
  - SnapshotRestore / SnapshotSave: a prefix-cache snapshot into a slot's checkpoint 0 / a slot's committed state
    into a snapshot (snapshot pools: `state.init_snapshots`, kept here, never an argument of a step program);
  - HandoffImport: a PD handoff's arrays (`Handoff`, staged on the device at a page bucket) into fresh pages and a
    fresh slot;
  - HandoffTransfer: a PD prefill worker's parked request straight from its pools into fresh pages and a slot of
    this engine's (both engines on the same devices: one program reads the one state and writes the other).
Export (`StateCopies.export`) gathers a request's pages and committed slot state into a handoff's arrays.

Each program has fixed shapes, so a handoff's page count is padded to a bucket (`page_buckets`) with the null page,
and a batch of transfers to TRANSFER_HANDOFFS slots with the null slot: a copy costs its own bytes and a small
padding, never a pass over a pool.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import os
import time
import weakref
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..model.config import ModelConfig
from .copy_programs import (attention_pools, copy_pages, export_arrays, import_arrays, restore_snapshots,
                            save_snapshots, transfer)
from .pd import Handoff
from .state import EngineState

COPIES = 8  # page copies, snapshot saves or restores per program call; more are several calls
TRANSFER_HANDOFFS = 8  # in-process handoffs per transfer program call


# ------------------------------------------------------------------------------------------------ ops
@dataclasses.dataclass(frozen=True)
class PageCopy:
    src: int
    dst: int


@dataclasses.dataclass(frozen=True)
class SnapshotRestore:
    snapshot: int
    slot: int
    length: int  # the slot resumes after this many tokens


@dataclasses.dataclass(frozen=True)
class SnapshotSave:
    slot: int
    snapshot: int


@dataclasses.dataclass(frozen=True, eq=False)
class HandoffImport:
    arrays: tuple  # the handoff's six arrays (Handoff.ARRAYS), host or device (`StateCopies.stage`)
    slot: int
    pages: tuple[int, ...]  # this engine's pages for the handoff's num_pages
    num_computed: int


@dataclasses.dataclass(frozen=True, eq=False)
class HandoffTransfer:
    source: Any  # the prefill worker's runner (its .state is read when the op runs)
    src_slot: int
    src_pages: tuple[int, ...]
    slot: int
    pages: tuple[int, ...]
    num_computed: int


def page_buckets(limit: int) -> tuple[int, ...]:
    """The page counts programs are compiled for: powers of 4 below limit, then limit."""
    out, n = [], 1
    while n < limit:
        out.append(n)
        n *= 4
    return (*out, limit)


def handoff_buckets(max_pages_per_seq: int) -> tuple[int, ...]:
    """Page buckets of one handoff's import and export programs."""
    return page_buckets(max_pages_per_seq)


def transfer_buckets(max_pages_per_seq: int) -> tuple[int, ...]:
    """Page buckets of the transfer programs (up to TRANSFER_HANDOFFS handoffs a call, as many as fit the largest)."""
    return page_buckets(2 * max_pages_per_seq)


def bucket_for(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} pages exceed the largest copy program's {buckets[-1]}")


# ------------------------------------------------------------------------------------------------ the programs' owner
# Compiled copy programs shared by every engine of the process with the same arguments' shapes and placement (a
# test suite builds many engines of one configuration). Weak: a program goes with the last engine that holds it.
_COMPILED: "weakref.WeakValueDictionary[tuple, Any]" = weakref.WeakValueDictionary()


def _abstract(tree) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)


def _signature(tree) -> tuple:
    leaves, structure = jax.tree.flatten(tree)
    return structure, tuple((x.shape, str(x.dtype), getattr(x, "sharding", None)) for x in leaves)


def _order(order) -> tuple | None:
    return None if order is None else tuple(int(i) for i in order)


class StateCopies:
    """An engine's state copy programs (module docstring) and the prefix cache's snapshot pools.

    cfg: the model config; max_pages_per_seq: the engine's (the page buckets); sharding: where the copies' int32
    arguments and staged handoff arrays live (the runner's buffer_sharding; None: JAX's default device);
    snapshots: the snapshot pools (`state.init_snapshots`, placed as the engine's state; () without prefix caching);
    conv_order: the pools' conv channel order under tensor parallelism (`tensor_parallel.conv_channel_order`; None on
    one device), undone on export and applied on import."""

    def __init__(self, cfg: ModelConfig, max_pages_per_seq: int, sharding=None, snapshots: tuple = (),
                 conv_order=None):
        self.cfg = cfg
        self.sharding = sharding
        # where staged handoff arrays must be (sharding None: JAX's default device)
        self._target = sharding if sharding is not None else jax.sharding.SingleDeviceSharding(jax.devices()[0])
        self.snapshots = snapshots
        self.conv_order = _order(conv_order)
        self.handoff_buckets = handoff_buckets(max_pages_per_seq)
        self.transfer_buckets = transfer_buckets(max_pages_per_seq)
        # jitted per engine, not per process: a jitted function's caches keep what it compiled
        bind = functools.partial
        order = self.conv_order
        self._jit = {
            "save": jax.jit(bind(save_snapshots, cfg), donate_argnums=0),
            "restore": jax.jit(bind(restore_snapshots, cfg), donate_argnums=0),
            "copy_pages": jax.jit(copy_pages, donate_argnums=0),
            "import": jax.jit(lambda state, arrays, pages, slot, length: import_arrays(
                cfg, state, arrays, pages, slot, length, order), donate_argnums=0),
            "export": jax.jit(lambda state, pages, slot: export_arrays(cfg, state, pages, slot, order)),
            "transfer": jax.jit(bind(transfer, cfg), donate_argnums=0),
        }
        self._programs: dict[tuple, Any] = {}  # this engine's compiled programs, by (name, bucket, source signature)
        self.num_compiles = 0
        self.compiles_after_startup = 0
        self.started = False  # set once start-up's programs are compiled
        # host seconds per handoff of its copy's dispatch (kind "import", "transfer" or "export"), the newest kept
        self.handoff_seconds: collections.deque[tuple[str, float]] = collections.deque(maxlen=100_000)

    # ------------------------------------------------------------------------------------ compiling
    def _ints(self, n: int):
        return jax.ShapeDtypeStruct((n,), jnp.int32, sharding=self.sharding)

    def payload_shapes(self, state: EngineState, pages: int) -> tuple:
        """Abstract arrays of a handoff (Handoff.ARRAYS) of `pages` pages, as staged on this engine."""
        def like(shape, dtype):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=self.sharding)
        cfg = self.cfg
        attn = attention_pools(cfg, state)
        page = (pages, *attn[0].k.shape[1:]) if attn else ()
        kv = like((len(attn), *page), attn[0].k.dtype) if attn else like((0,), jnp.float32)
        mtp = like((len(state.mtp_layers), *page), attn[0].k.dtype) if state.mtp_layers else like((0,), kv.dtype)
        gdn = [state.layers[i] for i in cfg.gdn_layer_ids]
        conv = like((len(gdn), cfg.linear_conv_kernel_dim - 1, cfg.conv_dim), gdn[0].conv.dtype if gdn else jnp.float32)
        ssm = like((len(gdn), cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim), jnp.float32)
        return kv, kv, mtp, mtp, conv, ssm

    def _lower(self, name: str, bucket: int, state, source=None):
        ints, jit = self._ints, self._jit[name]
        if name == "save":
            return jit.lower(self.snapshots, state, ints(COPIES), ints(COPIES))
        if name == "restore":
            return jit.lower(state, self.snapshots, ints(COPIES), ints(COPIES), ints(COPIES))
        if name == "copy_pages":
            return jit.lower(state, ints(COPIES), ints(COPIES))
        if name == "import":
            return jit.lower(state, self.payload_shapes(state, bucket), ints(bucket), ints(1), ints(1))
        if name == "export":
            return jit.lower(state, ints(bucket), ints(1))
        h = TRANSFER_HANDOFFS
        return jit.lower(state, source, ints(bucket), ints(bucket), ints(h), ints(h), ints(h))

    def _key(self, name: str, bucket: int, state, source=None) -> tuple:
        shared = self.snapshots if name in ("save", "restore") else ()
        return (name, bucket, self.cfg, self.conv_order, self.sharding, _signature((state, shared)),
                None if source is None else _signature(source))

    def _program(self, name: str, bucket: int, state, source=None):
        """The compiled program (this engine's, another engine's of the same shapes, or compiled now)."""
        local = (name, bucket, None if source is None else _signature(source))
        program = self._programs.get(local)
        if program is None:
            key = self._key(name, bucket, state, source)
            program = _COMPILED.get(key)
            if program is None:
                program = self._lower(name, bucket, _abstract(state), _abstract(source)).compile()
                _COMPILED[key] = program
                self.num_compiles += 1
                self.compiles_after_startup += self.started
            self._programs[local] = program
        return program

    def program_names(self, snapshots: bool, imports: bool, exports: bool, transfers: bool) -> list[tuple[str, int]]:
        """(name, page bucket) of the programs of these roles."""
        names = [(n, COPIES) for n in ("save", "restore", "copy_pages")] if snapshots else []
        names += [("import", b) for b in self.handoff_buckets] if imports else []
        names += [("export", b) for b in self.handoff_buckets] if exports else []
        return names + ([("transfer", b) for b in self.transfer_buckets] if transfers else [])

    def precompile(self, state: EngineState, names: list[tuple[str, int]], source: EngineState | None = None,
                   on_compiled: Callable[[], None] | None = None) -> int:
        """Compile the named programs (program_names; transfers from source, a prefill worker's state on the same
        devices); XLA compiles on a pool of threads. Returns how many were new."""
        todo = [(name, b) for name, b in names if name != "transfer" or source is not None]
        before = self.num_compiles
        state_abs, source_abs = _abstract(state), _abstract(source)
        missing = []
        for name, bucket in todo:
            src = source_abs if name == "transfer" else None
            key = self._key(name, bucket, state, src)
            if key in _COMPILED:
                self._programs[(name, bucket, None if src is None else _signature(src))] = _COMPILED[key]
            else:
                missing.append((name, bucket, src, key))
        if missing:
            with concurrent.futures.ThreadPoolExecutor(min(len(missing), os.cpu_count() or 1)) as pool:
                lowered = [(m, self._lower(m[0], m[1], state_abs, m[2])) for m in missing]
                futures = {pool.submit(low.compile): m for m, low in lowered}
                for future in concurrent.futures.as_completed(futures):
                    name, bucket, src, key = futures[future]
                    _COMPILED[key] = self._programs[(name, bucket, None if src is None else _signature(src))] = \
                        future.result()
                    self.num_compiles += 1
                    if on_compiled:
                        on_compiled()
        return self.num_compiles - before

    def close(self) -> None:
        for x in jax.tree_util.tree_leaves(self.snapshots):
            if isinstance(x, jax.Array) and not x.is_deleted():
                x.delete()
        self.snapshots, self._programs, self._jit = (), {}, {}

    # ------------------------------------------------------------------------------------ running
    def _put(self, columns) -> list:
        columns = [np.asarray(c, np.int32) for c in columns]
        return [jax.device_put(c, self.sharding) for c in columns] if self.sharding is not None else columns

    def run(self, state: EngineState, ops: list) -> EngineState:
        """Execute ops in order (consecutive ops of one kind batched into program calls); returns the state."""
        i = 0
        while i < len(ops):
            j = i
            while j < len(ops) and type(ops[j]) is type(ops[i]):
                j += 1
            state = self._run_kind(state, ops[i:j])
            i = j
        return state

    def _run_kind(self, state: EngineState, ops: list) -> EngineState:
        kind = type(ops[0])
        if kind is HandoffImport:
            for op in ops:  # each staged just before its import: one handoff's bytes on the device at a time
                t0 = time.perf_counter()
                bucket = bucket_for(len(op.pages), self.handoff_buckets)
                pages = np.zeros(bucket, np.int32)
                pages[: len(op.pages)] = op.pages
                state = self._program("import", bucket, state)(state, self.stage(op.arrays, len(op.pages)), *self._put(
                    [pages, [op.slot], [op.num_computed]]))
                self.handoff_seconds.append(("import", time.perf_counter() - t0))
            return state
        if kind is HandoffTransfer:
            t0 = time.perf_counter()
            state = self._transfer(state, ops)
            each = (time.perf_counter() - t0) / len(ops)
            self.handoff_seconds.extend(("transfer", each) for _ in ops)
            return state
        for chunk in (ops[k : k + COPIES] for k in range(0, len(ops), COPIES)):
            table = np.zeros((COPIES, 3), np.int32)  # padding copies read and write the null slot / page / snapshot
            if kind is PageCopy:
                table[: len(chunk), :2] = [(op.src, op.dst) for op in chunk]
                state = self._program("copy_pages", COPIES, state)(state, *self._put([table[:, 0], table[:, 1]]))
            elif kind is SnapshotRestore:
                table[: len(chunk)] = [(op.snapshot, op.slot, op.length) for op in chunk]
                state = self._program("restore", COPIES, state)(state, self.snapshots, *self._put(table.T))
            elif kind is SnapshotSave:
                table[: len(chunk), :2] = [(op.slot, op.snapshot) for op in chunk]
                self.snapshots = self._program("save", COPIES, state)(self.snapshots, state,
                                                                      *self._put([table[:, 0], table[:, 1]]))
            else:
                raise TypeError(f"not a state copy op: {kind.__name__}")
        return state

    def _transfer(self, state: EngineState, ops: list) -> EngineState:
        """In-process handoffs, up to TRANSFER_HANDOFFS and the largest page bucket per program call."""
        top = self.transfer_buckets[-1]
        chunks: list[list] = []
        for op in ops:
            if (not chunks or len(chunks[-1]) == TRANSFER_HANDOFFS or chunks[-1][0].source is not op.source
                    or sum(len(o.pages) for o in chunks[-1]) + len(op.pages) > top):
                chunks.append([])
            chunks[-1].append(op)
        for chunk in chunks:
            n = sum(len(o.pages) for o in chunk)
            bucket = bucket_for(n, self.transfer_buckets)
            src, dst = np.zeros(bucket, np.int32), np.zeros(bucket, np.int32)
            src[:n] = [p for o in chunk for p in o.src_pages]
            dst[:n] = [p for o in chunk for p in o.pages]
            slots = np.zeros((3, TRANSFER_HANDOFFS), np.int32)
            slots[:, : len(chunk)] = np.array([(o.src_slot, o.slot, o.num_computed) for o in chunk]).T
            source = chunk[0].source.state
            state = self._program("transfer", bucket, state, source)(state, source, *self._put([src, dst, *slots]))
        return state

    def export(self, state: EngineState, pages: list[int], slot: int) -> tuple:
        """A request's handoff arrays (Handoff.ARRAYS; pages padded to a bucket with the null page)."""
        t0 = time.perf_counter()
        bucket = bucket_for(len(pages), self.handoff_buckets)
        padded = np.zeros(bucket, np.int32)
        padded[: len(pages)] = pages
        arrays = tuple(self._program("export", bucket, state)(state, *self._put([padded, [slot]])))
        self.handoff_seconds.append(("export", time.perf_counter() - t0))
        return arrays

    def stage(self, arrays: tuple, num_pages: int) -> tuple:
        """A handoff's arrays on this engine's device(s), pages padded to a bucket: device arrays already so placed
        pass as they are; others go through the host (a copy of the handoff's bytes, no pass over a pool)."""
        bucket = bucket_for(num_pages, self.handoff_buckets)
        placed = all(isinstance(a, jax.Array) and a.sharding.is_equivalent_to(self._target, a.ndim) for a in arrays)
        fits = arrays[0].ndim < 2 or arrays[0].shape[1] == bucket
        if placed and fits:
            return tuple(arrays)
        single = lambda s: len(s.device_set) == 1  # noqa: E731
        if fits and single(self._target) and all(isinstance(a, jax.Array) and single(a.sharding) for a in arrays):
            return tuple(jax.device_put(a, self._target) for a in arrays)  # device to device
        host = []
        for name, a in zip(Handoff.ARRAYS, jax.device_get(list(arrays))):
            a = np.asarray(a)
            if name.startswith(("kv", "mtp")) and a.ndim > 1 and a.shape[1] != bucket:
                padded = np.zeros((a.shape[0], bucket, *a.shape[2:]), a.dtype)
                padded[:, : min(num_pages, a.shape[1])] = a[:, :num_pages]
                a = padded
            host.append(a)
        return tuple(jax.device_put(a, self.sharding) for a in host)
