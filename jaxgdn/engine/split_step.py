"""The split launch: a step whose rows use a sampling feature runs as small programs after the model's forward.

A launch of plain rows (greedy or temperature / top-k / top-p / seeds) runs one fused step program
(`device_step.packed_step`); where some row asks for logprobs, a score program (`packed_score`) follows it on the
hidden states it leaves. A launch where some row asks for prompt logprobs, penalties, logit bias, a grammar,
min_tokens or bad_words runs, one after the other on the device:
  forward  (per ragged program shape) input assembly and the model; leaves `Forwarded` and `SamplingRows`;
  sample   (per row count R and sampler variant) penalties and masks, sampling, draft verification;
  score    (per R, logprobs only) the sampled tokens' logprobs, as after a fused launch;
  stream   (per ragged shape, prompt logprobs only) the scores of every token's successor;
  commit   (per ragged shape) the per-slot bookkeeping and the MTP drafts.
Each is compiled at start-up, so no sampling parameter compiles a program after it. The sampler's variants are
the combinations of SAMPLE, GUIDED and PENALIZE (neutral for the rows of a launch that have no mask or penalty).
Split launches run one model step on a ragged program (`Scheduler.launch_steps`). XLA's GPU conditional waits on
the host for its predicate, so features stay static variants rather than device-side branches.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ..model.config import ModelConfig
from ..model.params import ModelParams
from ..model.policy import KernelPolicy
from .device_step import SamplingRows, commit_part, first_step_arrays, forward_part, launch_prologue, sample_part, \
    stream_part
from ..model.parallel import head_logits
from .logprobs import Sampler, pack, score
from .penalties import MAX_LOGIT_BIAS
from .state import EngineState
from .step_layout import StepArrays
from .structured import words
from .tensor_parallel import sharded_parts

FEATURES = Sampler.STREAM | Sampler.GUIDED | Sampler.PENALIZE  # what runs split
SAMPLER_FLAGS = Sampler.SAMPLE | Sampler.GUIDED | Sampler.PENALIZE
SAMPLER_VARIANTS = tuple(int(s | g | p) for s in (0, Sampler.SAMPLE) for g in (0, Sampler.GUIDED)
                         for p in (0, Sampler.PENALIZE))


def is_split(sampler: int) -> bool:
    """Whether a launch of this variant (logprobs.Sampler flags) runs split."""
    return bool(sampler & FEATURES)


def sampler_variant(sampler: int) -> int:
    """The sample program a split launch runs (its logprobs come from the score program after it)."""
    return int(sampler & SAMPLER_FLAGS)


@struct.dataclass
class Extras:
    """A sample program's inputs besides the rows: with PENALIZE penalties [R, 3] f32 (presence, frequency,
    repetition) and logit_bias [R, 2, MAX_LOGIT_BIAS] (ids, -1 none; values bit-cast); with GUIDED bitmask
    [R * (1+K), words(V)]."""

    penalties: jax.Array | None = None
    logit_bias: jax.Array | None = None
    bitmask: jax.Array | None = None


def _extras_sizes(R: int, W: int, vocab_size: int, variant: int) -> tuple[int, int, int]:
    penalize, guided = variant & Sampler.PENALIZE, variant & Sampler.GUIDED
    return (R * 3 if penalize else 0, R * 2 * MAX_LOGIT_BIAS if penalize else 0,
            R * W * words(vocab_size) if guided else 0)


def extras_size(R: int, W: int, vocab_size: int, variant: int) -> int:
    return sum(_extras_sizes(R, W, vocab_size, variant))


def pack_extras(arrays: StepArrays, W: int, vocab_size: int, variant: int) -> np.ndarray:
    """A launch's Extras for a sample program of this variant as one int32 buffer (neutral where its arrays have
    none: no penalty, no bias)."""
    R = arrays.idx_mapping.shape[0]
    parts = []
    if variant & Sampler.PENALIZE:
        pen = arrays.penalties if arrays.penalties is not None else np.tile(np.float32([0, 0, 1]), (R, 1))
        bias = arrays.logit_bias
        if bias is None:
            bias = np.zeros((R, 2, MAX_LOGIT_BIAS), np.int32)
            bias[:, 0] = -1
        parts += [np.ascontiguousarray(pen, np.float32).view(np.int32).ravel(), bias.ravel()]
    if variant & Sampler.GUIDED:
        parts.append(arrays.bitmask.ravel())
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


def unpack_extras(buf, R: int, W: int, vocab_size: int, variant: int) -> Extras:
    n_pen, n_bias, _ = _extras_sizes(R, W, vocab_size, variant)
    pen, bias, mask = jnp.split(buf, [n_pen, n_pen + n_bias])
    return Extras(penalties=jax.lax.bitcast_convert_type(pen, jnp.float32).reshape(R, 3) if n_pen else None,
                  logit_bias=bias.reshape(R, 2, MAX_LOGIT_BIAS) if n_bias else None,
                  bitmask=mask.reshape(R * W, words(vocab_size)) if variant & Sampler.GUIDED else None)


def packed_forward(params: ModelParams, state: EngineState, resident, host_input, layout: tuple, *, cfg: ModelConfig,
                   policy: KernelPolicy, reproduce_pd_mtp_bug: bool, rebases: bool = False):
    """(state, arrays, Forwarded, SamplingRows, resident): see device_step.packed_step for the buffers."""
    state, a, shift, resident = launch_prologue(state, resident, host_input, layout, rebases)
    a = first_step_arrays(state, a, shift)
    state, f = forward_part(params, state, a, cfg=cfg, policy=policy, reproduce_pd_mtp_bug=reproduce_pd_mtp_bug)
    return state, a, f, SamplingRows.of(a, f), resident


def packed_sample(params: ModelParams, state: EngineState, rows: SamplingRows, extras, sampler: int, *,
                  cfg: ModelConfig, policy: KernelPolicy):
    """(tokens [R, 1+K], num_sampled [R], and for the score program the rows' hidden states [1, R, 1+K, H] and
    tokens [1, R, 1+K]); extras: pack_extras' buffer of this variant."""
    R, W = rows.keys_at.shape
    unpacked = unpack_extras(extras, R, W, cfg.vocab_size, sampler)
    tokens, num_sampled, _ = sample_part(params, state, rows, unpacked, sampler=sampler, cfg=cfg, policy=policy)
    return tokens, num_sampled, rows.hidden[None], tokens[None]


