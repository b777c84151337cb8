"""A launch's bookkeeping on the host: booked when it is dispatched, settled when its results come back.

Exact because the sampled tokens and drafts reach the next step on the device (last_sampled, draft_tokens), never
through the host. A sampling row appends placeholder outputs, filled when its launch's results are applied. Without
MTP every row advances by its token count whatever it samples. With MTP a verify row emits 1..1+K tokens a step,
known only on the device: the host books its launch as if every draft were accepted (num_computed, placeholders,
pages), flags the request's next row to start where the device's count says (rebase) while this launch is in
flight, and when the results come back removes the placeholders left unfilled and takes them off num_computed. A
request whose token ends it (stop token, length) may already have a row in the next launch: that row's work is
discarded. A request whose last allowed token is surely in flight is not scheduled again. A launch of several steps
(Scheduler.launch_steps) books each row's launch_steps.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

from .host_masks import needs_host_masks
from .logprobs import record_prompt, record_sampled
from .request import PLACEHOLDER_TOKEN, Request, RequestStatus, RowKind
from .cache_manager import CacheManager
from .runner import ModelRunner, PendingStep
from .scheduler import Scheduler, SchedulerOutput
from .spec_decode import SpecCounters
from .step_layout import device_stop_ids


@dataclasses.dataclass
class InFlight:
    """A dispatched launch: its rows, device results, each row's first position as booked, the index of its first
    placeholder output token (-1 for rows that do not sample), and each request's spec_excess when it was booked."""

    out: SchedulerOutput
    pending: PendingStep
    starts: list[int]
    out_index: list[int]
    excess: list[int]


