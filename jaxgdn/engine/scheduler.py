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
from .config import EngineConfig
from .host_masks import needs_host_masks
from .penalties import penalized
from .prefix_cache import PrefixCache
from .request import PLACEHOLDER_TOKEN, Request, RequestStatus, RowKind
from .state import FreeList


@dataclasses.dataclass
class ScheduledRow:
    request: Request
    num_tokens: int  # num_scheduled_tokens
    kind: RowKind
    samples: bool  # the window reaches the end of the known tokens: its logits are sampled
    spec_tokens: list[int] = dataclasses.field(default_factory=list)  # scheduled_spec_decode_tokens
    # A launch of several steps (Scheduler.launch_steps): the most steps this row runs live in it (each one
    # decode token or one verify window), and the tokens it may emit before its request ends there
    # (max_tokens, max_model_len; the device stops the row once it has emitted them). 1 otherwise.
    launch_steps: int = 1
    token_budget: int = 1

    @property
    def booked_outputs(self) -> int:
        """Placeholder outputs async scheduling books for a sampling row: one a step, 1+K a verify step."""
        return self.launch_steps * (1 + len(self.spec_tokens))

    @property
    def padded_tail(self) -> bool:
        """A prompt tail carrying placeholder drafts (-1): they must reach the device as -1."""
        return self.kind == RowKind.PROMPT_TAIL and bool(self.spec_tokens)


@dataclasses.dataclass
class SchedulerOutput:
    rows: list[ScheduledRow]
    preempted: list[Request]


def row_kind(req: Request) -> RowKind:
    """Row kind from request state, before its drafts: the one place this is decided."""
    remaining = req.num_tokens - req.num_computed
    if remaining > 1:
        return RowKind.PREFILL_CHUNK
    if req.num_computed < req.prefill_len:
        return RowKind.PROMPT_TAIL
    return RowKind.SPEC_VERIFY if req.spec_token_ids else RowKind.DECODE


def runs_verify_path(row: "ScheduledRow", reproduce_pd_mtp_bug: bool) -> bool:
    """Whether the row's GDN state takes the verification path (a checkpoint per window position,
    committed by num_accepted). Fixed rule (vLLM #47466): a row is spec iff it has drafts and exactly
    one non-draft token. The pre-fix rule also required num_computed >= num_prompt, which sent a padded
    PD prompt tail down the prefill path: its placeholders were folded into the committed state."""
    n_spec = len(row.spec_tokens)
    if not n_spec:
        return False
    if reproduce_pd_mtp_bug:
        return row.request.num_computed >= row.request.prefill_len
    return row.num_tokens == n_spec + 1