def packed_score(params: ModelParams, hidden, tokens, *, cfg: ModelConfig, policy: KernelPolicy):
    """The packed scores (logprobs.pack) of a fused launch's sampled tokens, step after step: hidden
    [num_steps, R, 1+K, H] and tokens [num_steps, R, 1+K] as packed_step leaves them (one step's logits at a time)."""
    n, R, W, H = hidden.shape

    def one(step):
        h, t = step
        logits = head_logits(params, h.reshape(R * W, H), cfg.vocab_size, policy).astype(jnp.float32)
        return pack(score(logits, t.reshape(-1)))

    return jax.lax.map(one, (hidden, tokens)).reshape(-1)


def packed_stream(params: ModelParams, a: StepArrays, f, *, cfg: ModelConfig, policy: KernelPolicy):
    return stream_part(params, f, a, cfg=cfg, policy=policy)


def packed_commit(params: ModelParams, state: EngineState, a: StepArrays, f, tokens, num_sampled, *, cfg: ModelConfig,
                  policy: KernelPolicy):
    """(state, [R*(1+K) tokens | R num_sampled | R*K drafts | T ids] int32), packed_step's layout without scores.
    Outputs are counted for every row (a penalized request's launches all run split)."""
    state, drafts, num_sampled = commit_part(params, state, a, f, tokens, num_sampled, cfg=cfg, policy=policy,
                                             count_outputs=True)
    flat = jnp.concatenate([tokens.ravel(), num_sampled.ravel(), drafts.ravel(), f.ids.ravel()])
    return state, flat.astype(jnp.int32)


def rows_shapes(R: int, K: int, cfg: ModelConfig, hidden_dtype, sharding=None) -> SamplingRows:
    """SamplingRows of R rows as ShapeDtypeStructs (what a sample program is compiled on)."""
    W = 1 + K
    s = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
    i32, f32, u32 = jnp.int32, jnp.float32, jnp.uint32
    return SamplingRows(hidden=s((R, W, cfg.hidden_size), hidden_dtype), drafts=s((R, K), i32), n_draft=s((R,), i32),
                        idx=s((R,), i32), temperature=s((R,), f32), top_k=s((R,), i32), top_p=s((R,), f32),
                        keys_at=s((R, W), i32), seeds=s((R,), u32), request_ids=s((R,), u32))


class SplitPrograms(NamedTuple):
    """The jitted functions of a split launch for one set of static settings."""

    forward: Any  # (params, state, resident, host_input, layout) -> (state, arrays, Forwarded, SamplingRows, resident)
    sample: Any  # (params, state, rows, extras, variant) -> (tokens, num_sampled, hidden, tokens)
    stream: Any  # (params, arrays, Forwarded) -> scores
    score: Any  # (params, hidden, tokens) -> scores of a fused launch
    commit: Any  # (params, state, arrays, Forwarded, tokens, num_sampled) -> (state, flat)


def make_split_programs(cfg: ModelConfig, policy: KernelPolicy, reproduce_pd_mtp_bug: bool, rebases: bool,
                        compiler_options, mesh) -> SplitPrograms:
    """The split launch's jitted functions; with mesh (tensor parallelism) each runs per shard (cfg and policy
    are the shard's)."""
    model = dict(cfg=cfg, policy=policy)

    def wrap(fn, kinds, out_kinds):
        return sharded_parts(fn, mesh, kinds, out_kinds) if mesh is not None else fn

    forward = functools.partial(packed_forward, **model, reproduce_pd_mtp_bug=reproduce_pd_mtp_bug, rebases=rebases)
    return SplitPrograms(
        forward=jax.jit(wrap(forward, ("params", "state", "rep", "rep"), ("state", "rep", "rep", "rep", "rep")),
                        donate_argnums=(1, 2), static_argnums=(4,), compiler_options=compiler_options),
        sample=jax.jit(wrap(functools.partial(packed_sample, **model), ("params", "state", "rep", "rep"),
                            ("rep", "rep", "rep", "rep")), static_argnums=(4,)),
        stream=jax.jit(wrap(functools.partial(packed_stream, **model), ("params", "rep", "rep"), "rep")),
        score=jax.jit(wrap(functools.partial(packed_score, **model), ("params", "rep", "rep"), "rep")),
        commit=jax.jit(wrap(functools.partial(packed_commit, **model), ("params", "state", "rep", "rep", "rep", "rep"),
                            ("state", "rep")), donate_argnums=(1,)))