class Update:
    """Books launches and applies their results to the requests (vLLM's update_from_output): fills tokens, takes
    back rejected drafts, finishes requests, and hands finished state to the prefix cache.

    draft_override (a test hook): replaces the MTP drafts of a request before they are verified. record_inputs:
    keep every token fed to the model per request, (position, token id), in fed_tokens (prompt-fidelity tests)."""

    def __init__(self, K: int, eos_token_ids, max_model_len: int, scheduler: Scheduler, runner: ModelRunner,
                 cache: CacheManager):
        self.K, self.eos_token_ids, self.max_model_len = K, tuple(eos_token_ids), max_model_len
        self.scheduler, self.runner, self.cache = scheduler, runner, cache
        self.spec_counters = SpecCounters(K)
        self.draft_override: Callable[[Request, list[int]], list[int]] | None = None
        self.record_inputs = False
        self.fed_tokens: dict[int, list[tuple[int, int]]] = {}

    def book(self, out: SchedulerOutput, pending: PendingStep) -> InFlight:
        """Book a dispatched launch's rows before its results come back (see the module's docstring)."""
        starts, out_index, excess = [], [], []
        for row in out.rows:
            req = row.request
            starts.append(req.num_computed)
            excess.append(req.spec_excess)
            req.num_computed += row.launch_steps * row.num_tokens  # every draft accepted, every step
            out_index.append(len(req.output_token_ids) if row.samples else -1)
            if row.samples:
                req.masks_in_flight = needs_host_masks(req)
                req.output_token_ids += [PLACEHOLDER_TOKEN] * row.booked_outputs
                req.output_slack += row.booked_outputs - min(row.launch_steps, row.token_budget)
                if self.K:  # the drafts it proposes are on the device: the next row verifies K
                    req.spec_token_ids = [PLACEHOLDER_TOKEN] * self.K
                req.awaiting_final_token = self.length_reached(req, req.num_outputs_lower_bound)
        return InFlight(out, pending, starts, out_index, excess)

    def apply(self, flight: InFlight, later: InFlight | None, sync: bool,
              applied: Callable[[Request, int], None]) -> None:
        """Fill the placeholders of a dispatched launch with its sampled tokens (step by step), count acceptance,
        finish requests; with MTP, drop the placeholders a verify row left unfilled and take them off num_computed.
        later: the launch dispatched since, if any. sync (no later launch booked): the drafts come to the host too,
        through draft_override where one is set. applied(req, end): called for each request that goes on, end being
        the position after its row's tokens."""
        results = self.runner.fetch(flight.pending)
        now = time.perf_counter()
        t = 0
        for b, row in enumerate(flight.out.rows):
            req = row.request
            tokens_in = slice(t, t + row.num_tokens)
            t += row.num_tokens
            req.masks_in_flight &= not row.samples  # (a chunk row's launch is not the sampling row's)
            if req.status is RequestStatus.FINISHED:  # a finished request's extra row: discarded
                continue
            # unused placeholders of this request's earlier launches, removed after this one was booked
            removed = req.spec_excess - flight.excess[b]
            start, i, emitted = flight.starts[b] - removed, flight.out_index[b] - removed, 0
            for j, res in enumerate(results[: row.launch_steps]):  # step by step, up to the one its request ends in
                if self.record_inputs:
                    ids = res.input_ids[tokens_in]
                    self.fed_tokens.setdefault(req.request_id, []).extend((start + k, int(x)) for k, x in enumerate(ids))
                record_prompt(req, res.stream_scores, tokens_in.start, start, row.num_tokens)
                start += int(res.num_sampled[b]) if row.samples else row.num_tokens
                if not row.samples:
                    continue
                n = int(res.num_sampled[b])
                if row.kind == RowKind.SPEC_VERIFY:
                    self.spec_counters.count(req.metrics, len(row.spec_tokens), n - 1)
                for k, token in enumerate(res.tokens[b, :n]):
                    if req.host_masks is not None and not req.host_masks.accept_token(int(token)):
                        req.error = f"token {int(token)} is outside the request's grammar"
                    req.output_token_ids[i + emitted] = int(token)
                    record_sampled(req, res.sampled_scores, b * (1 + self.K) + k, int(token))
                    emitted += 1
                    # the last token of its step, and of its launch: the device fed the row nothing after it
                    last = k == n - 1 and (j == row.launch_steps - 1 or emitted >= row.token_budget)
                    self.finish_if_done(req, int(token), now, later, num_outputs=i + emitted,
                                        last_of_step=k == n - 1, last_of_launch=last)
                    if req.status is RequestStatus.FINISHED:
                        break
                if req.status is RequestStatus.FINISHED:
                    del req.output_token_ids[i + emitted :]  # placeholders of steps after this token
                    break
            if req.status is RequestStatus.FINISHED:
                continue
            applied(req, start)
            if row.samples:
                self._settle_drafts(req, row, results, b, emitted, i, sync)
        self.runner.timings["update"] += time.perf_counter() - now

    def _settle_drafts(self, req: Request, row, results, b: int, emitted: int, i: int, sync: bool) -> None:
        """Take back a sampling row's unfilled placeholders; bring its drafts to the host where they are needed."""
        unused = row.booked_outputs - emitted
        del req.output_token_ids[i + emitted : i + emitted + unused]
        req.num_computed -= unused
        req.spec_excess += unused
        req.output_slack -= row.booked_outputs - min(row.launch_steps, row.token_budget)
        if (sync or needs_host_masks(req)) and self.K:  # a masked row's next masks need its drafts
            drafts = [int(d) for d in results[row.launch_steps - 1].drafts[b]]
            if self.draft_override is not None:
                drafts = self.draft_override(req, drafts)
                self.runner.set_drafts(req.slot, drafts)
            req.spec_token_ids = drafts

    def finish_if_done(self, req: Request, token: int, now: float, later: InFlight | None = None,
                       num_outputs: int | None = None, last_of_step: bool = False, last_of_launch: bool = False) -> None:
        """Bookkeeping for a request's output token number num_outputs (default: its last one): first token time,
        finishing on a stop token, max_tokens or max_model_len. later: the launch dispatched since. last_of_step /
        last_of_launch: the device fed the request nothing after this token in its step / its launch (then the
        prefix cache may keep its state)."""
        num_outputs = len(req.output_token_ids) if num_outputs is None else num_outputs
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        sp = req.sampling_params
        if req.error is not None:
            reason = "error"
        elif ((not sp.ignore_eos and token in self.eos_token_ids) or token in sp.stop_token_ids
              or (req.host_masks is not None and req.host_masks.is_terminated())):
            reason = "stop"
        elif self.length_reached(req, num_outputs):
            reason = "length"
        else:
            return
        # the device stopped the row too: its later rows ran on the null slot
        device_stopped = last_of_step and reason == "stop" and token in device_stop_ids(sp, self.eos_token_ids)
        if last_of_launch or device_stopped:
            flight = None if device_stopped else later  # a stopped slot's later rows change nothing
            later_rows = [r for r in flight.out.rows if r.request is req] if flight else []
            self.cache.request_finished(req, num_outputs, later_rows, self.runner.state)
        self.scheduler.finish(req, reason)

    def length_reached(self, req: Request, num_outputs: int) -> bool:
        """Whether output number num_outputs is the request's last: max_tokens or max_model_len."""
        return (num_outputs >= req.sampling_params.max_tokens
                or len(req.prompt_token_ids) + num_outputs >= self.max_model_len)
