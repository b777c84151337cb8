"""LLMEngine: requests in, steps, outputs out. `LLM` (llm.py) is the batch facade over it.

Bad requests (empty prompt, ids outside the vocabulary, too long for max_model_len, bad sampling
parameters) are finished at once with finish_reason "error" and a message; the other requests run on.
"""

from __future__ import annotations

import itertools
import time
from typing import Callable, Iterable

import numpy as np

from .cache import init_engine_state, resolve_num_kv_pages
from .config import ModelConfig
from .engine_config import EngineConfig
from .input_batch import build_step
from .params import ModelParams
from .request import Request, RequestMetrics, RequestOutput, RequestStatus, SamplingParams
from .runner import ModelRunner
from .scheduler import Scheduler, SchedulerOutput


class LLMEngine:
    def __init__(self, params: ModelParams, cfg: ModelConfig, ecfg: EngineConfig, *, input_impl: str = "xla",
                 garbage_seed: int | None = None, decode: Callable[[list[int]], str] | None = None):
        self.cfg, self.ecfg = cfg, ecfg
        num_pages = resolve_num_kv_pages(cfg, ecfg, with_mtp=False)
        if num_pages - 1 < ecfg.max_pages_per_seq:
            raise ValueError(
                f"EngineConfig: {num_pages - 1} usable KV pages cannot hold one sequence of max_model_len "
                f"{ecfg.max_model_len} ({ecfg.max_pages_per_seq} pages of {ecfg.kv_page_size})"
            )
        self.scheduler = Scheduler(ecfg, num_pages)
        state = init_engine_state(cfg, ecfg, num_pages, garbage_seed=garbage_seed)
        self.runner = ModelRunner(params, cfg, state, gdn_impl=ecfg.gdn_impl, input_impl=input_impl)
        self.slot_prefill_len = np.zeros(ecfg.num_slots, np.int32)
        self.requests: dict[int, Request] = {}
        self._ids = itertools.count()
        self.decode = decode
        self.num_steps = 0
        # Every token fed to the model, per request: (position, token id). Tests check prompt fidelity.
        self.record_inputs = False
        self.fed_tokens: dict[int, list[tuple[int, int]]] = {}

    # ------------------------------------------------------------------------------------ requests
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    error: str | None = None) -> int:
        """Queue a request; returns its id. Invalid input (or a caller's `error`) finishes it at once
        with finish_reason "error"."""
        params = params or SamplingParams()
        rid = next(self._ids)
        req = Request(rid, list(prompt_token_ids), params, RequestMetrics(arrival_time=time.perf_counter()))
        self.requests[rid] = req
        error = error or self._validate(req)
        if error:
            req.error = error
            req.status = RequestStatus.FINISHED
            req.finish_reason = "error"
        else:
            self.scheduler.add(req)
        return rid

    def _validate(self, req: Request) -> str | None:
        ids = req.prompt_token_ids
        if not ids:
            return "empty prompt"
        bad = [t for t in ids if not (isinstance(t, (int, np.integer)) and 0 <= t < self.cfg.vocab_size)]
        if bad:
            return f"token id(s) outside the vocabulary [0, {self.cfg.vocab_size}): {bad[:5]}"
        if len(ids) >= self.ecfg.max_model_len:
            return f"prompt of {len(ids)} tokens leaves no room under max_model_len {self.ecfg.max_model_len}"
        try:
            req.sampling_params.validate()
        except ValueError as e:
            return str(e)
        return None

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # ------------------------------------------------------------------------------------ stepping
    def step(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        if not out.rows:
            if self.scheduler.has_unfinished:
                raise RuntimeError("scheduler made no progress: a waiting request cannot fit the KV pool")
            return out
        for row in out.rows:
            self.slot_prefill_len[row.request.slot] = row.request.prefill_len
        arrays = build_step(out.rows, self.ecfg, self.slot_prefill_len)
        row_tokens, ids = self.runner.run(arrays)
        self.num_steps += 1
        now = time.perf_counter()
        t = 0
        for b, row in enumerate(out.rows):
            req = row.request
            if self.record_inputs:
                fed = self.fed_tokens.setdefault(req.request_id, [])
                fed += [(req.num_computed + i, int(ids[t + i])) for i in range(row.num_tokens)]
            t += row.num_tokens
            req.num_computed += row.num_tokens
            if row.samples:
                self._append_token(req, int(row_tokens[b]), now)
        return out

    def _append_token(self, req: Request, token: int, now: float) -> None:
        req.output_token_ids.append(token)
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        sp = req.sampling_params
        if (not sp.ignore_eos and token in self.cfg.eos_token_ids) or token in sp.stop_token_ids:
            self.scheduler.finish(req, "stop")
        elif len(req.output_token_ids) >= sp.max_tokens or req.num_tokens >= self.ecfg.max_model_len:
            self.scheduler.finish(req, "length")

    def run_until_done(self, on_step: Callable[[], None] | None = None) -> None:
        while self.has_unfinished:
            self.step()
            if on_step:
                on_step()

    # ------------------------------------------------------------------------------------ outputs
    def output(self, rid: int) -> RequestOutput:
        req = self.requests[rid]
        text = self.decode(req.output_token_ids) if (self.decode and req.error is None) else None
        return RequestOutput(
            request_id=rid, prompt_token_ids=req.prompt_token_ids, token_ids=list(req.output_token_ids),
            text=text, finish_reason=req.finish_reason, error=req.error, ttft=req.metrics.ttft,
            tpot=req.metrics.tpot(len(req.output_token_ids)), num_preemptions=req.metrics.num_preemptions,
        )

    def outputs(self, rids: Iterable[int]) -> list[RequestOutput]:
        return [self.output(r) for r in rids]
