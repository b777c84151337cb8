"""Verification of speculative drafts (rejection sampling), vectorised over rows.

A row with n drafts has n+1 logits rows: row i verifies draft i (i < n), row n gives the bonus token.
Greedy (temperature 0): accept while draft_i == argmax_i, then emit the correction argmax or the bonus.
Temperature (Leviathan et al.) with greedy (one-hot) drafts: accept draft_i with probability p_i(draft_i);
on the first rejection sample from the residual p_i with draft_i removed; if all pass, sample the bonus
from p_n. Drafts outside [0, V) (the -1 placeholders of a padded prompt tail) are never accepted.
Randomness is keyed by (seed, request, position), as in sampling.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .sampling import filtered_log_probs

ACCEPT_SALT = 1  # folded into the position key for the accept test, so it is independent of the token draw


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
    greedy = (temperature == 0)[:, None]
    if stochastic:
        t_rows = jnp.repeat(temperature, W)
        logp = filtered_log_probs(logits.reshape(R * W, V), t_rows, jnp.repeat(top_k, W), jnp.repeat(top_p, W))
        logp = logp.reshape(R, W, V)
        flat_keys = keys.reshape(-1)
        gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (V,)))(flat_keys).reshape(R, W, V)
        uniform = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, ACCEPT_SALT)))(flat_keys).reshape(R, W)
        plain = jnp.where(greedy, argmax, jnp.argmax(logp + gumbel, axis=-1))  # a token drawn from p_i
    else:
        plain = argmax

    if K == 0:
        return plain.astype(jnp.int32), jnp.ones((R,), jnp.int32)
    d = drafts  # [R, K]
    d_valid = (d >= 0) & (d < V)
    d_safe = jnp.clip(d, 0, V - 1)
    if stochastic:
        p_draft = jnp.exp(jnp.take_along_axis(logp[:, :K], d_safe[..., None], axis=-1)[..., 0])  # [R, K]
        accept = jnp.where(greedy, d == argmax[:, :K], uniform[:, :K] < p_draft)
        # Residual after rejecting draft i: p_i without the draft token (q is one-hot on it).
        masked = jnp.where(jax.nn.one_hot(d_safe, V, dtype=bool) & d_valid[..., None], -jnp.inf, logp[:, :K])
        recovered = jnp.where(greedy, argmax[:, :K], jnp.argmax(masked + gumbel[:, :K], axis=-1))
    else:
        accept = d == argmax[:, :K]
        recovered = argmax[:, :K]
    accept = accept & d_valid & (jnp.arange(K)[None, :] < n_draft[:, None])
    n_acc = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)  # leading accepts
    recovered = jnp.concatenate([recovered, plain[:, K:]], axis=1)  # [R, W]
    final = jnp.where(n_acc < n_draft, jnp.take_along_axis(recovered, n_acc[:, None], 1)[:, 0],
                      jnp.take_along_axis(plain, n_acc[:, None], 1)[:, 0])
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
