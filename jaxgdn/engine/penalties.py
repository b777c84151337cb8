"""Penalties and logit bias (vLLM's semantics), applied on the device to a step's logits before sampling.

- repetition_penalty r: a token in the prompt or the output so far has its logit divided by r where positive,
  multiplied by r where not;
- frequency_penalty f: minus f times the token's count in the output so far; presence_penalty p: minus p if it
  occurs there at all;
- logit_bias: a request's {token id: bias} added to the raw logits first.

Each slot keeps its request's output counts [S, V] int32 and its prompt's tokens as bits [S, ceil(V/32)] on the
device (EngineState.output_counts / prompt_tokens): written from the host when the request is admitted
(`seed`: its prompt and, after a preemption, the outputs it had), then counted by the commit of every split launch
(split_step.py), which every launch holding a penalized request is. In an MTP verify window position k
counts the window's drafts 1..k as outputs, so each position sees what the step without drafts would have seen.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

MAX_LOGIT_BIAS = 300  # entries of a request's logit_bias (OpenAI's limit)
SEED_BUCKET = 64  # the least length `seed` pads to


def penalized(sp) -> bool:
    """Whether a request's SamplingParams change its logits here."""
    return bool(sp.presence_penalty or sp.frequency_penalty or sp.repetition_penalty != 1.0 or sp.logit_bias)


def penalty_arrays(rows, num_rows: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """A launch's (penalties [R, 3] f32: presence, frequency, repetition per row; bias [R, 2, B]: token ids
    (-1: none) and bias values bit-cast, B = MAX_LOGIT_BIAS) or (None, None) when no sampling row's request is
    penalized (bias None when none has a logit_bias)."""
    sps = [row.request.sampling_params for row in rows]
    if not any(row.samples and penalized(sp) for row, sp in zip(rows, sps)):
        return None, None
    pen = np.zeros((num_rows, 3), np.float32)
    pen[:, 2] = 1.0
    pen[: len(sps)] = [(sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) for sp in sps]
    if not any(sp.logit_bias for sp in sps):
        return pen, None
    ids = np.full((num_rows, MAX_LOGIT_BIAS), -1, np.int32)
    values = np.zeros((num_rows, MAX_LOGIT_BIAS), np.float32)
    for b, sp in enumerate(sps):
        for j, (t, v) in enumerate(sp.logit_bias or ()):
            ids[b, j], values[b, j] = t, v
    return pen, np.stack([ids, values.view(np.int32)], axis=1)


def apply(logits, counts, prompt_bits, drafts, n_draft, penalties, bias):
    """logits [R, W, V] f32 (W = 1+K); counts [R, V] and prompt_bits [R, V/32] of the rows' slots; drafts [R, K],
    n_draft [R]; penalties [R, 3]; bias [R, 2, B] or None -> penalized logits [R, W, V]."""
    R, W, V = logits.shape
    if bias is not None:
        ids = bias[:, 0]
        values = jax.lax.bitcast_convert_type(bias[:, 1], jnp.float32)
        add = jnp.zeros((R, V), jnp.float32).at[jnp.arange(R)[:, None], jnp.where(ids >= 0, ids, V)].add(
            values, mode="drop")
        logits = logits + add[:, None, :]
    # position k's outputs: the slot's counts and the window's drafts 1..k
    K = W - 1
    live = (jnp.arange(K)[None, :] < n_draft[:, None]) & (drafts >= 0) & (drafts < V)
    drafted = jax.nn.one_hot(jnp.where(live, drafts, -1), V, dtype=jnp.int32)  # [R, K, V] (-1: a zero row)
    ahead = jnp.concatenate([jnp.zeros((R, 1, V), jnp.int32), jnp.cumsum(drafted, axis=1)], axis=1)
    out_counts = counts[:, None, :] + ahead  # [R, W, V]
    in_prompt = ((prompt_bits[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1).reshape(R, -1)[:, :V] == 1
    seen = in_prompt[:, None, :] | (out_counts > 0)
    presence, frequency, repetition = (penalties[:, i, None, None] for i in range(3))
    rep = jnp.where(seen, repetition, 1.0)
    logits = jnp.where(logits > 0, logits / rep, logits * rep)
    return logits - frequency * out_counts - presence * (out_counts > 0)


def count(counts, idx, tokens, num_sampled):
    """counts [S, V] plus each row's emitted tokens (tokens [R, W], the first num_sampled [R] of row r, slot
    idx[r])."""
    S, V = counts.shape
    emitted = jnp.arange(tokens.shape[1])[None, :] < num_sampled[:, None]
    return counts.at[jnp.broadcast_to(idx[:, None], tokens.shape), jnp.where(emitted, tokens, V)].add(1, mode="drop")


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _seed(counts, prompt_bits, slot, ids, num_prompt, num_tokens):
    V = counts.shape[1]
    i = jnp.arange(ids.shape[0])
    outputs = jnp.zeros((V,), jnp.int32).at[jnp.where((i >= num_prompt) & (i < num_tokens), ids, V)].add(
        1, mode="drop")
    nbits = prompt_bits.shape[1] * 32
    in_prompt = jnp.zeros((nbits,), jnp.int32).at[jnp.where(i < num_prompt, ids, nbits)].set(1, mode="drop")
    bits = jnp.sum(in_prompt.reshape(-1, 32) << jnp.arange(32, dtype=jnp.int32), axis=1, dtype=jnp.int32)
    return counts.at[slot].set(outputs), prompt_bits.at[slot].set(bits)


def seed_size(max_model_len: int) -> int:
    """The one length `seed` pads a request's tokens to (one program for every request)."""
    return max(SEED_BUCKET, 1 << (max_model_len - 1).bit_length())


def seed_admitted(state, rows, first: list[bool], size: int):
    """state with the slots of the rows' penalized requests seeded where the row is the request's first since it
    was admitted (first, per row)."""
    for row, is_first in zip(rows, first):
        req = row.request
        if is_first and penalized(req.sampling_params):
            state = seed(state, req.slot, req.prompt_token_ids, [t for t in req.output_token_ids if t >= 0], size)
    return state


def seed(state, slot: int, prompt: list[int], outputs: list[int], size: int):
    """state with slot's counts set to outputs' and its prompt bits to prompt's tokens (a request's admission);
    the tokens travel padded to size (seed_size). Slot 0, the null slot, with no tokens: compiles the program."""
    ids = list(prompt) + list(outputs)
    padded = np.zeros(size, np.int32)
    padded[: len(ids)] = ids
    counts, bits = _seed(state.output_counts, state.prompt_tokens, np.int32(slot), padded, np.int32(len(prompt)),
                         np.int32(len(ids)))
    return state.replace(output_counts=counts, prompt_tokens=bits)
