"""`LLM`: the public batch API, like vLLM's: LLM(model=...).generate(prompts, SamplingParams(...))."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
from tqdm import tqdm

from .engine.compile_times import CompileTimes, startup_line
from .engine.config import EngineConfig
from .engine.llm_engine import LLMEngine
from .engine.request import RequestOutput, SamplingParams
from .engine.structured import Grammars
from .engine.tensor_parallel import make_mesh
from .engine.workers import STAGED_HANDOFFS, DecodeRole, decode_engine, prefill_engine, run_disaggregated
from .model.checkpoint import load_checkpoint
from .model.config import PRESETS, ModelConfig
from .model.params import ModelParams, init_random_params, serving_layout
from .model.tokenizer import Tokenizer, load_tokenizer

Prompt = str | Sequence[int]
ROLES = ("both", "prefill", "decode")
logger = logging.getLogger("jaxgdn")


def load_model(model: str | Path, config: EngineConfig) -> tuple[ModelConfig, ModelParams, Tokenizer | None]:
    """(model config, weights in the serving layout, tokenizer or None) of a checkpoint directory or a preset
    name (random weights, no tokenizer)."""
    dtype = jnp.dtype(config.dtype)
    if str(model) in PRESETS:
        cfg = PRESETS[str(model)]()
        params, tokenizer = init_random_params(cfg, seed=0, dtype=dtype, on_device=True), None
    else:
        (cfg, params), tokenizer = load_checkpoint(model, dtype=dtype), load_tokenizer(model)
    # one serving copy for both PD workers; the loaded layout is dropped. One program: eagerly, each op of
    # each new shape compiles apart.
    return cfg, jax.jit(serving_layout, static_argnums=1)(params, config.fold_norms), tokenizer


class LLM:
    """model: a checkpoint directory, or a preset name (random weights, for benchmarks) such as
    "qwen3.5-0.8b". config: EngineConfig (pd=True serves through a prefill engine and a decode engine, workers.py).
    handoff_transport "bytes" sends every
    PD handoff through to_bytes()/from_bytes() as a process boundary would. role "prefill" or "decode" builds
    one side of a PD pair only, for a server process (`jaxgdn.serve`); generate() needs role "both"."""

    def __init__(self, model: str | Path, config: EngineConfig | None = None, *, garbage_seed: int | None = None, handoff_transport: str = "object", role: str = "both"):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.config = config or EngineConfig()
        if role != "both" and not self.config.pd:
            self.config = self.config.replace(pd=True)  # one side of a PD pair
        self.role = role
        t0 = time.perf_counter()
        self.model_config, params, self.tokenizer = load_model(model, self.config)
        self.startup = {"weights_s": time.perf_counter() - t0}  # seconds per start-up phase (log_startup)
        t1 = time.perf_counter()
        plan_times = CompileTimes().__enter__()  # the plans compile each engine's largest program once
        if self.config.tensor_parallel_size > 1:  # each worker places its shards; no whole copy stays on a device
            params = jax.device_get(params)
        decode = self.tokenizer.decode if self.tokenizer else None
        self.handoff_transport = handoff_transport
        devices = jax.devices()
        tp = self.config.tensor_parallel_size
        pick = lambda i: devices[i % len(devices)] if i is not None else None  # noqa: E731
        # with tensor parallelism a worker's mesh is tp consecutive devices from its index
        place = lambda i: ({"mesh": make_mesh(devices[i or 0:], tp)} if tp > 1 else {"device": pick(i)})  # noqa: E731
        self.prefill_worker = self.engine = None
        if self.config.pd and role != "decode":
            # on the devices of its decode worker the prefill worker plans half of the memory left
            same = (self.config.prefill_device or 0) == (self.config.decode_device or 0) if tp > 1 else (
                pick(self.config.prefill_device) == pick(self.config.decode_device))
            share = 0.5 if role == "both" and same else 1.0
            self.prefill_worker = prefill_engine(params, self.model_config, self.config,
                                                 garbage_seed=garbage_seed, memory_share=share,
                                                 **place(self.config.prefill_device))
        if self.config.pd and role != "prefill":
            # both workers on one device: the decode worker's plan leaves room for the prefill step's temporaries
            reserved = self.prefill_worker.memory.step_peak if self.prefill_worker is not None and same else 0
            self.engine = decode_engine(params, self.model_config, self.config,
                                        garbage_seed=None if garbage_seed is None else garbage_seed + 1,
                                        decode=decode, memory_reserved=reserved, **place(self.config.decode_device),
                                        staged_handoffs=STAGED_HANDOFFS if role == "decode" else 0)
        elif not self.config.pd:
            self.engine = LLMEngine(params, self.model_config, self.config,
                                    garbage_seed=garbage_seed, decode=decode)
        if self.engine is not None and isinstance(self.engine.role, DecodeRole):
            self.engine.role.connect(self.prefill_worker, handoff_transport)
        plan_times.__exit__()
        if self.tokenizer is not None:  # structured output's grammars over the tokenizer's vocabulary
            grammars = Grammars(self.tokenizer, self.model_config.vocab_size, self.model_config.eos_token_ids)
            for e in self.engines:
                e.grammars = grammars
        self.startup |= {"plan_s": time.perf_counter() - t1, "plan": plan_times.summary()}
        for e in self.engines:
            logger.info(e.memory.describe(self.config))
        if self.config.precompile:
            self.precompile()
        self.startup["total_s"] = time.perf_counter() - t0
        logger.info(startup_line(self.startup))

    @property
    def engines(self) -> list[LLMEngine]:
        return [e for e in (self.prefill_worker, self.engine) if e is not None]

    def close(self) -> None:
        """Free the engines' compiled programs and device buffers (weights, pools): a process may then build
        LLMs of other configurations without growing. generate() fails afterwards."""
        for e in self.engines:
            e.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def precompile(self, use_tqdm: bool = True) -> int:
        """Compile every step and state copy program of the engine(s) now, with a progress bar and a log line;
        returns how many step programs were compiled. (A PD prefill worker's steps never sample: its greedy and
        prompt-scoring programs only.)"""
        t0 = time.perf_counter()
        roles = {id(e): dict(sampled=e is not self.prefill_worker) for e in self.engines}  # a prefill worker samples nothing
        total = sum(len(e.program_keys(**roles[id(e)])) + len(e.copy_programs()) for e in self.engines)
        with tqdm(total=total, desc="compile", unit="program", disable=not use_tqdm) as bar, CompileTimes() as times:
            compiled = sum(e.precompile(bar.update, **roles[id(e)]) for e in self.engines)
        copies = sum(len(e.copy_programs()) for e in self.engines)
        self.startup |= {"precompile_s": time.perf_counter() - t0, "programs": compiled, "copy_programs": copies,
                         "precompile": times.summary()}
        return compiled

    @property
    def compiles_after_startup(self) -> int:
        """Step programs compiled after start-up's precompile (0: no request ever waited on the compiler)."""
        return sum(e.compiles_after_startup for e in self.engines)

    def _encode(self, prompt: Prompt) -> list[int] | str:
        """Token ids, or an error message for a text prompt without a tokenizer."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                return "text prompt given but the checkpoint has no tokenizer; pass token ids"
            return list(self.tokenizer.encode(prompt))
        return [int(t) for t in prompt]

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order. A bad prompt gets finish_reason
        "error" and a message in `.error`; the others are unaffected."""
        if self.role != "both":
            raise ValueError(f"LLM(role={self.role!r}) is one side of a PD pair; generate() needs role 'both'")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # a single prompt
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        params = [sp or SamplingParams() for sp in params]
        encoded = [self._encode(p) for p in prompts]
        bar = tqdm(total=len(prompts), desc="generate", unit="req", disable=not use_tqdm)
        rids: list[int] = []
        done = 0

        def progress():
            nonlocal done
            now = sum(1 for r in rids if r is not None and self.engine.requests[r].finish_reason is not None)
            bar.update(now - done)
            done = now

        errors = {i: e for i, e in enumerate(encoded) if isinstance(e, str)}
        if self.prefill_worker is not None:
            ok = [i for i in range(len(prompts)) if i not in errors]
            served = run_disaggregated(self.prefill_worker, self.engine, [encoded[i] for i in ok],
                                       [params[i] for i in ok], self.handoff_transport == "bytes", progress)
            by_index = dict(zip(ok, served))
            for i, e in errors.items():
                by_index[i] = self.engine.add_request([], params[i], error=e)
            rids = [by_index[i] for i in range(len(prompts))]
        else:
            for i, (ids, sp) in enumerate(zip(encoded, params)):
                rids.append(self.engine.add_request([], sp, error=ids) if i in errors else self.engine.add_request(ids, sp))
            self.engine.run_until_done(progress)
        progress()
        bar.close()
        return self.engine.outputs(rids)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's name); the next requests compute theirs again. Returns True."""
        for engine in self.engines:
            engine.reset_prefix_cache()
        return True

    def metrics(self) -> dict:
        """Speculative decoding counters, PD handoff bytes, model steps and device launches of everything
        served so far (a launch may run several decode steps: decode_steps_per_launch), and the prefix cache's
        prompt tokens looked up and found (hit rate: found / looked up)."""
        m = self.engine.update.spec_counters.metrics()
        m["handoff_bytes"] = getattr(self.engine.role, "handoff_bytes_in", 0)  # a PD decode worker's
        m["num_steps"] = self.engine.num_steps
        m["num_launches"] = self.engine.num_launches
        stats = (self.prefill_worker or self.engine).prefix.stats  # a PD prefill worker's cache
        m["prefix_cache_queries"], m["prefix_cache_hits"] = stats.queries, stats.hits
        m["prefix_cache_hit_rate"] = stats.hit_rate
        return m
