"""Log-probabilities of sampled and prompt tokens, scored on the device beside sampling (vLLM's shapes).

They come from the model's own distribution, a log-softmax of the raw logits before temperature, top-k and
top-p (vLLM's default logprobs_mode, "raw_logprobs"). A step returns, for each scored position, the target
token's logprob and rank and the MAX_LOGPROBS most likely tokens with theirs; the [rows, vocab] logits never
leave the device.
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp
import numpy as np

from ..model.parallel import head_logits

MAX_LOGPROBS = 20  # top entries a request may ask for (vLLM's default max_logprobs)
STREAM_CHUNK = 256  # tokens whose logits a prompt-logprobs program holds at once


class Sampler(enum.IntFlag):
    """The static variant of a step program, chosen per launch from its rows' requests (flags: a greedy launch
    that scores its tokens takes the argmax of its logits, not the sampling path's sort over the vocabulary)."""

    GREEDY = 0  # argmax only (no logits gathered under tensor parallelism)
    SAMPLE = 1  # some row samples with temperature > 0
    LOGPROBS = 2  # scores the sampled tokens
    STREAM = 4  # scores every token's successor in the stream
    GUIDED = 8  # masks the logits with the launch's bitmask (host_masks.py)
    PENALIZE = 16  # applies penalties and logit bias, and counts the slots' outputs (penalties.py)
    PROMPT_LOGPROBS = LOGPROBS | STREAM


def score(logits, targets, num_top: int = MAX_LOGPROBS):
    """logits [N, V] f32, targets [N] -> (logprob [N], rank [N] (1 = most likely), top_ids [N, num_top],
    top_logprobs [N, num_top])."""
    logz = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, jnp.clip(targets, 0, logits.shape[-1] - 1)[:, None], axis=-1)[:, 0]
    rank = 1 + jnp.sum(logits > target[:, None], axis=-1)
    top_values, top_ids = top_k_blocked(logits, num_top)
    return target - logz, rank.astype(jnp.int32), top_ids.astype(jnp.int32), top_values - logz[:, None]


