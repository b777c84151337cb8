"""LLMEngine: requests in, steps, outputs out. `LLM` (llm.py) is the batch facade over it.

Bad requests (empty prompt, ids outside the vocabulary, too long for max_model_len, bad sampling
parameters) are finished at once with finish_reason "error" and a message; the other requests run on.
"""

from __future__ import annotations

import collections
import itertools
import time
from typing import Callable, Iterable

import jax
import numpy as np

from pallas_kernels.ragged_attention import block_queries

from ..model.config import ModelConfig
from ..model.params import ModelParams, serving_layout
from ..model.policy import KernelPolicy
from .config import EngineConfig
from .memory import device_memory, handoff_bytes, plan_memory
from .programs import ProgramSet, StepShape
from .request import (PLACEHOLDER_TOKEN, Request, RequestMetrics, RequestOutput, RequestStatus, RowKind, SamplingParams,
                      validate_request)
from .runner import ModelRunner, enable_compilation_cache
from .scheduler import InFlight, Scheduler, SchedulerOutput
from .state import init_engine_state, init_snapshots
from .step_layout import BlockTables, StepArrays, StopTable, build_step, program_layout
from .logprobs import Sampler, launch_sampler, record_prompt, record_sampled
from .host_masks import attach_host_masks, launch_bitmask, needs_host_masks
from .penalties import penalty_arrays, seed, seed_admitted, seed_size
from .structured import Grammars
from .placement import Placement
from .prefix_cache import PrefixCache
from .snapshots import PrefixCaching
from .state_copies import COPIES, StateCopies
from .spec_decode import SpecCounters
from .split_step import SAMPLER_VARIANTS
from .tensor_parallel import conv_channel_order, local_config


