"""The prefill attention layer's q/k/v kernel (`pallas_kernels/prompt_qkv.py`, interpret mode on CPU, compiled
under -m gpu below) against `attention.project_qkv_gate`, the XLA chain it replaces."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import gpu_test, real_width_config, small_config

from jaxgdn.engine.forward import project_qkv_gate_flat, use_prompt_qkv_kernel
from jaxgdn.model.attention import project_qkv_gate
from jaxgdn.model.params import init_random_params, serving_layout
from jaxgdn.model.policy import KernelPolicy
from pallas_kernels.common import on_gpu
from pallas_kernels.prompt_qkv import _pieces, prompt_qkv_supports


def qkv_case(cfg, R, Q, dtype, seed=0):
    """An attention layer in the serving layout (fused q/k/v weights), its input [R, Q, H] and positions
    starting where each row's earlier tokens end."""
    params = serving_layout(init_random_params(cfg, seed=seed, dtype=dtype), True)
    p = params.layers[cfg.layer_types.index("full_attention")].mixer
    r = np.random.default_rng(seed)
    h = jnp.asarray(r.standard_normal((R, Q, cfg.hidden_size)), dtype)
    starts = np.arange(R) * 37
    positions = jnp.asarray(starts[:, None] + np.arange(Q)[None, :], jnp.int32)
    return p, h, positions


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("config,R,Q", [("small", 3, 40), ("real", 1, 24)])
def test_kernel_matches_the_xla_chain(config, R, Q, dtype):
    """Rows of 40 cells (a last tile of 8 of the kernel's 32) and rows at the 0.8B head widths (256 dims,
    64 rotated, 8 query and 2 KV heads): q, k, v and the gate as the XLA chain makes them, rounded alike."""
    cfg = small_config() if config == "small" else real_width_config()
    p, h, positions = qkv_case(cfg, R, Q, dtype)
    on = KernelPolicy(attention_kernels=True)
    assert use_prompt_qkv_kernel(p, cfg, on) and not use_prompt_qkv_kernel(p, cfg, KernelPolicy())
    flat = lambda a: a.reshape(R * Q, *a.shape[2:])  # noqa: E731  the step's stream: rows one after another
    got = jax.jit(lambda h: project_qkv_gate_flat(p, cfg, flat(h), flat(positions), on))(h)
    want = [flat(x) for x in jax.jit(lambda h: project_qkv_gate(p, cfg, h, positions))(h)]
    # bf16: the kernel rounds where the chain does, but XLA may keep a product in fp32 (excess precision)
    atol = 1e-5 if dtype == jnp.float32 else 2e-2
    for name, g, w in zip("qkvg", got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), atol=atol, rtol=atol,
                                   err_msg=name)
    if dtype == jnp.bfloat16 and not on_gpu():  # nearly every element equal, not just close (XLA on a GPU
        # may skip the chain's bf16 roundings inside a fusion)
        q_got, q_want = (np.asarray(x, np.float32) for x in (got[0], want[0]))
        assert np.mean(q_got == q_want) > 0.98


def test_head_pieces_cover_the_head_in_power_of_two_tiles():
    assert _pieces(256, 64) == ((0, 32), (32, 32), (64, 128), (192, 64))
    assert _pieces(32, 8) == ((0, 4), (4, 4), (8, 16), (24, 8))
    for D, rot in ((256, 64), (128, 128), (96, 32)):
        pieces = _pieces(D, rot)
        assert sum(w for _, w in pieces) == D and all(w & (w - 1) == 0 for _, w in pieces)
        assert [s for s, _ in pieces] == list(np.cumsum([0] + [w for _, w in pieces])[:-1])
    assert prompt_qkv_supports(256, 64) and not prompt_qkv_supports(256, 0) and not prompt_qkv_supports(64, 12)


@gpu_test
@pytest.mark.parametrize("R, Q, dtype", [(1, 2048, "bfloat16"), (2, 300, "bfloat16"), (2, 300, "float32")])
def test_prompt_qkv_kernel_compiled_at_the_0_8b_widths_equals_the_xla_chain(R, Q, dtype):
    """The prefill q/k/v kernel compiled at the 0.8B layer's widths against the compiled XLA chain; 300 cells
    end on a part tile. test_prompt_qkv.py runs the smaller cases interpreted on CPU."""
    test_kernel_matches_the_xla_chain("real", R, Q, jnp.dtype(dtype).type)
