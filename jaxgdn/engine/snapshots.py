"""Prefix-cache snapshots on the device: copies of the GDN layers' state between request slots and the snapshot
pools (`state.init_snapshots`; prefix_cache.py decides which). The pools are kept beside the EngineState, so
step programs never carry them.

A save copies a slot's committed state (conv window and recurrent state at checkpoint num_accepted-1) into a
snapshot after the step that reached the prefix's end; a restore copies a snapshot into a slot's checkpoint 0
before the request's first step, and sets num_accepted to 1 and num_computed to the prefix length. Both are
small programs of COPIES copies each (padding copies read and write the null slot and the null snapshot),
dispatched between steps: the device runs them in launch order, which is what makes them exact with async
scheduling too.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ..model.config import ModelConfig
from .state import EngineState, GDNSlots, PagedKV

COPIES = 8  # copies per program call; more are several calls


def _gdn_layers(cfg: ModelConfig, state: EngineState):
    return [state.layers[i] for i in cfg.gdn_layer_ids]


def save(cfg: ModelConfig, snapshots: tuple, state: EngineState, slots, snapshot_ids) -> tuple:
    """Copy each slot's committed GDN state [COPIES] into snapshots [COPIES]. Returns the snapshot pools."""
    kc1 = cfg.linear_conv_kernel_dim - 1
    offset = state.num_accepted[slots] - 1  # [M] the committed checkpoint
    new = []
    for pool, snap in zip(_gdn_layers(cfg, state), snapshots):
        window = jax.vmap(lambda c, o: jax.lax.dynamic_slice_in_dim(c, o, kc1, axis=0))(pool.conv[slots], offset)
        ssm = pool.ssm[slots, offset]
        new.append(dataclasses.replace(snap, conv=snap.conv.at[snapshot_ids].set(window),
                                       ssm=snap.ssm.at[snapshot_ids].set(ssm)))
    return tuple(new)


def restore(cfg: ModelConfig, state: EngineState, snapshots: tuple, snapshot_ids, slots, lengths) -> EngineState:
    """Copy snapshots [COPIES] into each slot's checkpoint 0; the slot resumes after lengths [COPIES] tokens."""
    kc1 = cfg.linear_conv_kernel_dim - 1
    layers = list(state.layers)
    for i, snap in zip(cfg.gdn_layer_ids, snapshots):
        pool = layers[i]
        layers[i] = GDNSlots(conv=pool.conv.at[slots, :kc1].set(snap.conv[snapshot_ids]),
                             ssm=pool.ssm.at[slots, 0].set(snap.ssm[snapshot_ids]))
    return dataclasses.replace(state, layers=tuple(layers), num_accepted=state.num_accepted.at[slots].set(1),
                               num_computed=state.num_computed.at[slots].set(lengths))


def copy_pages(state: EngineState, src, dst) -> EngineState:
    """Copy KV pages src [COPIES] onto pages dst [COPIES] in every attention pool (the trunk's and the MTP layer's):
    a request resuming inside a cached partial page gets a page of its own to write on."""
    copy = lambda kv: kv.replace(k=kv.k.at[dst].set(kv.k[src]), v=kv.v.at[dst].set(kv.v[src]))  # noqa: E731
    layers = tuple(copy(x) if isinstance(x, PagedKV) else x for x in state.layers)
    return dataclasses.replace(state, layers=layers, mtp_layers=tuple(copy(x) for x in state.mtp_layers))


class SnapshotCopier:
    """The snapshot pools of one engine and its save and restore programs, compiled once (`compile`, at start-up)."""

    def __init__(self, cfg: ModelConfig, snapshots: tuple, sharding=None):
        """snapshots: the pools (`state.init_snapshots`, placed as the engine's state); sharding: where the copies'
        int32 arguments live (the runner's buffer_sharding; None: default)."""
        self.cfg = cfg
        self.snapshots = snapshots
        self.sharding = sharding
        self._save = jax.jit(lambda p, s, a, b: save(cfg, p, s, a, b), donate_argnums=0)
        self._restore = jax.jit(lambda s, p, a, b, c: restore(cfg, s, p, a, b, c), donate_argnums=0)
        self._copy_pages = jax.jit(copy_pages, donate_argnums=0)
        self._compiled: dict[str, object] = {}

    def compile(self, state: EngineState) -> int:
        """Compile both programs for the state's shapes; returns how many were compiled."""
        ints = jax.ShapeDtypeStruct((COPIES,), jnp.int32, sharding=self.sharding)
        self._compiled["save"] = self._save.lower(self.snapshots, state, ints, ints).compile()
        self._compiled["restore"] = self._restore.lower(state, self.snapshots, ints, ints, ints).compile()
        self._compiled["copy_pages"] = self._copy_pages.lower(state, ints, ints).compile()
        return 3

    def _program(self, name: str, state: EngineState):
        if name not in self._compiled:
            self.compile(state)
        return self._compiled[name]

    def save(self, state: EngineState, copies: list[tuple[int, int]]) -> None:
        """copies: (slot, snapshot id) pairs."""
        for chunk in _chunks(copies):
            self.snapshots = self._program("save", state)(self.snapshots, state, *self._put(_columns(chunk, 2)))

    def restore(self, state: EngineState, copies: list[tuple[int, int, int]]) -> EngineState:
        """copies: (snapshot id, slot, prefix length) triples. Returns the state."""
        for chunk in _chunks(copies):
            state = self._program("restore", state)(state, self.snapshots, *self._put(_columns(chunk, 3)))
        return state

    def copy_pages(self, state: EngineState, copies: list[tuple[int, int]]) -> EngineState:
        """copies: (source page, destination page) pairs. Returns the state."""
        for chunk in _chunks(copies):
            state = self._program("copy_pages", state)(state, *self._put(_columns(chunk, 2)))
        return state

    def close(self) -> None:
        for x in jax.tree_util.tree_leaves(self.snapshots):
            if isinstance(x, jax.Array) and not x.is_deleted():
                x.delete()
        self.snapshots, self._compiled = (), {}

    def _put(self, columns: list[np.ndarray]) -> list:
        return [jax.device_put(c, self.sharding) for c in columns] if self.sharding is not None else columns


