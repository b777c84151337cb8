"""The cache manager: the one owner of what holds requests' state on the device.

It owns the KV pages (with the prefix cache's content index, prefix_cache.py), the GDN request slots, the GDN state
snapshots, and the programs that copy state between them (state_copies.py). The scheduler allocates pages and slots
from it; around each launch it names the copies prefix caching needs: snapshots to restore and pages to copy before
a launch, snapshots to save after one.
"""

from __future__ import annotations

from ..model.config import ModelConfig
from .config import EngineConfig
from .placement import Placement
from .prefix_cache import PrefixCache
from .request import RowKind
from .state import EngineState, FreeList, init_snapshots
from .state_copies import PageCopy, SnapshotRestore, SnapshotSave, StateCopies
from .tensor_parallel import conv_channel_order


class CacheManager:
    """pages: the KV page allocator (page 0 is the null page); slots: the request slot allocator (slot 0 is the null
    slot); prefix: the prefix cache over them; copies: the state copy programs, which hold the snapshot pools.
    caching: prefix caching on; lookahead: positions past a window that MTP drafts write (1 with MTP)."""

    def __init__(self, cfg: ModelConfig, ecfg: EngineConfig, num_pages: int, num_snapshots: int, *, caching: bool,
                 lookahead: int, placement: Placement, buffer_sharding):
        self.prefix = PrefixCache(num_pages, ecfg.kv_page_size, num_snapshots,
                                  ecfg.prefix_cache_state_interval if cfg.gdn_layer_ids else 0, enabled=caching,
                                  lookahead=lookahead)
        self.pages = self.prefix.pages
        self.slots = FreeList(ecfg.num_slots, "request slots")
        pools = placement.make_state(lambda: init_snapshots(cfg, ecfg, num_snapshots)) if num_snapshots else ()
        tp = ecfg.tensor_parallel_size
        self.copies = StateCopies(cfg, ecfg.max_pages_per_seq, buffer_sharding, pools,
                                  conv_channel_order(cfg, tp) if tp > 1 else None)
        self.snapshots = bool(num_snapshots)  # GDN state snapshots are kept

    def before(self, rows) -> list:
        """The state copies to run before the launch of rows: page copies, then snapshot restores."""
        ps = self.prefix.page_size
        hits = [(r.request, hit) for r in rows if (hit := self.prefix.take(r.request)) is not None]
        pages = [PageCopy(h.tail_page, req.pages[req.num_computed // ps]) for req, h in hits if h.tail_page is not None]
        restores = [SnapshotRestore(h.snapshot, req.slot, req.num_computed) for req, h in hits if h.snapshot]
        return pages + restores

    def request_finished(self, req, num_outputs: int, later_rows: list, state: EngineState) -> None:
        """A request finishes at its output number num_outputs, its launch having fed it nothing after that
        token; later_rows: its rows in launches dispatched since. Its state is known exactly after its tokens but
        the last when there are none; after all of them when that row is one plain decode step (MTP drafts make
        a verify row's end known only on the device)."""
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
        if key is not None and self.snapshots:
            self.copies.run(state, [SnapshotSave(req.slot, self.prefix.snapshots.add(key))])
            self.prefix.stats.snapshots_saved += 1

    def after(self, rows, starts: list[int], state: EngineState) -> None:
        """rows: the launch's (prefill rows of one step); starts: each row's first position; state: the state
        after the launch."""
        saves = []
        for row, start in zip(rows, starts):
            if row.kind not in (RowKind.PREFILL_CHUNK, RowKind.PROMPT_TAIL) or row.launch_steps != 1:
                continue
            end = start + row.num_tokens - len(row.spec_tokens)
            self.prefix.stats.computed += end - start
            key = self.prefix.publish(row.request, start, end)
            if key is not None and not row.spec_tokens and self.snapshots:
                saves.append(SnapshotSave(row.request.slot, self.prefix.snapshots.add(key)))
        self.prefix.stats.snapshots_saved += len(saves)
        if saves:
            self.copies.run(state, saves)