class Scheduler:
    """Allocates from the cache manager's pages and slots (cache_manager.py): pass its `prefix` and `slots` (None:
    a prefix cache with caching off over num_pages pages, and slots of its own)."""

    def __init__(self, ecfg: EngineConfig, num_pages: int, prefix: PrefixCache | None = None,
                 slots: FreeList | None = None):
        self.ecfg = ecfg
        self.K = ecfg.num_speculative_tokens
        self.prefix = prefix or PrefixCache(num_pages, ecfg.kv_page_size, 0, 0, enabled=False)
        self.pages = self.prefix.pages  # page 0 is the null page
        self.slots = slots or FreeList(ecfg.num_slots, "request slots")  # slot 0 is the null slot
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []

    # ------------------------------------------------------------------------------------ bookkeeping
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def usage(self) -> dict:
        """Requests running and waiting; KV pages, request slots and GDN snapshots in use and in all (page 0, slot 0
        and snapshot 0, the null ones, not counted). kv_pages_used: held by requests; kv_pages_cached: held by the
        prefix cache alone (free on demand); snapshots_used: all held by the prefix cache."""
        pages, slots = len(self.pages.refs) - 1, self.ecfg.num_slots - 1
        snapshots = self.prefix.snapshots
        return {"running": len(self.running), "waiting": len(self.waiting),
                "kv_pages_used": pages - self.pages.num_free, "kv_pages_cached": self.pages.num_cached,
                "kv_pages_total": pages, "slots_used": slots - self.slots.num_free, "slots_total": slots,
                "snapshots_used": len(snapshots), "snapshots_total": snapshots.capacity}

    def near_length_limit(self, steps_per_launch: int) -> bool:
        """MTP: a running request might be within one launch of verify windows of max_model_len, where schedule()
        shortens windows by what the host's booking (every draft accepted) says is left."""
        if not self.K:
            return False
        reach = steps_per_launch * (1 + self.K) + self.K
        return any(r.num_computed + reach > self.ecfg.max_model_len for r in self.running)

    def pages_needed(self, req: Request, seq_len: int) -> int:
        return max(0, math.ceil(seq_len / self.ecfg.kv_page_size) - len(req.pages))

    def release(self, req: Request) -> None:
        """Free a request's pages and slot."""
        self.prefix.forget(req)
        self.pages.free(req.pages)
        req.pages = []
        if req.slot:
            self.slots.free([req.slot])
            req.slot = 0

    def finish(self, req: Request, reason: str, release: bool = True) -> None:
        """Finish a running or waiting request: its pages and slot are free for the next schedule (release False:
        the caller frees them later with `release`)."""
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if reason == "abort":  # outputs of a launch in flight are never filled in
            req.output_token_ids = [t for t in req.output_token_ids if t != PLACEHOLDER_TOKEN]
        req.metrics.finished_time = time.perf_counter()
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if release:
            self.release(req)

    def _preempt(self, req: Request) -> None:
        """Free everything and requeue at the front; it is recomputed from its prompt + outputs."""
        if PLACEHOLDER_TOKEN in req.output_token_ids:  # async scheduling applies its launch in flight first
            raise RuntimeError(f"internal: request {req.request_id} preempted while a launch of it is in flight")
        self.running.remove(req)
        self.release(req)
        req.status = RequestStatus.WAITING
        req.num_computed = 0
        req.prefill_len = req.num_tokens
        req.spec_token_ids = []
        req.awaiting_final_token = False
        req.metrics.num_preemptions += 1
        self.waiting.appendleft(req)

    # ------------------------------------------------------------------------------------ scheduling
    def _plan(self, req: Request, budget: int, rows: list[ScheduledRow]) -> ScheduledRow | None:
        """The row req would run now (None: nothing fits). Drafts ride on a decode; a 1-token prompt
        tail is padded to 1+K placeholders when other requests run and no prefill is scheduled."""
        kind = row_kind(req)
        room = self.ecfg.max_model_len - req.num_computed  # positions left for this window
        spec: list[int] = []
        if kind == RowKind.SPEC_VERIFY:
            spec = req.spec_token_ids[: max(0, min(budget, room) - 1)]
            n = 1 + len(spec)
            if not spec:
                kind = RowKind.DECODE
        elif (kind == RowKind.PROMPT_TAIL and self.K and self.ecfg.pad_prompt_tail and rows
              and not any(r.kind == RowKind.PREFILL_CHUNK for r in rows)):
            if budget < 1 + self.K or room < 1 + self.K:
                return None  # vLLM prefers not scheduling to scheduling unpadded
            spec, n = [-1] * self.K, 1 + self.K
        else:
            n = max(0, min(req.num_tokens - req.num_computed, budget, room))
            if kind == RowKind.PREFILL_CHUNK:  # stop where a state snapshot is due
                n = self.prefix.chunk_end(req, req.num_computed + n) - req.num_computed
        if n == 0:
            return None
        samples = req.num_computed + n - len(spec) == req.num_tokens and not req.prefill_only
        return ScheduledRow(req, n, kind, samples=samples, spec_tokens=spec)

    def may_preempt(self) -> bool:
        """Whether the next schedule() could preempt: the running requests' next windows (at most all
        their known tokens, a verify window's K drafts, and the K lookahead positions of _pages_for) might
        need more pages than are free."""
        need = sum(self.pages_needed(r, min(r.num_tokens + 2 * self.K, self.ecfg.max_model_len)) for r in self.running)
        return need > self.pages.num_free

    def _pages_for(self, row: ScheduledRow) -> int:
        """Pages for the window plus K lookahead positions that the MTP drafts write."""
        req = row.request
        end = min(req.num_computed + row.num_tokens + self.K, self.ecfg.max_model_len)
        return self.pages_needed(req, end)

    def launch_steps(self, out: SchedulerOutput, num_steps: int) -> int:
        """How many model steps out's launch runs: num_steps when every row is a 1-token decode row (K = 0) or
        every row a verify window of 1+K (each sampling), no waiting request could start now, and the free
        KV pages cover the launch's worst case (allocated here); else 1. A decode row's launch_steps and
        token_budget are what its request may still produce (max_tokens, max_model_len), at most
        num_steps: the launch always runs num_steps (one program per bucket), a row with fewer writes its
        later steps to the null page and samples nothing there. A verify row may emit 1..1+K tokens a
        step, so it gets pages for num_steps full windows (+K lookahead) and the launch needs that much
        room under max_model_len for every row; its budget is max_tokens' remainder."""
        if num_steps <= 1 or not out.rows or (self.waiting and self.slots.num_free):
            return 1
        if any(needs_host_masks(row.request) for row in out.rows):  # each step's masks need the last tokens
            return 1
        if any(penalized(row.request.sampling_params) for row in out.rows):  # split launches run one step
            return 1
        # one width a launch program: 1 + K (decode rows without MTP, verify windows with it)
        width = 1 + self.K
        kind = RowKind.DECODE if width == 1 else RowKind.SPEC_VERIFY
        if any(row.kind != kind or row.num_tokens != width or not row.samples
                                                for row in out.rows):
            return 1
        max_len = self.ecfg.max_model_len
        plan = []  # (row, launch_steps, token_budget, end of the positions it may write)
        for row in out.rows:
            req = row.request
            # (a lower bound of the outputs: with a verify launch in flight the budget may exceed what is
            # left, never fall short of it; a row the device stops early would commit garbage state)
            outputs = req.num_outputs_lower_bound
            left = min(req.sampling_params.max_tokens - outputs, max_len - len(req.prompt_token_ids) - outputs)
            if kind == RowKind.DECODE:
                n = max(1, min(num_steps, left))
                plan.append((row, n, n, req.num_computed + n))
            else:
                end = req.num_computed + num_steps * width + self.K
                if end > max_len:
                    return 1
                plan.append((row, num_steps, max(1, left), end))
        need = [self.pages_needed(row.request, end) for row, _, _, end in plan]
        if sum(need) > self.pages.num_free:
            return 1
        for (row, n, budget, _), pages in zip(plan, need):
            row.request.pages += self.pages.allocate(pages)
            row.launch_steps, row.token_budget = n, budget
        return num_steps

    def schedule(self) -> SchedulerOutput:
        budget = self.ecfg.max_num_batched_tokens
        rows: list[ScheduledRow] = []
        preempted: list[Request] = []
        for req in list(self.running):
            if req.status is not RequestStatus.RUNNING or req.awaiting_final_token or req.masks_in_flight:
                continue  # preempted by an earlier row of this step, or its last token (or grammar) is in flight
            row = self._plan(req, budget, rows)
            if row is None:
                continue
            need = self._pages_for(row)
            while need > self.pages.num_free:
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue
            req.pages += self.pages.allocate(need)
            rows.append(row)
            budget -= row.num_tokens
        while self.waiting and budget > 0 and self.slots.num_free:
            req = self.waiting[0]
            hit = self.prefix.hold(req)  # before _plan and _pages_for: it starts after its cached tokens
            if hit is not None:
                req.pages, req.num_computed = list(hit.pages), hit.num_tokens
            row = self._plan(req, budget, rows)
            if row is None or self._pages_for(row) > self.pages.num_free:
                if hit is not None:
                    self.pages.free(req.pages)
                    req.pages, req.num_computed = [], 0
                break  # FCFS: later requests wait behind the head
            need = self._pages_for(row)
            cached = self.prefix.admit(req, hit)
            if cached is not None and req.num_cached_tokens is None:
                req.num_cached_tokens = cached
            self.waiting.popleft()
            (req.slot,) = self.slots.allocate(1)
            req.pages += self.pages.allocate(need)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            rows.append(row)
            budget -= row.num_tokens
        return SchedulerOutput(rows=rows, preempted=preempted)