def _chunks(items: list) -> list[list]:
    return [items[i : i + COPIES] for i in range(0, len(items), COPIES)]


def _columns(chunk: list[tuple], n: int) -> list[np.ndarray]:
    """The chunk's tuples as n int32 columns of COPIES, padded with zeros (the null slot and snapshot)."""
    table = np.zeros((COPIES, n), np.int32)
    table[: len(chunk)] = chunk
    return [table[:, j] for j in range(n)]


class PrefixCaching:
    """The engine's side of prefix caching around each launch: `before` restores the snapshots of requests
    that start on a hit, `after` names the pages each prefill row filled and saves the snapshots due."""

    def __init__(self, prefix, copier: SnapshotCopier | None):
        self.prefix = prefix
        self.copier = copier

    def before(self, rows, state: EngineState) -> EngineState:
        ps = self.prefix.page_size
        pages = [(r.request.copy_page_from, r.request.pages[r.request.num_computed // ps]) for r in rows
                 if r.request.copy_page_from is not None]
        restores = [(r.request.restore_snapshot, r.request.slot, r.request.num_computed) for r in rows
                    if r.request.restore_snapshot]
        for r in rows:
            r.request.restore_snapshot, r.request.copy_page_from = 0, None
        if pages:
            state = self.copier.copy_pages(state, pages)
        return self.copier.restore(state, restores) if restores else state

    def request_finished(self, req, num_outputs: int, later_rows: list, state: EngineState) -> None:
        """A request finishes at its output number num_outputs, its launch having fed it nothing after that
        token; later_rows: its rows in launches dispatched since. Its state is known exactly after its tokens but
        the last when there are none; after all of them when that row is one plain decode step (MTP drafts make
        a verify row's end known only on the device)."""
        from .request import RowKind

        length = len(req.prompt_token_ids) + num_outputs - 1
        if later_rows:
            row = later_rows[0]
            if row.kind != RowKind.DECODE or row.launch_steps != 1 or row.spec_tokens or self.prefix.lookahead:
                return
            length += 1  # that row feeds the last token
        self.finished(req, length, req.prompt_token_ids + req.output_token_ids[:num_outputs], state)

    def finished(self, req, length: int, tokens: list[int], state: EngineState) -> None:
        """req's slot and pages hold the state and KV of exactly `length` tokens of `tokens` once the launches
        dispatched so far have run: cache them (before its pages and slot are freed)."""
        key = self.prefix.finished(req, length, tokens)
        if key is not None and self.copier is not None:
            self.copier.save(state, [(req.slot, self.prefix.snapshots.add(key))])
            self.prefix.stats.snapshots_saved += 1

    def after(self, rows, starts: list[int], state: EngineState) -> None:
        """rows: the launch's (prefill rows of one step); starts: each row's first position; state: the state
        after the launch."""
        from .request import RowKind

        saves = []
        for row, start in zip(rows, starts):
            if row.kind not in (RowKind.PREFILL_CHUNK, RowKind.PROMPT_TAIL) or row.launch_steps != 1:
                continue
            end = start + row.num_tokens - len(row.spec_tokens)
            self.prefix.stats.computed += end - start
            key = self.prefix.publish(row.request, start, end)
            if key is not None and not row.spec_tokens and self.copier is not None:
                saves.append((row.request.slot, self.prefix.snapshots.add(key)))
        self.prefix.stats.snapshots_saved += len(saves)
        if saves:
            self.copier.save(state, saves)
