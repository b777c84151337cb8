"""The scheduler: the only source of truth for what runs in a step.

Continuous batching with chunked prefill under a token budget: running requests first (decodes and
unfinished prefills, in admission order), then waiting requests FCFS while a request slot, KV pages and
budget remain. When a running request needs a page and none is free, the most recently admitted running
request is preempted: its pages and slot are freed and it is recomputed from scratch later (prompt +
outputs so far become its prefill). Row kinds are computed here, once, from request state.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time

from .cache import PageAllocator, SlotAllocator
from .engine_config import EngineConfig
from .request import Request, RequestStatus, RowKind


@dataclasses.dataclass
class ScheduledRow:
    request: Request
    num_tokens: int  # num_scheduled_tokens
    kind: RowKind
    samples: bool  # the window reaches the end of the known tokens: its logits are sampled
    spec_tokens: list[int] = dataclasses.field(default_factory=list)  # scheduled_spec_decode_tokens


@dataclasses.dataclass
class SchedulerOutput:
    rows: list[ScheduledRow]
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)


def row_kind(req: Request, num_tokens: int, num_spec: int) -> RowKind:
    """Row kind from request state: the one place this is decided."""
    if num_spec:
        return RowKind.SPEC_VERIFY
    remaining = req.num_tokens - req.num_computed
    if remaining > 1:
        return RowKind.PREFILL_CHUNK
    if req.num_computed < req.prefill_len:
        return RowKind.PROMPT_TAIL
    return RowKind.DECODE


class Scheduler:
    def __init__(self, ecfg: EngineConfig, num_pages: int):
        self.ecfg = ecfg
        self.pages = PageAllocator(num_pages)
        self.slots = SlotAllocator(ecfg.num_slots)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []

    # ------------------------------------------------------------------------------------ bookkeeping
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def pages_needed(self, req: Request, seq_len: int) -> int:
        return max(0, math.ceil(seq_len / self.ecfg.kv_page_size) - len(req.pages))

    def _release(self, req: Request) -> None:
        self.pages.free(req.pages)
        req.pages = []
        if req.slot:
            self.slots.free(req.slot)
            req.slot = 0

    def finish(self, req: Request, reason: str) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.metrics.finished_time = time.perf_counter()
        if req in self.running:
            self.running.remove(req)
        self._release(req)

    def _preempt(self, req: Request) -> None:
        """Free everything and requeue at the front; it is recomputed from its prompt + outputs."""
        self.running.remove(req)
        self._release(req)
        req.status = RequestStatus.WAITING
        req.num_computed = 0
        req.prefill_len = req.num_tokens
        req.metrics.num_preemptions += 1
        self.waiting.appendleft(req)

    # ------------------------------------------------------------------------------------ scheduling
    def _window(self, req: Request, budget: int) -> int:
        """Tokens to schedule for req now: what remains, within the budget and max_model_len."""
        remaining = req.num_tokens - req.num_computed
        return max(0, min(remaining, budget, self.ecfg.max_model_len - req.num_computed))

    @staticmethod
    def _row(req: Request, n: int) -> ScheduledRow:
        return ScheduledRow(req, n, row_kind(req, n, 0), samples=req.num_computed + n == req.num_tokens)

    def schedule(self) -> SchedulerOutput:
        budget = self.ecfg.max_num_batched_tokens
        rows: list[ScheduledRow] = []
        preempted: list[Request] = []
        for req in list(self.running):
            if req not in self.running:  # preempted by an earlier row of this step
                continue
            n = self._window(req, budget)
            if n == 0:
                continue
            need = self.pages_needed(req, req.num_computed + n)
            while need > self.pages.num_free:
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue
            req.pages += self.pages.allocate(need)
            rows.append(self._row(req, n))
            budget -= n
        while self.waiting and budget > 0 and self.slots.num_free:
            req = self.waiting[0]
            n = self._window(req, budget)
            need = self.pages_needed(req, req.num_computed + n)
            if n == 0 or need > self.pages.num_free:
                break  # FCFS: later requests wait behind the head
            self.waiting.popleft()
            req.slot = self.slots.allocate()
            req.pages = self.pages.allocate(need)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            rows.append(self._row(req, n))
            budget -= n
        return SchedulerOutput(rows=rows, preempted=preempted)