class LLMEngine:
    """device: the JAX device of the engine's weights and state (None: JAX's default). mesh: with
    ecfg.tensor_parallel_size N > 1, the 1-D mesh of N devices (axis "tp") the weights and pools are split over
    (None: the first N devices). memory_share: the part of the memory budget left on the device this engine
    takes (a PD prefill worker beside its decode worker); memory_reserved: bytes other engines on the device
    need beyond what they hold now (the decode worker plans around its prefill worker's step temporaries).
    policy: the kernel policy (default `ecfg.kernel_policy` for the
    device's platform). garbage_seed: fill every state buffer with garbage (slot-hygiene tests)."""

    caches_prefixes = True  # with ecfg.enable_prefix_caching (a PD decode worker imports its prompts instead)
    samples_outputs = True  # a PD prefill worker samples nothing (structured output is the decode worker's)

    def __init__(self, params: ModelParams, cfg: ModelConfig, ecfg: EngineConfig, *,
                 garbage_seed: int | None = None, decode: Callable[[list[int]], str] | None = None, device=None,
                 memory_share: float = 1.0, memory_reserved: int = 0, policy: KernelPolicy | None = None, mesh=None):
        self.cfg, self.ecfg = cfg, ecfg
        self.K = ecfg.num_speculative_tokens
        if self.K and params.mtp is None:
            raise ValueError("num_speculative_tokens > 0 needs a checkpoint with an MTP head (mtp.* tensors)")
        with_mtp = params.mtp is not None and self.K > 0
        if ecfg.compilation_cache:
            enable_compilation_cache()
        # a copy of the weights unless the caller passed them in this layout (LLM does)
        params = serving_layout(params, ecfg.fold_norms)
        self.step_cfg = local_config(cfg, ecfg.tensor_parallel_size)  # what one shard's step sees (cfg on one device)
        self.placement = Placement.of(ecfg.tensor_parallel_size, device, mesh)
        params = self.placement.put_params(params, cfg)
        self.mesh, self.device = self.placement.mesh, self.placement.device
        platform = self.placement.platform
        self.decode_steps_per_launch = ecfg.resolved_decode_steps(platform)
        self.programs = ProgramSet(ecfg, self.decode_steps_per_launch)
        self.block_tables = BlockTables(ecfg.num_slots, ecfg.max_pages_per_seq)
        self.seed_size = seed_size(ecfg.max_model_len)
        self.block_q = block_queries(self.step_cfg.num_attention_heads, self.step_cfg.num_key_value_heads)
        self.policy = policy or ecfg.kernel_policy(platform)
        self.runner = ModelRunner(params, cfg, None, policy=self.policy, reproduce_pd_mtp_bug=ecfg.reproduce_pd_mtp_bug,
                                  device=None if self.mesh else self.device,
                                  rebases=ecfg.uses_async_scheduling and self.K > 0,
                                  mesh=self.mesh)
        new_state = lambda pages, garbage=None: init_engine_state(  # noqa: E731
            cfg, ecfg, pages, num_spec=self.K, with_mtp=with_mtp, garbage_seed=garbage)
        caching = ecfg.enable_prefix_caching and self.caches_prefixes
        # a shard's pools are its heads' share: the per-device plan is the local config's
        self.memory = plan_memory(self.step_cfg, ecfg, with_mtp, device_memory(self.device),
                                  lambda pages: self._step_peak(self.placement.abstract_state(lambda: new_state(pages))),
                                  memory_share, memory_reserved, snapshots=caching,
                                  copy_peak=self.copy_peak(with_mtp), staged=self.staged(with_mtp))
        num_pages = self.memory.num_kv_pages
        if num_pages - 1 < ecfg.max_pages_per_seq:
            raise ValueError(
                f"EngineConfig: {num_pages - 1} usable KV pages cannot hold one sequence of max_model_len "
                f"{ecfg.max_model_len} ({ecfg.max_pages_per_seq} pages of {ecfg.kv_page_size})"
            )
        num_snapshots = self.memory.num_snapshots
        self.prefix = PrefixCache(num_pages, ecfg.kv_page_size, num_snapshots,
                                  ecfg.prefix_cache_state_interval if cfg.gdn_layer_ids else 0, enabled=caching,
                                  lookahead=int(with_mtp))
        self.scheduler = Scheduler(ecfg, num_pages, self.prefix)
        self.runner.state = self.placement.make_state(lambda: new_state(num_pages, garbage_seed),
                                                      host_drawn=garbage_seed is not None)
        snapshots = self.placement.make_state(lambda: init_snapshots(cfg, ecfg, num_snapshots)) if num_snapshots else ()
        tp = ecfg.tensor_parallel_size
        self.copies = StateCopies(cfg, ecfg.max_pages_per_seq, self.runner.buffer_sharding, snapshots,
                                  conv_channel_order(cfg, tp) if tp > 1 else None)
        self.prefix_caching = PrefixCaching(self.prefix, self.copies, bool(num_snapshots))
        self.slot_prefill_len = np.zeros(ecfg.num_slots, np.int32)
        self.stop_table = StopTable(ecfg.num_slots, cfg.eos_token_ids)
        self.requests: dict[int, Request] = {}
        self._ids = itertools.count()
        self.decode = decode
        self.grammars: Grammars | None = None  # structured output's compiler (LLM sets it from the tokenizer)
        self.num_steps = 0
        # Every token fed to the model, per request: (position, token id). Tests check prompt fidelity.
        self.record_inputs = False
        self.fed_tokens: dict[int, list[tuple[int, int]]] = {}
        self.spec_counters = SpecCounters(self.K)
        # Test hook: replace the MTP drafts of a request before they are verified (adversarial drafts).
        self.draft_override: Callable[[Request, list[int]], list[int]] | None = None
        # Async scheduling: the dispatched step whose results are not applied yet.
        self.async_scheduling = ecfg.uses_async_scheduling
        self._in_flight: InFlight | None = None
        self.num_launches = 0
        self.closed = False

    def copy_peak(self, with_mtp: bool) -> int:
        """Bytes the largest state copy program this engine runs gathers (page copies and snapshots; a PD worker's
        handoffs)."""
        return handoff_bytes(self.step_cfg, self.ecfg, with_mtp, COPIES, COPIES)

    def staged(self, with_mtp: bool) -> tuple[int, int]:
        """(handoffs held on the device ahead of their import at most, bytes of one): a PD decode server's."""
        return 0, 0

    def _step_peak(self, state) -> int:
        """Bytes of the temporaries of the largest step program: the largest ragged program (sampled), or a split
        launch's sample program of as many rows with every feature (penalties hold [rows, 1+K, V] counts),
        compiled on `state` (abstract: only its shapes matter)."""
        tokens = self.programs.token_buckets[-1]
        shape = StepShape(tokens, self.programs.rows_for(tokens))
        keys = [(program_layout(shape, self.ecfg, self.block_q), int(Sampler.SAMPLE), 1, 0),
                ("sample", shape.rows, max(SAMPLER_VARIANTS))]
        return max(int(self.runner.compile_on(key, state).memory_analysis().temp_size_in_bytes) for key in keys)

    # ------------------------------------------------------------------------------------ programs
    def program_keys(self, sampled: bool = True) -> list[tuple]:
        """The runner's keys of every program this engine may run: each shape of `programs`, greedy and (sampled)
        with temperature rows, and (sampled) the scores of their tokens; for every ragged shape the split launch's
        programs (split_step.py) that serve the other sampling features."""
        samplers = [Sampler.GREEDY] + [Sampler.SAMPLE] * sampled
        shapes = self.programs.all_shapes()
        keys = [(program_layout(shape, self.ecfg, self.block_q), int(sampler), shape.num_steps, shape.width)
                for shape in shapes for sampler in samplers]
        ragged = [shape for shape in shapes if not shape.uniform]
        keys += [(part, program_layout(shape, self.ecfg, self.block_q)) for shape in ragged
                 for part in ("forward", "stream", "commit")]
        variants = SAMPLER_VARIANTS if sampled else (int(Sampler.GREEDY),)
        keys += [("sample", rows, v) for rows in dict.fromkeys(s.rows for s in ragged) for v in variants]
        return keys + list(dict.fromkeys(("score", s.num_steps, s.rows) for s in shapes)) * sampled

    def precompile(self, on_compiled: Callable[[], None] | None = None, sampled: bool = True) -> int:
        """Compile every program now (see program_keys), the penalties' seeding and the state copy programs this
        engine runs (copy_programs); later compiles count as compiles after start-up (`compiles_after_startup`).
        Returns the number of step programs compiled."""
        before = self.runner.num_compiles
        self.runner.precompile(self.program_keys(sampled), on_compiled)
        if self.samples_outputs:
            self.runner.state = seed(self.runner.state, 0, [], [], self.seed_size)
        self.copies.precompile(self.runner.state, self.copy_programs(), self.transfer_source(), on_compiled)
        self.runner.started = self.copies.started = True
        return self.runner.num_compiles - before

    def copy_programs(self) -> list[tuple[str, int]]:
        """(name, page bucket) of the state copy programs this engine runs (state_copies.py)."""
        return self.copies.program_names(self.prefix_caching.snapshots, *self.handoff_programs())

    def handoff_programs(self) -> tuple[bool, bool, bool]:
        """Whether this engine imports, exports and transfers PD handoffs (a decode worker, a prefill worker)."""
        return False, False, False

    def transfer_source(self):
        """The state of the prefill worker whose pools this engine copies handoffs from (a decode worker's), or None."""
        return None

    @property
    def compiles_after_startup(self) -> int:
        """Step and state copy programs compiled after precompile (0 when every launch ran a start-up program)."""
        return self.runner.compiles_after_startup + self.copies.compiles_after_startup

    # ------------------------------------------------------------------------------------ requests
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    error: str | None = None) -> int:
        """Queue a request; returns its id. Invalid input (or a caller's `error`) finishes it at once
        with finish_reason "error"."""
        params = params or SamplingParams()
        rid = next(self._ids)
        req = Request(rid, list(prompt_token_ids), params, RequestMetrics(arrival_time=time.perf_counter()))
        self.requests[rid] = req
        error = error or self.validate(req.prompt_token_ids, params) or (
            self.samples_outputs and attach_host_masks(req, self.grammars, self.cfg.eos_token_ids)) or None
        if error:
            req.error = error
            req.status = RequestStatus.FINISHED
            req.finish_reason = "error"
        else:
            req.prompt_array()  # here, not in the step that first assembles its tokens
            self.scheduler.add(req)
        return rid

    def validate(self, ids: list[int], params: SamplingParams) -> str | None:
        """The error message for a bad request, or None."""
        return validate_request(ids, params, self.cfg.vocab_size, self.ecfg.max_model_len)

    def abort_request(self, rid: int) -> None:
        """Finish a waiting or running request now (finish_reason "abort"); its pages and slot are free for the
        next step. A row of it in the launch in flight is discarded when that launch is applied."""
        req = self.requests.get(rid)
        if req is None or req.status is RequestStatus.FINISHED:
            return
        self.scheduler.finish(req, "abort")
        req.output_token_ids = [t for t in req.output_token_ids if t != PLACEHOLDER_TOKEN]

    def forget(self, rid: int) -> None:
        """Drop a finished request's record (a server's engine runs for ever; LLM.generate keeps them)."""
        req = self.requests.get(rid)
        if req is not None and req.status is RequestStatus.FINISHED:
            del self.requests[rid]
            self.fed_tokens.pop(rid, None)

    def flush(self) -> None:
        """Apply the launch in flight, if any (async scheduling; run when no request is left to step)."""
        self._apply_in_flight(sync=not self._asynchronous)

    def close(self) -> None:
        """Free the engine's compiled programs and device buffers (requests still running are dropped); the
        engine cannot step afterwards."""
        if self._in_flight is not None:
            jax.block_until_ready(self._in_flight.pending.flats)
            self._in_flight = None
        self.runner.close()
        self.copies.close()
        self.closed = True

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (pages held by running requests stay theirs)."""
        self.prefix.reset()

    def usage(self) -> dict:
        """Requests running and waiting, KV pages and request slots in use and in all (page 0 and slot 0,
        the null ones, not counted)."""
        s = self.scheduler
        pages, slots = self.memory.num_kv_pages - 1, self.ecfg.num_slots - 1
        return {"running": len(s.running), "waiting": len(s.waiting),
                "kv_pages_used": pages - s.pages.num_free, "kv_pages_total": pages,
                "slots_used": slots - s.slots.num_free, "slots_total": slots}

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # ------------------------------------------------------------------------------------ stepping
    @property
    def timings(self) -> "collections.Counter[str]":
        """Seconds spent per phase of step(), summed over steps: schedule, build (host arrays), transfer
        (to the device), dispatch (the jitted step's launch), wait (device work + results back), update
        (requests, outputs)."""
        return self.runner.timings

    def step(self) -> SchedulerOutput:
        """Schedule and launch one step (with decode_steps_per_launch, a launch of several); returns what was
        scheduled. Synchronous scheduling applies the launch's results before returning; async scheduling
        (the default) applies the previous launch's instead, so the host's work overlaps the device's (see
        `_launch`). The launch in flight is applied first when the coming schedule could preempt (not enough
        free pages for every running request's next window: a preempted request is recomputed from its real
        tokens) and, with MTP, when a running request is within one launch of max_model_len (so every verify
        window is scheduled as the synchronous engine would). num_steps counts model steps, num_launches
        device launches. Equal to `launch()` then `finish()`."""
        out = self.launch()
        self.finish()
        return out

    @property
    def _asynchronous(self) -> bool:
        return self.async_scheduling and self.draft_override is None

    def launch(self) -> SchedulerOutput:
        """The first half of step(): schedule and dispatch. A synchronous engine's results are applied by `finish()`
        (or its next launch), so an orchestrator of two synchronous engines (PD) can do one's host work while the
        other's launch runs."""
        if self.closed:
            raise RuntimeError("this engine is closed (LLM.close()): build a new one")
        asynchronous = self._asynchronous
        if self._in_flight is not None and (not asynchronous or self.scheduler.may_preempt()
                                            or self._near_length_limit()):
            self._apply_in_flight(sync=not asynchronous)
        out = self._schedule()
        previous, self._in_flight = self._in_flight, (self._launch(out) if out.rows else None)
        if previous is not None:
            self._apply(previous)
        return out

    def finish(self) -> None:
        """The second half of step(): a synchronous engine applies its launch's results (an asynchronous one applies
        them in a later step)."""
        if not self._asynchronous:
            self._apply_in_flight(sync=True)

    def _schedule(self) -> SchedulerOutput:
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        self.timings["schedule"] += time.perf_counter() - t0
        if not out.rows and self.scheduler.has_unfinished and self._in_flight is None and not self._waits_on_others():
            raise RuntimeError("scheduler made no progress: a waiting request cannot fit the KV pool")
        return out

    def _prepare(self, out: SchedulerOutput, rebase: list[bool] | None = None,
                 num_steps: int = 1) -> tuple[StepArrays, StepShape]:
        """Run the state copies the rows need first (handoffs, prefix-cache restores), then build the step's host
        arrays in the shape of its program: a uniform program for a launch of num_steps > 1, else the ragged
        program of its tokens and rows (rebase: see build_step)."""
        t0 = time.perf_counter()
        copies = []
        for row in out.rows:
            self.slot_prefill_len[row.request.slot] = row.request.prefill_len
            copies += self._admitted(row.request)
        if self.samples_outputs:  # the penalties' counts of newly admitted requests' slots
            self.runner.state = seed_admitted(self.runner.state, out.rows, self.seed_size)
        copies += self.prefix_caching.before(out.rows)
        if copies:
            self.runner.state = self.copies.run(self.runner.state, copies)
            self.timings["copies"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        rows = out.rows
        shape = (self.programs.launch(len(rows), num_steps) if num_steps > 1
                 else self.programs.ragged(sum(r.num_tokens for r in rows), len(rows)))
        arrays = build_step(rows, shape, self.ecfg, self.slot_prefill_len, self.block_tables, self.block_q, rebase,
                            self.stop_table)
        penalties, bias = penalty_arrays(rows, shape.rows)
        arrays = arrays.replace(bitmask=launch_bitmask(rows, shape.rows, 1 + self.K, self.cfg.vocab_size),
                                penalties=penalties, logit_bias=bias)
        self.timings["build"] += time.perf_counter() - t0
        return arrays, shape

    def _admitted(self, req: Request) -> list:
        """Called for every row's request as its step is prepared; returns the state copies it needs first (a PD
        decode worker's handoffs)."""
        return []

    def _waits_on_others(self) -> bool:
        """Whether an empty schedule may wait for another engine to free this one's pages or slots (a PD prefill
        worker whose finished prompts wait for their decode worker)."""
        return False

    def _applied(self, req: Request, end: int) -> None:
        """Called for every row's request once its launch's results are applied, end: the position after the row's
        tokens (a PD prefill worker parks finished prompts here)."""

    def _record_inputs(self, req: Request, start: int, ids) -> None:
        if self.record_inputs:
            self.fed_tokens.setdefault(req.request_id, []).extend((start + i, int(t)) for i, t in enumerate(ids))

    # ------------------------------------------------------------------------------------ launches
    def _launch(self, out: SchedulerOutput) -> "InFlight":
        """Dispatch the scheduled rows and book their results before they come back.

        Exact because the sampled tokens and drafts reach the next step on the device (last_sampled,
        draft_tokens), never through the host. A sampling row appends placeholder outputs, filled when its
        launch's results are applied. Without MTP every row advances by its token count whatever it samples.
        With MTP a verify row emits 1..1+K tokens a step, known only on the device: the host books its
        launch as if every draft were accepted (num_computed, placeholders, pages), flags the request's
        next row to start where the device's count says (rebase) while this launch is in flight, and when the
        results come back removes the placeholders left unfilled and takes them off num_computed. A request
        whose token ends it (stop token, length) may already have a row in the next launch: that row's work is
        discarded. A request whose last allowed token is surely in flight is not scheduled again. A launch of
        several steps (Scheduler.launch_steps) books each row's launch_steps."""
        num_steps = self.scheduler.launch_steps(out, 1 if self.draft_override else self.decode_steps_per_launch)
        in_flight = {id(row.request) for row in self._in_flight.out.rows} if self._in_flight else set()
        rebase = [id(row.request) in in_flight for row in out.rows]
        arrays, shape = self._prepare(out, rebase, num_steps)
        pending = self.runner.dispatch(arrays, num_steps, shape.width, launch_sampler(out.rows))
        self.prefix_caching.after(out.rows, [r.request.num_computed for r in out.rows], self.runner.state)
        self.num_steps += num_steps
        self.num_launches += 1
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
                req.awaiting_final_token = self._length_reached(req, req.num_outputs_lower_bound)
        return InFlight(out, pending, starts, out_index, excess)

    def _near_length_limit(self) -> bool:
        """MTP: a running request might be within one launch of verify windows of max_model_len, where the
        scheduler shortens windows by what the host's booking (every draft accepted) says is left."""
        if not self.K:
            return False
        reach = self.decode_steps_per_launch * (1 + self.K) + self.K
        return any(r.num_computed + reach > self.ecfg.max_model_len for r in self.scheduler.running)

    def _apply_in_flight(self, sync: bool = False) -> None:
        previous, self._in_flight = self._in_flight, None
        if previous is not None:
            self._apply(previous, sync)

    def _apply(self, flight: "InFlight", sync: bool = False) -> None:
        """Fill the placeholders of a dispatched launch with its sampled tokens (step by step), count
        acceptance, finish requests; with MTP, drop the placeholders a verify row left unfilled and take
        them off num_computed. sync (synchronous scheduling, no later launch booked): the drafts come to the
        host too, through the draft_override test hook where one is set."""
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
                self._record_inputs(req, start, res.input_ids[tokens_in])
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
                    self._finish_if_done(req, int(token), now, num_outputs=i + emitted, last_of_step=k == n - 1,
                                         last_of_launch=last)
                    if req.status is RequestStatus.FINISHED:
                        break
                if req.status is RequestStatus.FINISHED:
                    del req.output_token_ids[i + emitted :]  # placeholders of steps after this token
                    break
            if req.status is RequestStatus.FINISHED:
                continue
            self._applied(req, start)
            if row.samples:
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
        self.timings["update"] += time.perf_counter() - now

    def _finish_if_done(self, req: Request, token: int, now: float, num_outputs: int | None = None,
                        last_of_step: bool = False, last_of_launch: bool = False) -> None:
        """Bookkeeping for a request's output token number num_outputs (default: its last one): first token time,
        finishing on a stop token, max_tokens or max_model_len. last_of_step / last_of_launch: the device fed the
        request nothing after this token in its step / its launch (then the prefix cache may keep its state)."""
        num_outputs = len(req.output_token_ids) if num_outputs is None else num_outputs
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        sp = req.sampling_params
        if req.error is not None:
            reason = "error"
        elif ((not sp.ignore_eos and token in self.cfg.eos_token_ids) or token in sp.stop_token_ids
              or (req.host_masks is not None and req.host_masks.is_terminated())):
            reason = "stop"
        elif self._length_reached(req, num_outputs):
            reason = "length"
        else:
            return
        device_stopped = last_of_step and reason == "stop" and token in req.device_stops  # later rows: null slot
        if last_of_launch or device_stopped:
            flight = None if device_stopped else self._in_flight  # a stopped slot's later rows change nothing
            later = [r for r in flight.out.rows if r.request is req] if flight else []
            self.prefix_caching.request_finished(req, num_outputs, later, self.runner.state)
        self.scheduler.finish(req, reason)

    def _length_reached(self, req: Request, num_outputs: int) -> bool:
        """Whether output number num_outputs is the request's last: max_tokens or max_model_len."""
        return (num_outputs >= req.sampling_params.max_tokens
                or len(req.prompt_token_ids) + num_outputs >= self.ecfg.max_model_len)

    def run_until_done(self, on_step: Callable[[], None] | None = None) -> None:
        while self.has_unfinished:
            self.step()
            if on_step:
                on_step()
        self.flush()  # async: a last step of requests that had all finished

    # ------------------------------------------------------------------------------------ outputs
    def output(self, rid: int) -> RequestOutput:
        return self.requests[rid].output(self.decode)

    def outputs(self, rids: Iterable[int]) -> list[RequestOutput]:
        return [self.output(r) for r in rids]
