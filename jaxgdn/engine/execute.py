"""Executing a scheduled launch (vLLM's execute_model, host side): the state copies its rows need
first, its host arrays in the shape of its program, and the dispatch. Owns the persistent per-slot host arrays
(block tables, stop tokens, prefill lengths)."""

from __future__ import annotations

import time

import numpy as np

from .cache_manager import CacheManager
from .config import EngineConfig
from .host_masks import launch_bitmask
from .logprobs import launch_sampler
from .penalties import penalty_arrays, seed_admitted
from .programs import ProgramSet, StepShape
from .runner import ModelRunner, PendingStep
from .scheduler import ScheduledRow
from .step_layout import BlockTables, StepArrays, StopTable, build_step


class Executor:
    """Runs launches on `runner` (whose EngineState they update) with the cache manager's copy programs.
    seed_size: the penalties' seeding length (penalties.seed_size), 0 for an engine that samples nothing."""

    def __init__(self, ecfg: EngineConfig, programs: ProgramSet, block_q: int, eos_token_ids, vocab_size: int,
                 runner: ModelRunner, cache: CacheManager, seed_size: int):
        self.ecfg, self.programs, self.block_q, self.vocab_size = ecfg, programs, block_q, vocab_size
        self.runner, self.cache, self.seed_size = runner, cache, seed_size
        self.block_tables = BlockTables(ecfg.num_slots, ecfg.max_pages_per_seq)
        self.stop_table = StopTable(ecfg.num_slots, eos_token_ids)
        self.slot_prefill_len = np.zeros(ecfg.num_slots, np.int32)
        self.admission = [None] * ecfg.num_slots  # per slot: (request id, preemptions) of the request it last ran

    def first_rows(self, rows: list[ScheduledRow]) -> list[bool]:
        """Per row, whether it is its request's first since the request was admitted to its slot (then the slot's
        host rows and the penalties' counts start afresh)."""
        first = []
        for row in rows:
            req = row.request
            key = (req.request_id, req.metrics.num_preemptions)
            first.append(self.admission[req.slot] != key)
            self.admission[req.slot] = key
        return first

    def execute(self, rows: list[ScheduledRow], num_steps: int, rebase: list[bool], copies: list) -> PendingStep:
        """Run `copies` (a PD worker's handoffs), the penalties' seeding of newly admitted slots and the prefix
        cache's restores, then dispatch the launch of rows (num_steps model steps; rebase: see build_step)."""
        t0 = time.perf_counter()
        timings = self.runner.timings
        first = self.first_rows(rows)
        if self.seed_size:
            self.runner.state = seed_admitted(self.runner.state, rows, first, self.seed_size)
        copies = copies + self.cache.before(rows)
        if copies:
            self.runner.state = self.cache.copies.run(self.runner.state, copies)
            timings["copies"] += time.perf_counter() - t0
        arrays, shape = self.build(rows, num_steps, rebase, first)
        return self.runner.dispatch(arrays, num_steps, shape.width, launch_sampler(rows))

    def build(self, rows: list[ScheduledRow], num_steps: int = 1, rebase: list[bool] | None = None,
              first: list[bool] | None = None) -> tuple[StepArrays, StepShape]:
        """The step's host arrays in the shape of its program: a uniform program for a launch of num_steps > 1, else
        the ragged program of its tokens and rows (rebase, first: see build_step)."""
        t0 = time.perf_counter()
        for row in rows:
            self.slot_prefill_len[row.request.slot] = row.request.prefill_len
        shape = (self.programs.launch(len(rows), num_steps) if num_steps > 1
                 else self.programs.ragged(sum(r.num_tokens for r in rows), len(rows)))
        arrays = build_step(rows, shape, self.ecfg, self.slot_prefill_len, self.block_tables, self.block_q, rebase,
                            self.stop_table, first)
        penalties, bias = penalty_arrays(rows, shape.rows)
        K = self.ecfg.num_speculative_tokens
        arrays = arrays.replace(bitmask=launch_bitmask(rows, shape.rows, 1 + K, self.vocab_size),
                                penalties=penalties, logit_bias=bias)
        self.runner.timings["build"] += time.perf_counter() - t0
        return arrays, shape
