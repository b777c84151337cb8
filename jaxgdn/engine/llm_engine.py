"""LLMEngine: requests in, steps, outputs out. `LLM` (llm.py) is the batch facade over it.

A launch is schedule (scheduler.py) -> execute (execute.py: state copies, host arrays, dispatch) -> book, and later
apply its results (update.py). A PD worker is an engine with another Role (role.py, workers.py).

Bad requests (empty prompt, ids outside the vocabulary, too long for max_model_len, bad sampling
parameters) are finished at once with finish_reason "error" and a message; the other requests run on.
"""

from __future__ import annotations

import collections
import itertools
import time
from typing import Callable, Iterable

import jax

from pallas_kernels.ragged_attention import block_queries

from ..model.config import ModelConfig
from ..model.params import ModelParams, serving_layout
from ..model.policy import KernelPolicy
from .cache_manager import CacheManager
from .config import EngineConfig
from .core import EngineCore
from .execute import Executor
from .host_masks import attach_host_masks
from .memory import device_memory, plan_memory
from .penalties import seed, seed_size
from .placement import Placement
from .program_keys import program_keys, step_peak
from .programs import ProgramSet
from .request import Request, RequestMetrics, RequestOutput, RequestStatus, SamplingParams, \
    validate_request
from .role import Role
from .runner import ModelRunner, enable_compilation_cache
from .scheduler import Scheduler, SchedulerOutput
from .state import init_engine_state
from .structured import Grammars
from .tensor_parallel import local_config
from .update import Update


