"""Token sampling: greedy, temperature, top-k, top-p; randomness keyed by (seed, request, position).

Keying the noise by position (not by step or batch slot) makes a request's samples independent of which
other requests share its steps, and lets speculative verification reuse the same key scheme.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def position_keys(seeds, request_ids, positions):
    """[L] uint32 seeds, request ids, positions -> [L] PRNG keys."""

    def one(s, r, p):
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(s), r), p)

    return jax.vmap(one)(seeds, request_ids, positions)


def filtered_log_probs(logits, temperature, top_k, top_p):
    """logits [L, V] -> log-probabilities after temperature, top-k and top-p (filtered entries -inf).

    temperature [L] (> 0 where used; rows with 0 are treated as 1 here, the caller takes argmax);
    top_k [L] (<= 0: off); top_p [L] in (0, 1].
    """
    V = logits.shape[-1]
    t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    # Pinned in one buffer that the sort, the thresholds, the mask and log_softmax all read: XLA's GPU GEMM
    # fusions otherwise recompute the logits inside some of them with other bits, and a threshold taken from
    # one copy can mask every token of another (an all -inf row samples the pad token).
    scaled = jax.lax.optimization_barrier(logits.astype(jnp.float32) / t)
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
    scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
    # top-p over what top-k kept: keep the smallest prefix of sorted tokens whose mass reaches top_p.
    sorted_desc = jnp.where(jnp.arange(V)[None, :] < k[:, None], sorted_desc, -jnp.inf)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = mass_before < top_p[:, None]
    cutoff = jnp.min(jnp.where(keep_sorted, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    scaled = jnp.where(scaled < cutoff, -jnp.inf, scaled)
    return jax.nn.log_softmax(scaled, axis=-1)


def sample_tokens(logits, temperature, top_k, top_p, keys, argmax=None):
    """logits [L, V]; per-row params [L]; keys [L] -> tokens [L] int32 (argmax where temperature == 0; argmax [L]:
    the logits' argmax when the caller has it)."""
    greedy = jnp.argmax(logits, axis=-1) if argmax is None else argmax
    logp = filtered_log_probs(logits, temperature, top_k, top_p)
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (logits.shape[-1],)))(keys)
    sampled = jnp.argmax(logp + gumbel, axis=-1)
    return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)
