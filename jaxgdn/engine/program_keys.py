"""The keys of the programs an engine compiles at start-up (runner.py's cache keys)."""

from __future__ import annotations

from .config import EngineConfig
from .logprobs import Sampler
from .programs import ProgramSet, StepShape
from .split_step import SAMPLER_VARIANTS
from .step_layout import program_layout


def program_keys(programs: ProgramSet, ecfg: EngineConfig, block_q: int, sampled: bool = True) -> list[tuple]:
    """The runner's keys of every program an engine may run: each shape of `programs`, greedy and (sampled) with
    temperature rows, and (sampled) the scores of their tokens; for every ragged shape the split launch's programs
    (split_step.py) that serve the other sampling features."""
    samplers = [Sampler.GREEDY] + [Sampler.SAMPLE] * sampled
    shapes = programs.all_shapes()
    keys = [(program_layout(shape, ecfg, block_q), int(sampler), shape.num_steps, shape.width)
            for shape in shapes for sampler in samplers]
    ragged = [shape for shape in shapes if not shape.width]
    keys += [(part, program_layout(shape, ecfg, block_q)) for shape in ragged for part in ("forward", "stream", "commit")]
    variants = SAMPLER_VARIANTS if sampled else (int(Sampler.GREEDY),)
    keys += [("sample", rows, v) for rows in dict.fromkeys(s.rows for s in ragged) for v in variants]
    return keys + list(dict.fromkeys(("score", s.num_steps, s.rows) for s in shapes)) * sampled


def step_peak(runner, programs: ProgramSet, ecfg: EngineConfig, block_q: int, state) -> int:
    """Bytes of the temporaries of the programs with the largest ones, compiled by runner on `state` (abstract: only
    its shapes matter): the largest ragged program (sampled), and a split launch's sample program of as many rows
    with every feature (penalties hold [rows, 1+K, V] counts)."""
    tokens = programs.token_buckets[-1]
    shape = StepShape(tokens, programs.rows_for(tokens))
    keys = [(program_layout(shape, ecfg, block_q), int(Sampler.SAMPLE), 1, 0), ("sample", shape.rows, max(SAMPLER_VARIANTS))]
    return max(int(runner.compile_on(key, state).memory_analysis().temp_size_in_bytes) for key in keys)
