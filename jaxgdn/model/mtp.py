"""The MTP head (docs/qwen35-architecture.md §8): one extra full-attention decoder layer that drafts the token after next.

At MTP position i the inputs are the trunk's final-normed hidden h_i and the embedding of token t_{i+1};
the output predicts t_{i+2}. The layer runs at the hidden's position p_i with its own KV cache.
"""

from __future__ import annotations

import jax.numpy as jnp

from .cache import ModelCache
from .config import FULL_ATTENTION, ModelConfig
from .forward import decoder_layer, logits_from_hidden, step_positions
from .mlp import linear
from .norms import rms_norm_1p
from .parallel import embed
from .params import ModelParams
from .policy import DEFAULT_POLICY, KernelPolicy


def mtp_fc_input(params: ModelParams, cfg: ModelConfig, hidden, next_ids, policy: KernelPolicy = DEFAULT_POLICY):
    """fc([RMS1p(E[next_ids]) ‖ RMS1p(hidden)]): hidden [..., H], next_ids [...] -> [..., H]."""
    mtp = params.mtp
    if mtp is None:
        raise ValueError("this checkpoint has no MTP head (no mtp.* tensors / mtp_num_hidden_layers = 0)")
    emb = embed(params, next_ids, cfg.vocab_size, policy)
    x = jnp.concatenate(
        [
            rms_norm_1p(emb, mtp.pre_fc_norm_embedding, cfg.rms_norm_eps),
            rms_norm_1p(hidden.astype(emb.dtype), mtp.pre_fc_norm_hidden, cfg.rms_norm_eps),
        ],
        axis=-1,
    )
    return linear(x, mtp.fc)


def mtp_forward(params: ModelParams, cfg: ModelConfig, hidden, next_ids, cache: ModelCache | None = None):
    """hidden: [B, T, H] trunk hidden (after the final norm); next_ids: [B, T] the token after each hidden.

    Returns (logits [B, T, V], mtp_hidden [B, T, H] after mtp.norm (the input for chained drafts),
    new MTP cache or None).
    """
    mtp = params.mtp
    B, T, _ = hidden.shape
    start, positions = step_positions(cache, B, T)
    x = mtp_fc_input(params, cfg, hidden, next_ids)
    new_layers = []
    for i, layer in enumerate(mtp.layers):
        layer_cache = None if cache is None else cache.layers[i]
        x, layer_cache = decoder_layer(layer, cfg, FULL_ATTENTION, x, positions, layer_cache, start)
        new_layers.append(layer_cache)
    m = rms_norm_1p(x, mtp.norm, cfg.rms_norm_eps)
    new_cache = None if cache is None else ModelCache(layers=tuple(new_layers), lengths=cache.lengths + T)
    return logits_from_hidden(params, m), m, new_cache
