"""Verification of speculative drafts, vectorised over rows.

A row with n drafts has n+1 logits rows: row i verifies draft i (i < n), row n gives the bonus token. Each
logits row draws its token exactly as a step without drafts would at that position (the argmax at temperature
0, else a draw from the filtered distribution keyed by (seed, request, position)); a draft is accepted while it
equals the token drawn at its position, and the row emits the accepted drafts and the first token drawn after
them. So a request's tokens are those it gets without MTP, greedy or seeded. With greedy (one-hot) drafts this is
rejection sampling (Leviathan et al.): draft i is accepted with probability p_i(draft_i), and a rejected position
emits a draw from p_i without the draft token. Drafts outside [0, V) (the -1 placeholders of a padded prompt
tail) are never accepted.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from .sampling import sample_tokens


def verify_drafts(logits, drafts, n_draft, temperature, top_k, top_p, keys, stochastic: bool = True, *,
                  argmax=None, vocab_size: int | None = None):
    """logits [R, 1+K, V] (rows beyond 1+n_draft unused); drafts [R, K]; n_draft [R];
    temperature/top_k/top_p [R]; keys [R, 1+K] position keys of the tokens being sampled.
    stochastic (static): False when the caller knows every row is greedy; that program skips the sort,
    softmax and noise over the vocabulary. The general program gives greedy rows the same argmax.
    argmax [R, 1+K]: the logits' argmax when the caller has it (a sharded vocabulary); a greedy program then
    needs no logits (None) but the vocab_size.

    Returns (tokens [R, 1+K] (entries past num_sampled are -1), num_sampled [R] in [1, 1+n_draft]).
    The choice is static rather than a device-side lax.cond: XLA's GPU conditional copies its predicate
    to the host and waits for it, which serialised every step with the host.
    """
    return _verify(logits, drafts, n_draft, temperature, top_k, top_p, keys, stochastic=stochastic, argmax=argmax,
                   vocab_size=vocab_size)


def _verify(logits, drafts, n_draft, temperature, top_k, top_p, keys, stochastic: bool, argmax=None,
            vocab_size: int | None = None):
    if argmax is None:
        argmax = jnp.argmax(logits, axis=-1)  # [R, W]
    R, W = argmax.shape
    V = logits.shape[-1] if logits is not None else vocab_size
    K = W - 1
    if stochastic:  # the token each position draws without drafts
        plain = sample_tokens(logits.reshape(R * W, V), jnp.repeat(temperature, W), jnp.repeat(top_k, W),
                              jnp.repeat(top_p, W), keys.reshape(-1), argmax.reshape(-1)).reshape(R, W)
    else:
        plain = argmax

    if K == 0:
        return plain.astype(jnp.int32), jnp.ones((R,), jnp.int32)
    d = drafts  # [R, K]
    accept = (d == plain[:, :K]) & (d >= 0) & (d < V) & (jnp.arange(K)[None, :] < n_draft[:, None])
    n_acc = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)  # leading accepts
    final = jnp.take_along_axis(plain, n_acc[:, None], 1)[:, 0]  # the correction, or the bonus token
    i = jnp.arange(W)[None, :]
    d_ext = jnp.concatenate([d, jnp.zeros((R, 1), d.dtype)], axis=1)
    tokens = jnp.where(i < n_acc[:, None], d_ext, jnp.where(i == n_acc[:, None], final[:, None], -1))
    return tokens.astype(jnp.int32), (n_acc + 1).astype(jnp.int32)


class SpecCounters:
    """Drafts verified and accepted so far, per draft position, and verify rows (an engine's, on the host)."""

    def __init__(self, K: int):
        self.K = K
        self.drafted_per_position = np.zeros(max(K, 1), np.int64)
        self.accepted_per_position = np.zeros(max(K, 1), np.int64)
        self.num_verify_rows = 0

    def count(self, metrics, n_draft: int, n_accepted: int) -> None:
        """A verify row of n_draft drafts accepted n_accepted; metrics: its request's RequestMetrics."""
        self.num_verify_rows += 1
        self.drafted_per_position[:n_draft] += 1
        self.accepted_per_position[:n_accepted] += 1
        metrics.num_drafted += n_draft
        metrics.num_accepted_drafts += n_accepted

    def metrics(self) -> dict:
        """Drafted/accepted counts, acceptance rate per draft position, mean acceptance length."""
        drafted, accepted = int(self.drafted_per_position.sum()), int(self.accepted_per_position.sum())
        rate = [float(a / d) if d else None for a, d in zip(self.accepted_per_position, self.drafted_per_position)]
        return {
            "num_drafted": drafted, "num_accepted": accepted,
            "acceptance_rate": accepted / drafted if drafted else None,
            "acceptance_rate_per_position": rate[: self.K],
            # tokens produced per verify step: 1 (correction or bonus) + accepted drafts
            "mean_acceptance_length": 1 + accepted / self.num_verify_rows if self.num_verify_rows else None,
        }
