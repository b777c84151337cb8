"""`LLM`: the public batch API, like vLLM's: LLM(model=...).generate(prompts, SamplingParams(...))."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import jax.numpy as jnp
from tqdm import tqdm

from .checkpoint import load_checkpoint
from .config import PRESETS
from .engine import LLMEngine
from .engine_config import EngineConfig
from .params import init_random_params
from .request import RequestOutput, SamplingParams
from .tokenizer import load_tokenizer

Prompt = str | Sequence[int]


class LLM:
    """model: a checkpoint directory, or a preset name (random weights, for benchmarks) such as
    "qwen3.5-0.8b". config: EngineConfig. input_impl: input-assembly kernel ("xla", "pallas", "triton")."""

    def __init__(self, model: str | Path, config: EngineConfig | None = None, *, input_impl: str = "xla",
                 garbage_seed: int | None = None):
        self.config = config or EngineConfig()
        dtype = jnp.dtype(self.config.dtype)
        if str(model) in PRESETS:
            self.model_config = PRESETS[str(model)]()
            params = init_random_params(self.model_config, seed=0, dtype=dtype)
            self.tokenizer = None
        else:
            self.model_config, params = load_checkpoint(model, dtype=dtype)
            self.tokenizer = load_tokenizer(model)
        decode = self.tokenizer.decode if self.tokenizer else None
        self.engine = LLMEngine(params, self.model_config, self.config, input_impl=input_impl,
                                garbage_seed=garbage_seed, decode=decode)

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
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # a single prompt
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        rids = []
        for prompt, sp in zip(prompts, params):
            ids = self._encode(prompt)
            if isinstance(ids, str):
                rids.append(self.engine.add_request([], sp, error=ids))
            else:
                rids.append(self.engine.add_request(ids, sp))
        bar = tqdm(total=len(rids), desc="generate", unit="req", disable=not use_tqdm)
        done = 0

        def progress():
            nonlocal done
            now = sum(1 for r in rids if self.engine.requests[r].finish_reason is not None)
            bar.update(now - done)
            done = now

        self.engine.run_until_done(progress)
        bar.close()
        return self.engine.outputs(rids)
