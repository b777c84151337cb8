"""The engine's side of prefix caching around each launch: which snapshots to restore and pages to copy before a
launch, which snapshots to save after one (prefix_cache.py decides what is cached; state_copies.py's programs move
the state).
"""

from __future__ import annotations

from .request import RowKind
from .state import EngineState
from .state_copies import PageCopy, SnapshotRestore, SnapshotSave, StateCopies


class PrefixCaching:
    """The engine's side of prefix caching around each launch: `before` restores the snapshots of requests
    that start on a hit, `after` names the pages each prefill row filled and saves the snapshots due."""

    def __init__(self, prefix, copies: StateCopies, snapshots: bool):
        """snapshots: the engine keeps GDN state snapshots (its copies hold their pools)."""
        self.prefix = prefix
        self.copies = copies
        self.snapshots = snapshots

    def before(self, rows) -> list:
        """The state copies to run before the launch of rows: page copies, then snapshot restores."""
        ps = self.prefix.page_size
        pages = [PageCopy(r.request.copy_page_from, r.request.pages[r.request.num_computed // ps]) for r in rows
                 if r.request.copy_page_from is not None]
        restores = [SnapshotRestore(r.request.restore_snapshot, r.request.slot, r.request.num_computed) for r in rows
                    if r.request.restore_snapshot]
        for r in rows:
            r.request.restore_snapshot, r.request.copy_page_from = 0, None
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