class LLMEngine:
    """device: the JAX device of the engine's weights and state (None: JAX's default). mesh: with
    ecfg.tensor_parallel_size N > 1, the 1-D mesh of N devices (axis "tp") the weights and pools are split over
    (None: the first N devices). memory_share: the part of the memory budget left on the device this engine
    takes (a PD prefill worker beside its decode worker); memory_reserved: bytes other engines on the device
    need beyond what they hold now (the decode worker plans around its prefill worker's step temporaries).
    policy: the kernel policy (default `ecfg.kernel_policy` for the device's platform). garbage_seed: fill every
    state buffer with garbage (slot-hygiene tests). role: what the engine serves (default: whole requests;
    workers.py has the PD roles)."""

    def __init__(self, params: ModelParams, cfg: ModelConfig, ecfg: EngineConfig, *,
                 garbage_seed: int | None = None, decode: Callable[[list[int]], str] | None = None, device=None,
                 memory_share: float = 1.0, memory_reserved: int = 0, policy: KernelPolicy | None = None, mesh=None,
                 role: Role | None = None):
        self.cfg, self.ecfg = cfg, ecfg
        self.role = role or Role()
        self.role.attach(self)
        self.K = K = ecfg.num_speculative_tokens
        if K and params.mtp is None:
            raise ValueError("num_speculative_tokens > 0 needs a checkpoint with an MTP head (mtp.* tensors)")
        with_mtp = params.mtp is not None and K > 0
        if ecfg.compilation_cache:
            enable_compilation_cache()
        # a copy of the weights unless the caller passed them in this layout (LLM does)
        params = serving_layout(params, ecfg.fold_norms)
        self.step_cfg = local_config(cfg, ecfg.tensor_parallel_size)  # what one shard's step sees (cfg on one device)
        self.placement = Placement.of(ecfg.tensor_parallel_size, device, mesh)
        params = self.placement.put_params(params, cfg)
        self.mesh, self.device = self.placement.mesh, self.placement.device
        self.decode_steps_per_launch = ecfg.resolved_decode_steps(self.placement.platform)
        self.programs = ProgramSet(ecfg, self.decode_steps_per_launch)
        self.seed_size = seed_size(ecfg.max_model_len)
        self.block_q = block_queries(self.step_cfg.num_attention_heads, self.step_cfg.num_key_value_heads)
        self.policy = policy or ecfg.kernel_policy(self.placement.platform)
        self.runner = ModelRunner(params, cfg, None, policy=self.policy, reproduce_pd_mtp_bug=ecfg.reproduce_pd_mtp_bug,
                                  device=None if self.mesh else self.device, rebases=ecfg.uses_async_scheduling and K > 0,
                                  mesh=self.mesh)
        new_state = lambda pages, garbage=None: init_engine_state(  # noqa: E731
            cfg, ecfg, pages, num_speculative_tokens=K, with_mtp=with_mtp, garbage_seed=garbage)
        caching = ecfg.enable_prefix_caching and self.role.caches_prefixes
        # a shard's pools are its heads' share: the per-device plan is the local config's
        peak = lambda pages: step_peak(self.runner, self.programs, ecfg, self.block_q,  # noqa: E731
                                       self.placement.abstract_state(lambda: new_state(pages)))
        self.memory = plan_memory(self.step_cfg, ecfg, with_mtp, device_memory(self.device), peak, memory_share,
                                  memory_reserved, snapshots=caching, copy_peak=self.role.copy_peak(with_mtp),
                                  staged=self.role.staged(with_mtp)).check(ecfg)
        self.role.planned()
        num_pages, num_snapshots = self.memory.num_kv_pages, self.memory.num_snapshots
        self.runner.state = self.placement.make_state(lambda: new_state(num_pages, garbage_seed),
                                                      host_drawn=garbage_seed is not None)
        self.cache = CacheManager(cfg, ecfg, num_pages, num_snapshots, caching=caching, lookahead=int(with_mtp),
                                  placement=self.placement, buffer_sharding=self.runner.buffer_sharding)
        self.prefix, self.copies = self.cache.prefix, self.cache.copies
        self.scheduler = Scheduler(ecfg, num_pages, self.prefix, self.cache.slots)
        self.executor = Executor(ecfg, self.programs, self.block_q, cfg.eos_token_ids, cfg.vocab_size, self.runner,
                                 self.cache, self.seed_size if self.role.samples_outputs else 0)
        self.update = Update(K, cfg.eos_token_ids, ecfg.max_model_len, self.scheduler, self.runner, self.cache)
        self.requests: dict[int, Request] = {}
        self._ids = itertools.count()
        self.decode = decode
        self.grammars: Grammars | None = None  # structured output's compiler (LLM sets it from the tokenizer)
        self.async_scheduling = ecfg.uses_async_scheduling
        self.core = EngineCore(self.scheduler, self.executor, self.update, self.role, self.decode_steps_per_launch,
                               self.async_scheduling)

    # ------------------------------------------------------------------------------------ programs
    def program_keys(self, sampled: bool = True) -> list[tuple]:
        """The runner's keys of every program this engine may run (program_keys.program_keys)."""
        return program_keys(self.programs, self.ecfg, self.block_q, sampled)

    def precompile(self, on_compiled: Callable[[], None] | None = None, sampled: bool = True) -> int:
        """Compile every program now (see program_keys), the penalties' seeding and the state copy programs this
        engine runs (copy_programs); later compiles count as compiles after start-up (`compiles_after_startup`).
        Returns the number of step programs compiled."""
        before = self.runner.num_compiles
        self.runner.precompile(self.program_keys(sampled), on_compiled)
        if self.role.samples_outputs:
            self.runner.state = seed(self.runner.state, 0, [], [], self.seed_size)
        self.copies.precompile(self.runner.state, self.copy_programs(), self.role.transfer_source(), on_compiled)
        self.runner.started = self.copies.started = True
        return self.runner.num_compiles - before

    def copy_programs(self) -> list[tuple[str, int]]:
        """(name, page bucket) of the state copy programs this engine runs (state_copies.py)."""
        return self.copies.program_names(self.cache.snapshots, *self.role.handoff_programs())

    @property
    def compiles_after_startup(self) -> int:
        """Step and state copy programs compiled after precompile (0 when every launch ran a start-up program)."""
        return self.runner.compiles_after_startup + self.copies.compiles_after_startup

    # ------------------------------------------------------------------------------------ requests
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    error: str | None = None, **fields) -> int:
        """Queue a request; returns its id. Invalid input (or a caller's `error`) finishes it at once
        with finish_reason "error". fields: more of the Request's own fields (a PD worker's request)."""
        params = params or SamplingParams()
        rid = next(self._ids)
        req = Request(rid, list(prompt_token_ids), params, RequestMetrics(arrival_time=time.perf_counter()), **fields)
        self.requests[rid] = req
        error = error or self.validate(req.prompt_token_ids, params) or (
            self.role.samples_outputs and attach_host_masks(req, self.grammars, self.cfg.eos_token_ids)) or None
        if error:
            req.error, req.status, req.finish_reason = error, RequestStatus.FINISHED, "error"
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
        self.role.aborted(rid)
        req = self.requests.get(rid)
        if req is None or req.status is RequestStatus.FINISHED:
            return
        self.scheduler.finish(req, "abort")

    def forget(self, rid: int) -> None:
        """Drop a finished request's record (a server's engine runs for ever; LLM.generate keeps them)."""
        req = self.requests.get(rid)
        if req is not None and req.status is RequestStatus.FINISHED:
            del self.requests[rid]
            self.update.fed_tokens.pop(rid, None)

    def close(self) -> None:
        """Free the engine's compiled programs and device buffers (requests still running are dropped); the
        engine cannot step afterwards."""
        if self.core.in_flight is not None:
            jax.block_until_ready(self.core.in_flight.pending.flats)
            self.core.in_flight = None
        self.runner.close()
        self.copies.close()
        self.core.closed = True

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (pages held by running requests stay theirs)."""
        self.prefix.reset()

    def usage(self) -> dict:
        """Requests, KV pages and request slots in use and in all (Scheduler.usage)."""
        return self.scheduler.usage()

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # ------------------------------------------------------------------------------------ stepping
    @property
    def timings(self) -> "collections.Counter[str]":
        """Seconds per phase of step(), summed: schedule, copies, build (host arrays), transfer (to the device),
        dispatch, wait (device work + results back), update (requests, outputs)."""
        return self.runner.timings

    def step(self) -> SchedulerOutput:
        """Schedule and launch one step (EngineCore.step); returns what was scheduled."""
        return self.core.step()

    def launch(self) -> SchedulerOutput:
        """The first half of step() (EngineCore.launch)."""
        return self.core.launch()

    def finish(self) -> None:
        """The second half of step() (EngineCore.finish)."""
        self.core.finish()

    def flush(self) -> None:
        """Apply the launch in flight, if any (async scheduling; run when no request is left to step)."""
        self.core.flush()

    def run_until_done(self, on_step: Callable[[], None] | None = None) -> None:
        self.core.run_until_done(on_step)

    @property
    def num_steps(self) -> int:
        return self.core.num_steps

    @property
    def num_launches(self) -> int:
        return self.core.num_launches

    # ------------------------------------------------------------------------------------ outputs
    def output(self, rid: int) -> RequestOutput:
        return self.requests[rid].output(self.decode)

    def outputs(self, rids: Iterable[int]) -> list[RequestOutput]:
        return [self.output(r) for r in rids]