def top_k_blocked(x, k: int, block: int = 128):
    """lax.top_k over the last axis of x [N, V] in two rounds: the k blocks of `block` entries with the largest
    maxima hold the k largest entries (any other block's maximum is below k of them), so the second round
    picks among k * block entries. XLA's GPU top_k of a large k over a whole vocabulary sorts every row.
    Returns (values [N, k], indices [N, k]) as lax.top_k, ties aside."""
    N, V = x.shape
    nb = -(-V // block)
    if nb <= k:
        return jax.lax.top_k(x, k)
    padded = jnp.pad(x, ((0, 0), (0, nb * block - V)), constant_values=-jnp.inf).reshape(N, nb, block)
    _, blocks = jax.lax.top_k(jnp.max(padded, axis=-1), k)  # [N, k]
    candidates = jnp.take_along_axis(padded, blocks[:, :, None], axis=1).reshape(N, k * block)
    values, j = jax.lax.top_k(candidates, k)
    return values, jnp.take_along_axis(blocks, j // block, axis=1) * block + j % block


def pack(scores) -> jax.Array:
    """score's four arrays as one int32 vector (floats bit-cast): [N lp | N rank | N*k ids | N*k top lp]."""
    lp, rank, ids, top = scores
    as_int = lambda x: jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32).ravel()  # noqa: E731
    return jnp.concatenate([as_int(lp), rank.ravel(), ids.ravel(), as_int(top)])


def packed_size(n: int) -> int:
    return n * (2 + 2 * MAX_LOGPROBS)


def stream_targets(ids, token_row, next_token):
    """[T] the token after each token of the stream: the next one of its row, or for a row's last token the
    row's next_token (the prompt token after a chunk; meaningless after a sampling row's last token)."""
    T = ids.shape[0]
    following = jnp.clip(jnp.arange(T) + 1, 0, T - 1)
    same_row = (token_row[following] == token_row) & (jnp.arange(T) + 1 < T)
    return jnp.where(same_row, ids[following], next_token[jnp.clip(token_row, 0, next_token.shape[0] - 1)])


def score_stream(params, hidden, targets, vocab_size: int, policy):
    """Score every token's target over the trunk's final hidden [T, H], STREAM_CHUNK tokens of logits at a time
    (the whole [T, V] would not fit a long prefill). Returns score's arrays for the T tokens."""
    T = hidden.shape[0]
    chunk = min(T, STREAM_CHUNK)
    blocks = (hidden.reshape(T // chunk, chunk, -1), targets.reshape(T // chunk, chunk))

    def one(block):
        h, t = block
        return score(head_logits(params, h, vocab_size, policy).astype(jnp.float32), t)

    return jax.tree_util.tree_map(lambda x: x.reshape(T, *x.shape[2:]), jax.lax.map(one, blocks))


# ------------------------------------------------------------------------------------------------ host side
@dataclasses.dataclass(frozen=True)
class Logprob:
    """One token's entry (vLLM's): its log-probability, its rank in the distribution (1 = most likely), and
    its text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclasses.dataclass
class Scores:
    """A launch step's scores on the host, for n positions: logprob [n], rank [n], top_ids [n, k],
    top_logprobs [n, k]."""

    logprob: np.ndarray
    rank: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray

    @classmethod
    def unpack(cls, flat: np.ndarray, n: int) -> "Scores":
        k = MAX_LOGPROBS
        lp, rank, ids, top = np.split(flat, np.cumsum([n, n, n * k]))
        return cls(lp.view(np.float32), rank, ids.reshape(n, k), top.view(np.float32).reshape(n, k))

    def entry(self, i: int, token: int, num_top: int) -> tuple:
        """Position i's raw entry for target `token`: (token, logprob, rank, ((id, logprob), ...) top num_top)."""
        top = tuple((int(t), float(v)) for t, v in zip(self.top_ids[i, :num_top], self.top_logprobs[i, :num_top]))
        return int(token), float(self.logprob[i]), int(self.rank[i]), top


def entry_dict(entry: tuple | None, decode=None) -> dict[int, Logprob] | None:
    """A raw entry as vLLM's {token id: Logprob} (the target token first, then the top ones); decode(ids) -> text."""
    if entry is None:
        return None
    token, lp, rank, top = entry
    text = (lambda t: decode([t])) if decode else (lambda t: None)  # noqa: E731
    out = {token: Logprob(lp, rank, text(token))}
    for r, (t, v) in enumerate(top, start=1):
        if t not in out:
            out[t] = Logprob(v, r, text(t))
    return out


def launch_sampler(rows) -> Sampler:
    """The scores a launch's rows need: STREAM where a row's prompt tokens are scored, LOGPROBS where a sampling
    row's tokens are (GREEDY when none; the runner adds SAMPLE and the masks' and penalties' flags)."""
    sampler = Sampler.GREEDY
    for row in rows:
        req = row.request
        if req.sampling_params.prompt_logprobs is not None and req.num_computed < prompt_length(req) - 1:
            sampler |= Sampler.STREAM
        if row.samples and req.sampling_params.logprobs is not None:
            sampler |= Sampler.LOGPROBS
    return sampler


def prompt_length(req) -> int:
    """The request's whole prompt's length (a PD prefill worker's request holds all but its last token)."""
    return len(req.prompt_token_ids) + req.prefill_only


def record_prompt(req, scores: Scores | None, first: int, start: int, n: int) -> None:
    """A row's n tokens at stream index first on (positions start..start+n-1) score the prompt tokens at positions
    start+1..: each not recorded yet is appended to req.prompt_logprobs (a recomputation adds none)."""
    num_top = req.sampling_params.prompt_logprobs
    if num_top is None or scores is None:
        return
    for p in range(max(start, len(req.prompt_logprobs) - 1), min(start + n, prompt_length(req) - 1)):
        req.prompt_logprobs.append(scores.entry(first + p - start, req.token_after(p + 1), num_top))


def record_sampled(req, scores: Scores | None, index: int, token: int) -> None:
    """The output token just filled in was scored at `index` of its step's sampled scores."""
    num_top = req.sampling_params.logprobs
    if num_top is not None and scores is not None:
        req.sampled_logprobs.append(scores.entry(index, token, num_top))
