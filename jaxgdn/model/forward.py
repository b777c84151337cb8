"""The Qwen3.5 text model as pure functions over a ModelParams pytree (docs/qwen35-architecture.md §3).

`forward` runs new tokens on top of an optional cache; with cache=None it is the full-sequence
forward from an empty state. Decode, chunked-prefill continuation and multi-token verification are
all `forward` on a populated cache. It is the plain XLA oracle that training and the parity tests run;
serving runs `jaxgdn.engine.forward` over paged pools, with the kernels.
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp

from .attention import attention_layer
from .cache import ModelCache
from .config import FULL_ATTENTION, ModelConfig
from .gdn import gdn_layer
from .mlp import linear, mlp
from .norms import pre_norm, rms_norm_1p
from .parallel import all_reduce
from .params import DecoderLayerParams, ModelParams
from .policy import DEFAULT_POLICY, KernelPolicy


def residual_block(p: DecoderLayerParams, cfg: ModelConfig, x, mixer: Callable, policy: KernelPolicy = DEFAULT_POLICY):
    """Pre-norm residual block: x + mixer(norm(x)), then + MLP(norm(.)).

    mixer(h) -> (out, new_state) is the token mixer bound to its state (dense cache or paged pools); h is
    the normed x, a DeferredNorm where the norm's weight is folded into the projections (`pre_norm`).
    Under tensor parallelism the mixer's and the MLP's outputs are partial sums, completed here.
    Returns (x, new_state).
    """
    eps, post = cfg.rms_norm_eps, policy.post_scale_max_tokens
    h, new_state = mixer(pre_norm(x, p.input_layernorm, eps, post))
    x = x + all_reduce(h, policy)
    x = x + all_reduce(mlp(p.mlp, pre_norm(x, p.post_attention_layernorm, eps, post), policy), policy)
    return x, new_state


def decoder_layer(p: DecoderLayerParams, cfg: ModelConfig, layer_type: str, x, positions, layer_cache, start,
                  gdn_chunked: bool = True, policy: KernelPolicy = DEFAULT_POLICY):
    """A decoder layer on a dense cache (gdn_chunked: `gdn_layer`'s chunked). Returns (x, new layer cache)."""
    if layer_type == FULL_ATTENTION:
        mixer = lambda h: attention_layer(p.mixer, cfg, h, positions, layer_cache, start)  # noqa: E731
    else:
        mixer = lambda h: gdn_layer(p.mixer, cfg, h, layer_cache, chunked=gdn_chunked)  # noqa: E731
    return residual_block(p, cfg, x, mixer, policy)


def step_positions(cache: ModelCache | None, batch: int, num_tokens: int):
    """Positions [B, T] of new tokens: cache lengths (or 0) + arange(T)."""
    start = jnp.zeros((batch,), jnp.int32) if cache is None else cache.lengths
    return start, start[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)[None, :]


def logits_from_hidden(params: ModelParams, hidden):
    """hidden: [..., H] (final-normed) -> logits [..., V] with the (possibly tied) head."""
    return linear(hidden, params.head_weight())


def forward(
    params: ModelParams,
    cfg: ModelConfig,
    input_ids,
    cache: ModelCache | None = None,
    *,
    gdn_chunked: bool = True,
    compute_logits: bool = True,
    policy: KernelPolicy = DEFAULT_POLICY,
):
    """input_ids: [B, T] int. Returns (logits [B, T, V] or None, hidden [B, T, H] after the final norm,
    new cache or None). The hidden is what the MTP head consumes. gdn_chunked: the GDN recurrence's chunked
    XLA form (else the token scan, which training on CPU uses: see jaxgdn.train)."""
    B, T = input_ids.shape
    start, positions = step_positions(cache, B, T)
    x = params.embed_tokens[input_ids]
    new_layers = []
    for i, layer_type in enumerate(cfg.layer_types):
        layer_cache = None if cache is None else cache.layers[i]
        x, layer_cache = decoder_layer(params.layers[i], cfg, layer_type, x, positions, layer_cache, start,
                                       gdn_chunked, policy)
        new_layers.append(layer_cache)
    hidden = rms_norm_1p(x, params.norm, cfg.rms_norm_eps)
    logits = logits_from_hidden(params, hidden) if compute_logits else None
    new_cache = None if cache is None else ModelCache(layers=tuple(new_layers), lengths=cache.lengths + T)
    return logits, hidden, new_cache
