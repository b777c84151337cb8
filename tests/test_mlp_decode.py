"""The one-kernel MLP half of a decoder layer (`pallas_kernels/mlp_decode.py`, interpret mode on CPU, compiled
under -m gpu in test_gpu.py) against the XLA chain it replaces in `model.residual_block`: the residual add, the
folded post-attention RMSNorm, gate/up, SiLU * up, down and the final add."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import small_config
from jaxgdn import mlp, paged_forward
from jaxgdn.norms import POST_SCALE_MAX_TOKENS, pre_norm
from jaxgdn.params import MLPParams, init_random_params, serving_layout
from pallas_kernels.mlp_decode import mlp_decode, supported

EPS = 1e-6


def mlp_case(M, H, I, dtype, seed=0):
    """x, h [M, H] and fused gate/up [2I, H], down [H, I] weights at roughly the model's scales."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    x = jax.random.normal(ks[0], (M, H)).astype(dtype)
    h = jax.random.normal(ks[1], (M, H)).astype(dtype)
    w_gate_up = (H**-0.5 * jax.random.normal(ks[2], (2 * I, H))).astype(dtype)
    w_down = (I**-0.5 * jax.random.normal(ks[3], (H, I))).astype(dtype)
    return x, h, w_gate_up, w_down


def xla_chain(x, h, w_gate_up, w_down):
    """The engine's XLA form: (x + h) + mlp(DeferredNorm(x + h)) with the norm's weight folded in."""
    x1 = x + h
    p = MLPParams(gate_proj=None, up_proj=None, down_proj=w_down, fused=w_gate_up)
    return x1 + mlp.mlp(p, pre_norm(x1, None, EPS))


@pytest.mark.parametrize("M, dtype, transposed", [(1, jnp.float32, False), (5, jnp.float32, True),
                                                   (1, jnp.bfloat16, False), (5, jnp.bfloat16, False),
                                                   (2, jnp.bfloat16, True)])
def test_kernel_matches_the_xla_chain(M, dtype, transposed):
    """Every row equals the chain's (`check_against_the_xla_chain`), interpreted at small widths."""
    check_against_the_xla_chain(M, 64, 96, dtype, transposed, interpret=True)


def check_against_the_xla_chain(M, H, I, dtype, transposed, interpret, **kernel_args):
    """The kernel's layer output against the XLA chain's: to fp32 rounding in fp32; in bf16 (the kernel
    rounds where the chain does, the partial sums' order differs) no further from the chain run in fp32 on the
    same values than the bf16 chain is, and within one bf16 step of it. Also run compiled by test_gpu.py."""
    x, h, w_gate_up, w_down = mlp_case(M, H, I, dtype, seed=M)
    chain = jax.jit(xla_chain)
    with jax.default_matmul_precision("highest"):  # fp32 products on a GPU are not TF32 ones
        ref = chain(x, h, w_gate_up, w_down).astype(jnp.float32)
        f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
        truth = chain(f32(x), f32(h), f32(w_gate_up), f32(w_down))
    acc = mlp_decode(x, h, w_gate_up, w_down.T if transposed else w_down, EPS, post_scale=M <= POST_SCALE_MAX_TOKENS,
                     down_transposed=transposed, interpret=interpret, **kernel_args)
    assert acc.shape == (M, H) and acc.dtype == jnp.float32
    assert float(jnp.abs(acc).max()) > 0.1  # the MLP's share is not negligible: a kernel adding nothing fails
    got = ((x + h) + acc.astype(dtype)).astype(jnp.float32)
    scale = float(jnp.abs(ref).max())
    if dtype == jnp.float32:
        assert float(jnp.abs(got - ref).max()) <= 1e-5 * scale
        return
    kernel_err, chain_err = float(jnp.abs(got - truth).max()), float(jnp.abs(ref - truth).max())
    assert kernel_err <= 1.5 * chain_err + 1e-6 * scale, (kernel_err, chain_err)
    assert float(jnp.abs(got - ref).max()) <= 2.0**-7 * scale


def test_use_mlp_kernel_gates():
    """Decode sizes on fused, folded weights only; off when not allowed, past MLP_KERNEL_MAX_TOKENS, with an
    unfolded norm or unfused weights, or at widths the kernel does not take."""
    cfg = small_config()
    folded = serving_layout(init_random_params(cfg, seed=0), True).layers[0]
    plain = init_random_params(cfg, seed=0).layers[0]
    x = jnp.zeros((4, cfg.hidden_size), jnp.float32)
    assert mlp.use_mlp_kernel(folded, x, True)
    assert not mlp.use_mlp_kernel(folded, x, False)
    assert not mlp.use_mlp_kernel(plain, x, True)  # norm weight not folded, gate/up not fused
    big = jnp.zeros((mlp.MLP_KERNEL_MAX_TOKENS + 1, cfg.hidden_size), jnp.float32)
    assert not mlp.use_mlp_kernel(folded, big, True)
    assert not mlp.use_mlp_kernel(folded, x.astype(jnp.bfloat16), True)  # weights in another dtype
    assert supported(1, 64, 96) and not supported(1, 96, 96) and not supported(1, 64, 100)


@pytest.mark.parametrize("spec", [1])
def test_engine_decode_steps_run_the_kernel_and_equal_greedy(monkeypatch, spec):
    """The engine's decode steps (and K=1 verify steps of at most 8 tokens) in the trunk and the MTP layer run
    the kernel (interpret mode: the Pallas impls asked for), and every request equals one-request greedy
    decoding."""
    from helpers import naive_greedy
    from jaxgdn import runner
    from jaxgdn.engine import LLMEngine
    from jaxgdn.engine_config import EngineConfig
    from jaxgdn.request import SamplingParams
    from pallas_kernels import mlp_decode as mlp_decode_module

    calls = []
    traced = mlp_decode_module.mlp_decode

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return traced(*args, **kwargs)

    paged_forward._paged_layer.clear_cache()  # traces cached by earlier tests would skip the counter
    runner._jitted_step.cache_clear()
    monkeypatch.setattr(mlp_decode_module, "mlp_decode", counted)
    cfg = small_config(eos_token_ids=(), linear_value_head_dim=32)
    params = init_random_params(cfg, seed=3)
    rng = np.random.default_rng(4)
    prompts = [[int(t) for t in rng.integers(0, cfg.vocab_size, n)] for n in (3, 11)]
    ecfg = EngineConfig(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64, kv_page_size=16,
                        dtype="float32", num_speculative_tokens=spec, gdn_impl="pallas_pool", attention_impl="pallas",
                        compilation_cache=False)
    eng = LLMEngine(params, cfg, ecfg)
    rids = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=5)) for p in prompts]
    while eng.has_unfinished:
        eng.step()
    for rid, p in zip(rids, prompts):
        assert eng.requests[rid].output_token_ids == naive_greedy(params, cfg, p, 5)
    assert calls and all(shape[0] <= mlp.MLP_KERNEL_MAX_TOKENS for shape in calls), calls
