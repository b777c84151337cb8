"""The MLP's gate/up product with SiLU * up in one Mosaic GPU kernel (Hopper only): the rule that picks it, and
on a GPU the kernel and the model compiled with it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import gpu_test, small_config

from jaxgdn.model import forward as model
from jaxgdn.model import mlp
from jaxgdn.model.norms import DeferredNorm, inverse_rms
from jaxgdn.model.params import MLPParams, cast_params, fold_norms, init_random_params
from jaxgdn.model.policy import DEFAULT_POLICY, KernelPolicy
from pallas_kernels import swiglu_mosaic as sm


def test_swiglu_kernel_rule_needs_a_hopper_gpu_and_whole_tiles():
    """The MLP's fused gate/up kernel (Mosaic GPU, compiled in the GPU tests below) takes whole tiles of 16-bit
    operands only, and without a Hopper GPU `gated_product` stays the XLA form whatever the size."""
    assert sm.supported(4096, 1024, 3584, jnp.bfloat16)
    for m, k, width, dtype in [(4160, 1024, 3584, jnp.bfloat16), (4096, 1000, 3584, jnp.bfloat16),
                               (4096, 1024, 3600, jnp.bfloat16), (4096, 1024, 3584, jnp.float32)]:
        assert not sm.supported(m, k, width, dtype)
    assert sm.supported_small(64, 1024, 3584, jnp.bfloat16)
    for m, k, width, dtype in [(32, 1024, 3584, jnp.bfloat16), (128, 1024, 3584, jnp.bfloat16),
                               (64, 1000, 3584, jnp.bfloat16), (64, 1024, 3600, jnp.bfloat16),
                               (64, 1024, 3584, jnp.float32)]:
        assert not sm.supported_small(m, k, width, dtype)
    assert not sm.kernel_available()  # the CPU suite
    kx, kw = jax.random.split(jax.random.PRNGKey(3))
    x = jax.random.normal(kx, (DEFAULT_POLICY.swiglu_min_tokens, 64), jnp.bfloat16)
    w = (jax.random.normal(kw, (256, 64)) * 0.1).astype(jnp.bfloat16)
    p = MLPParams(None, None, jnp.zeros((64, 128), jnp.bfloat16), fused=w)
    assert mlp.swiglu_kernel_for(p, x, DEFAULT_POLICY) is None
    gate, up = jnp.split(x @ w.T, 2, axis=-1)
    np.testing.assert_array_equal(np.asarray(mlp.gated_product(p, x)), np.asarray(jax.nn.silu(gate) * up))
    # a DeferredNorm's rows are the normed activation the products read
    normed = DeferredNorm(x, inverse_rms(x, 1e-6))
    np.testing.assert_array_equal(np.asarray(normed.rows() @ w.T), np.asarray(normed.product(w)))


@gpu_test
@pytest.mark.parametrize("form, m, k, width", [
    ("large", 256, 64, 128), ("large", 512, 192, 384), ("large", 4096, 1024, 3584),
    ("small", 64, 256, 64), ("small", 64, 512, 384), ("small", 64, 1024, 3584)])
def test_swiglu_kernel_compiled_equals_the_rounded_products_silu(form, m, k, width):
    """The Mosaic GPU gate/up kernel (the persistent large form and the decode-sized small one) against
    silu(g) * u in fp32 from the products rounded to bf16 (what it rounds before its epilogue), within a bf16
    rounding of the output; 0.8B widths last."""
    assert sm.kernel_available()
    product = sm.swiglu_product if form == "large" else sm.swiglu_product_small
    kx, kw = jax.random.split(jax.random.PRNGKey(m + k))
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (2 * width, k), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
    y = np.asarray(jax.jit(product)(x, w).astype(jnp.float32))
    gu = jnp.einsum("tk,nk->tn", x, w, preferred_element_type=jnp.float32, precision="highest")
    g, u = np.split(np.asarray(gu.astype(jnp.bfloat16).astype(jnp.float32)), 2, axis=-1)
    ref = g / (1 + np.exp(-g)) * u
    # one accumulation order against another can move g or u by one bf16 step: allow 2^-6 relative
    np.testing.assert_allclose(y, ref, rtol=2**-6, atol=2**-7 * float(np.abs(ref).max()))


@gpu_test
@pytest.mark.parametrize("form", ["large", "small"])
def test_model_runs_the_swiglu_kernel_compiled(form):
    """With the policy's swiglu threshold lowered, a bf16 prompt of 512 tokens through the serving layout runs
    every MLP's gate/up product in the Mosaic GPU kernel (its custom call in the lowered program; "small": 64
    tokens, the decode-sized form), and its logits are as close to the fp32 forward of the same weights as the
    XLA form's are (RMS error within 1.25x), their argmax that of the XLA form almost everywhere. Measured
    against fp32, not against the XLA form: the two bf16 forms differ by one SiLU rounding, which 4 layers of
    random weights carry to a max logit difference of ~0.4 against a scale of 5, while their RMS errors against
    fp32 are 0.041 (XLA) and 0.040 (kernel) and a kernel with gate and up swapped is ~1.0."""
    cfg = small_config(hidden_size=128, intermediate_size=256)
    bf16_params = init_random_params(cfg, seed=9, dtype=jnp.bfloat16)
    params = fold_norms(bf16_params)
    tokens = 512 if form == "large" else 64
    ids = jnp.asarray(np.random.default_rng(9).integers(0, cfg.vocab_size, (1, tokens)), jnp.int32)
    xla = KernelPolicy(swiglu_min_tokens=None, swiglu_small=False)
    kernel = KernelPolicy(swiglu_min_tokens=256) if form == "large" else KernelPolicy(swiglu_min_tokens=None)

    def runner(policy):
        return jax.jit(lambda p, i: model.forward(p, cfg, i, policy=policy)[0])

    with jax.default_matmul_precision("highest"):  # not TF32: the reference must be well under bf16's noise
        fp32_logits = np.asarray(runner(xla)(fold_norms(cast_params(cfg, bf16_params, jnp.float32)), ids))
    xla_logits = np.asarray(runner(xla)(params, ids).astype(jnp.float32))
    assert "mosaic" not in runner(xla).lower(params, ids).as_text().lower()
    text = runner(kernel).lower(params, ids).as_text().lower()
    assert text.count("mosaic_gpu") >= cfg.num_hidden_layers, text.count("mosaic_gpu")
    kernel_logits = np.asarray(runner(kernel)(params, ids).astype(jnp.float32))

    def rms_error(logits):
        return float(np.sqrt(np.mean((logits - fp32_logits) ** 2)))

    assert rms_error(kernel_logits) <= 1.25 * rms_error(xla_logits), (rms_error(kernel_logits), rms_error(xla_logits))
    assert (kernel_logits.argmax(-1) == xla_logits.argmax(-1)).mean() > 0.95
