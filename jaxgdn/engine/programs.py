"""The fixed set of step programs an engine compiles, like vLLM's cudagraph capture sizes.

A ragged program is keyed by its token bucket T and row bucket R only: any mix of prompt chunks, prompt
tails, decode rows and verify windows whose tokens and rows fit runs in it. The token buckets are powers
of two up to max_num_batched_tokens; a bucket's rows are min(T, max_num_seqs) (a row has at least one
token), so T alone picks the program. Launches of several decode or verify steps (decode_steps_per_launch
> 1) run uniform programs: R rows of one width (1, or 1 + K with MTP), keyed by R, a power of two.
"""

from __future__ import annotations

import dataclasses

from .config import EngineConfig

MIN_TOKEN_BUCKET = 16  # the smallest ragged program: decode steps of up to 16 rows


@dataclasses.dataclass(frozen=True, order=True)
class StepShape:
    """A program's step shape: T tokens in R rows; width > 0: a uniform program (every real row has
    `width` tokens, T = R * width) running num_steps model steps a launch."""

    tokens: int
    rows: int
    width: int = 0
    num_steps: int = 1


def _pow2_at_least(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


class ProgramSet:
    """The shapes of an engine's step programs, fixed at construction.

    launch_steps: decode_steps_per_launch resolved for the device (uniform programs exist when > 1);
    width: the rows' width in such launches (1 + num_speculative_tokens)."""

    def __init__(self, ecfg: EngineConfig, launch_steps: int = 1):
        self.ecfg = ecfg
        self.launch_steps = launch_steps
        self.width = 1 + ecfg.num_speculative_tokens
        top = _pow2_at_least(ecfg.max_num_batched_tokens)
        buckets, t = [], min(MIN_TOKEN_BUCKET, top)
        while t <= top:
            buckets.append(t)
            t *= 2
        self.token_buckets = tuple(buckets)
        self.uniform_rows = tuple(1 << i for i in range(_pow2_at_least(ecfg.max_num_seqs).bit_length()))

    def rows_for(self, tokens: int) -> int:
        return min(tokens, self.ecfg.max_num_seqs)

    def ragged(self, num_tokens: int, num_rows: int) -> StepShape:
        """The program of a step of num_tokens tokens in num_rows rows (exact shapes with enforce_eager)."""
        if self.ecfg.enforce_eager:
            return StepShape(max(num_tokens, 1), max(num_rows, 1))
        for t in self.token_buckets:
            if t >= num_tokens and self.rows_for(t) >= num_rows:
                return StepShape(t, self.rows_for(t))
        raise ValueError(f"a step of {num_tokens} tokens in {num_rows} rows exceeds max_num_batched_tokens "
                         f"{self.ecfg.max_num_batched_tokens} / max_num_seqs {self.ecfg.max_num_seqs}")

    def launch(self, num_rows: int, num_steps: int) -> StepShape:
        """The uniform program of a launch of num_steps steps of num_rows rows, each `width` tokens."""
        rows = num_rows if self.ecfg.enforce_eager else _pow2_at_least(num_rows)
        return StepShape(rows * self.width, rows, self.width, num_steps)

    def all_shapes(self) -> list[StepShape]:
        """Every program start-up compiles (none with enforce_eager: exact shapes are not known ahead)."""
        if self.ecfg.enforce_eager:
            return []
        shapes = [StepShape(t, self.rows_for(t)) for t in self.token_buckets]
        if self.launch_steps > 1:
            shapes += [self.launch(r, self.launch_steps) for r in self.uniform_rows]
        return shapes

