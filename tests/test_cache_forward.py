"""Incremental forward on a dense cache == full forward (decode, chunked continuation, verification)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import random_ids, small_config

from jaxgdn.model.cache import init_cache
from jaxgdn.model.forward import forward
from jaxgdn.model.params import init_random_params

TOL = 1e-4  # logits, fp32

CFG = small_config()
PARAMS = init_random_params(CFG, seed=3)
FWD = jax.jit(forward, static_argnums=1)


@pytest.mark.parametrize("prompt_len", [1, 2, 3, 4, 65])
def test_prefill_then_decode_equals_full_forward(prompt_len):
    """Includes prompts shorter than the conv width - 1 (zero-left-padded window)."""
    total = prompt_len + 12
    ids = random_ids(CFG, 2, total, seed=prompt_len)
    cache = init_cache(CFG, 2, total + 3)
    logits, _, cache = FWD(PARAMS, CFG, ids[:, :prompt_len], cache)
    steps = [np.asarray(logits)]
    for t in range(prompt_len, total):
        logits, _, cache = FWD(PARAMS, CFG, ids[:, t : t + 1], cache)
        steps.append(np.asarray(logits))
    assert np.asarray(cache.lengths).tolist() == [total, total]
    diff = np.abs(np.concatenate(steps, 1) - np.asarray(FWD(PARAMS, CFG, ids)[0])).max()
    assert diff <= TOL, diff


@pytest.mark.parametrize("chunk", [2, 4, 64])
def test_multi_token_forward_on_populated_cache_equals_one_at_a_time(chunk):
    prefix = 10
    ids = random_ids(CFG, 2, prefix + chunk, seed=chunk)
    cache0 = init_cache(CFG, 2, prefix + chunk)
    _, _, cache0 = FWD(PARAMS, CFG, ids[:, :prefix], cache0)
    multi, _, cache_multi = FWD(PARAMS, CFG, ids[:, prefix:], cache0)
    cache = cache0
    singles = []
    for t in range(prefix, prefix + chunk):
        logits, _, cache = FWD(PARAMS, CFG, ids[:, t : t + 1], cache)
        singles.append(np.asarray(logits))
    assert np.abs(np.asarray(multi) - np.concatenate(singles, 1)).max() <= TOL
    # The states left behind agree too, to fp32 rounding accumulated over the chunk.
    for a, b in zip(jax.tree.leaves(cache_multi), jax.tree.leaves(cache)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=1e-4)


def test_conv_window_holds_last_inputs_zero_padded():
    """After a 1-token prefill the window is [0, 0, x_0] for each GDN layer (Kc = 4)."""
    ids = random_ids(CFG, 1, 1)
    _, _, cache = FWD(PARAMS, CFG, ids, init_cache(CFG, 1, 4))
    window = np.asarray(cache.layers[0].conv)  # [1, 3, C]
    assert window.shape == (1, CFG.linear_conv_kernel_dim - 1, CFG.conv_dim)
    assert np.all(window[0, :2] == 0) and np.any(window[0, 2] != 0)


def test_chunked_and_scan_models_agree():
    ids = random_ids(CFG, 2, 130, seed=9)
    a = np.asarray(forward(PARAMS, CFG, ids, gdn_chunked=True)[0])
    b = np.asarray(forward(PARAMS, CFG, ids, gdn_chunked=False)[0])
    assert np.abs(a - b).max() <= TOL


def test_recurrent_state_stays_fp32_with_bf16_weights():
    params = init_random_params(CFG, seed=3, dtype=jnp.bfloat16)
    cache = init_cache(CFG, 1, 8, dtype=jnp.bfloat16)
    _, _, cache = forward(params, CFG, random_ids(CFG, 1, 5), cache)
    assert cache.layers[0].ssm.dtype == jnp.float32
    assert cache.layers[0].conv.dtype == jnp.bfloat16
    assert params.layers[0].mixer.A_log.dtype == jnp.float32


def test_fused_projections_serve_the_same_logits():
    """The serving layout (each layer's same-input projections as one matrix) computes the same
    projections and logits, holds no unfused copy, and fusing twice changes nothing."""
    from jaxgdn.model.mlp import linear, project
    from jaxgdn.model.params import FUSED_PROJECTIONS, fuse_projections

    fused = fuse_projections(PARAMS)
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, CFG.hidden_size))
    for layer, ref in zip(fused.layers, PARAMS.layers):
        for p, r in ((layer.mixer, ref.mixer), (layer.mlp, ref.mlp)):
            names = FUSED_PROJECTIONS[type(p)]
            assert p.fused is not None and all(getattr(p, n) is None for n in names)
            want = [linear(x, getattr(r, n)) for n in names]
            got = project(x, p, tuple(w.shape[-1] for w in want))
            for g, w in zip(got, want):
                np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
    again = fuse_projections(fused)
    assert again.layers[0].mlp.fused is fused.layers[0].mlp.fused
    # This random model is chaotic: scaling one weight matrix by 1 + 1e-7 moves its logits by ~2e-4, so
    # fp32 rounding of a differently shaped product shows up at that size, not at TOL.
    ids = random_ids(CFG, 2, 9, seed=5)
    diff = np.abs(np.asarray(FWD(fused, CFG, ids)[0]) - np.asarray(FWD(PARAMS, CFG, ids)[0])).max()
    assert diff <= 2e-3, diff


@pytest.mark.parametrize("tokens", [1, 200])  # 1/rms after the product (a batch-1 decode step) and before it
def test_folded_norm_product_equals_norm_then_product(tokens):
    """A DeferredNorm's product with the (1 + w)-folded weight is the RMSNorm's output times the weight; the
    default policy post-scales one token (a batch-1 decode step) and pre-scales more."""
    from jaxgdn.model.mlp import linear
    from jaxgdn.model.norms import inverse_rms, pre_norm, rms_norm_1p
    from jaxgdn.model.policy import DEFAULT_POLICY

    kx, kw, kn = jax.random.split(jax.random.PRNGKey(tokens), 3)
    x = 3.0 * jax.random.normal(kx, (tokens, 48))
    w = jax.random.normal(kw, (40, 48))
    norm = 0.3 * jax.random.normal(kn, (48,))
    want = linear(rms_norm_1p(x, norm, 1e-6), w)
    deferred = pre_norm(x, None, 1e-6, DEFAULT_POLICY.post_scale_max_tokens)
    assert deferred.post_scale == (tokens == 1)
    np.testing.assert_allclose(np.asarray(deferred.inv_rms), np.asarray(inverse_rms(x, 1e-6)))
    got = linear(deferred, w * (1.0 + norm))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    # the [R, Q] view of the engine's rows reshapes both factors and keeps the form
    rows = deferred.reshape(1, tokens, 48)
    assert rows.shape == (1, tokens, 48) and rows.inv_rms.shape == (1, tokens, 1)
    assert rows.post_scale == deferred.post_scale


def test_folded_norms_serve_the_same_logits():
    """fold_norms: every decoder layer's (trunk and MTP) input and post-attention norm weight moves into
    the fused projections, none is left, folding twice changes nothing, and the logits are those of the
    loaded weights, with 1/rms applied after the products and before them (the policy's
    post_scale_max_tokens above and below this step's 18 tokens)."""
    from jaxgdn.model.params import fold_norms
    from jaxgdn.model.policy import KernelPolicy

    assert PARAMS.mtp is not None
    folded = fold_norms(PARAMS)
    for layer in folded.layers + folded.mtp.layers:
        assert layer.input_layernorm is None and layer.post_attention_layernorm is None
        assert layer.mixer.fused is not None and layer.mlp.fused is not None
    assert fold_norms(folded).layers[0].mlp.fused is folded.layers[0].mlp.fused
    ids = random_ids(CFG, 2, 9, seed=5)
    ref = np.asarray(FWD(PARAMS, CFG, ids)[0])
    logits = {}
    for limit in (0, 18):
        policy = KernelPolicy(post_scale_max_tokens=limit)
        logits[limit] = np.asarray(jax.jit(lambda p, i, policy=policy: forward(p, CFG, i, policy=policy))(folded, ids)[0])
    pre, post = logits[0], logits[18]
    # the chaotic random model again (see above): fp32 rounding of the folded weights shows up at ~1e-5
    for got in (post, pre):
        assert np.abs(got - ref).max() <= 2e-3, np.abs(got - ref).max()
    assert not np.array_equal(post, pre)  # the two forms did run
