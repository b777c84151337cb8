"""Pallas GDN kernels (interpret mode on CPU, compiled under -m gpu below) against the scan reference."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import gpu_test
from test_gdn_core import random_inputs

from jaxgdn.model.norms import gated_rms_norm
from pallas_kernels.gdn import gated_delta_rule, gdn_recurrent_checkpoints, gdn_recurrent_reference
from pallas_kernels.gdn_chunked import gdn_chunked_pallas
from pallas_kernels.gdn_pallas import GateSource, OutputGate, gdn_recurrent_pallas


def pack_qkv(q, k, v):
    """q, k [B, T, Hk, dk], v [B, T, Hv, dv] -> the conv output layout [B, T, q‖k‖v] the pool kernel reads."""
    flat = lambda x: x.reshape(*x.shape[:2], -1)  # noqa: E731
    return jnp.concatenate([flat(q), flat(k), flat(v)], axis=-1)


def max_err(a, b):
    return float(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32)).max())


@pytest.mark.parametrize("T", [1, 4, 37])
def test_recurrent_kernel_with_checkpoints_equals_scan(T):
    """Non-power-of-two dv (24) is padded inside; GVA with Hv = 2 Hk; one checkpoint per position."""
    q, k, v, g, beta, s0 = random_inputs(T=T, seed=T)
    o_ref, s_ref, states_ref = gdn_recurrent_checkpoints(q, k, v, g, beta, s0)
    o, s, states = gdn_recurrent_pallas(q, k, v, g, beta, s0, keep_states=True)
    assert o.shape == o_ref.shape and states.shape == states_ref.shape == (2, T, 4, 16, 24)
    assert max_err(o, o_ref) <= 1e-5 and max_err(s, s_ref) <= 1e-5 and max_err(states, states_ref) <= 1e-5


@pytest.mark.parametrize("T", [1, 64, 130])
def test_chunked_kernel_equals_scan(T):
    """Chunk boundaries (64), a partial last chunk, and every row of the batch from its own state."""
    q, k, v, g, beta, s0 = random_inputs(T=T, seed=100 + T)
    o_ref, s_ref = gdn_recurrent_reference(q, k, v, g, beta, s0)
    o, s = gdn_chunked_pallas(q, k, v, g, beta, s0)
    assert max_err(o, o_ref) <= 1e-5 and max_err(s, s_ref) <= 1e-5
    # Rows are independent: running row 1 alone gives the same row.
    one = lambda x: x[1:2]  # noqa: E731
    o1, s1 = gdn_chunked_pallas(*(one(x) for x in (q, k, v, g, beta, s0)))
    assert max_err(o1[0], o[1]) <= 1e-6 and max_err(s1[0], s[1]) <= 1e-6


@pytest.mark.parametrize("block_v, warps", [(None, (2, 4, 4)), (32, (2, 8, 4)), (128, (8, 2, 8))])
def test_chunked_kernel_tiles_of_a_128_wide_head_equal_scan(block_v, warps):
    """dv = 128 as in the 0.8B: the scan splits it into other tiles, on other warp counts."""
    q, k, v, g, beta, s0 = random_inputs(B=1, T=70, Hk=1, Hv=2, dk=32, dv=128, seed=7)
    o_ref, s_ref = gdn_recurrent_reference(q, k, v, g, beta, s0)
    o, s = gdn_chunked_pallas(q, k, v, g, beta, s0, block_v=block_v, warps=warps)
    assert max_err(o, o_ref) <= 1e-5 and max_err(s, s_ref) <= 1e-5


@pytest.mark.parametrize("dtype, dv", [(jnp.float32, 32), (jnp.bfloat16, 24)])
def test_chunked_kernel_with_the_gated_norm_fused_equals_the_layer_norm(dtype, dv):
    """gate=(z, weight, eps): the output kernel's gated RMS norm against norms.gated_rms_norm of the plain
    kernel's output (dv 24 pads the head to 32: the norm's mean must ignore the zero columns); T = 70
    pads the last chunk. The state is unchanged."""

    q, k, v, g, beta, s0 = random_inputs(B=2, T=70, Hk=1, Hv=2, dk=16, dv=dv, seed=1)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    z = jax.random.normal(jax.random.PRNGKey(5), v.shape).astype(dtype)
    weight = 1 + 0.1 * jax.random.normal(jax.random.PRNGKey(6), (dv,))
    o, s = gdn_chunked_pallas(q, k, v, g, beta, s0)
    want = gated_rms_norm(o.astype(dtype), z, weight, 1e-6, dtype)
    got, s_fused = gdn_chunked_pallas(q, k, v, g, beta, s0, gate=(z, weight, 1e-6))
    assert got.dtype == dtype and got.shape == want.shape
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    assert max_err(got.astype(jnp.float32), want.astype(jnp.float32)) <= tol
    assert max_err(s_fused, s) == 0.0


def test_output_in_the_scan_equals_the_reference():
    """The output's products in the scan's loop (their state-independent parts from `_output_parts_kernel`):
    against the reference with a partial last chunk, GVA and dv 24 padded; finite under strong decay."""
    q, k, v, g, beta, s0 = random_inputs(T=130, seed=230)
    o_ref, s_ref = gdn_recurrent_reference(q, k, v, g, beta, s0)
    o, s = gdn_chunked_pallas(q, k, v, g, beta, s0)
    assert max_err(o, o_ref) <= 1e-5 and max_err(s, s_ref) <= 1e-5
    q, k, v, g, beta, s0 = random_inputs(T=128, decay=(5.0, 30.0), seed=3)
    o, s = gdn_chunked_pallas(q, k, v, g, beta, s0)
    o_ref, s_ref = gdn_recurrent_reference(q, k, v, g, beta, s0)
    assert bool(jnp.isfinite(o).all()) and max_err(o, o_ref) <= 1e-5 and max_err(s, s_ref) <= 1e-5


def test_fused_norm_reads_the_gates_in_place_from_a_wider_array():
    """OutputGate(z_source, weight, eps, z_offset): value head h's gate at columns z_offset + h * dv of a
    [B, T, C] array (the fused projection's product, which the layer passes without slicing) gives the
    same output as the [B, T, Hv, dv] gates."""
    T = 64
    q, k, v, g, beta, s0 = random_inputs(B=2, T=T, Hk=1, Hv=2, dk=16, dv=32, seed=2)
    z = jax.random.normal(jax.random.PRNGKey(7), v.shape)
    weight = 1 + 0.1 * jax.random.normal(jax.random.PRNGKey(8), (32,))
    before, after = (jax.random.normal(jax.random.PRNGKey(s), (2, T, n)) for s, n in ((9, 40), (10, 8)))
    source = jnp.concatenate([before, z.reshape(2, T, -1), after], axis=-1)
    want, _ = gdn_chunked_pallas(q, k, v, g, beta, s0, gate=OutputGate(z, weight, 1e-6))
    got, _ = gdn_chunked_pallas(q, k, v, g, beta, s0, gate=OutputGate(source, weight, 1e-6, z_offset=40))
    assert max_err(got, want) == 0.0


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_chunked_kernel_computes_the_gates_from_the_projection_in_place(dtype):
    check_gates_from_source(dtype)


def check_gates_from_source(dtype):
    """gates=GateSource(source, b_offset, A_log, dt_bias, num_valid): the prep kernel reads b and a out of a
    wider array (the fused projection's product) and computes g, beta and the padding mask as
    `jaxgdn.model.gdn.gdn_gates` and `gdn_projections` do in XLA. T = 70 pads the last chunk past the source's
    rows; row 1 has 41 real tokens. Output and state equal the kernel fed XLA's g and beta."""
    from types import SimpleNamespace

    from jaxgdn.model.gdn import gdn_gates

    B, T, Hv = 2, 70, 2
    q, k, v, _, _, s0 = random_inputs(B=B, T=T, Hk=1, Hv=Hv, dk=16, dv=32, seed=11)
    key = jax.random.PRNGKey(12)
    b_raw, a_raw, before, after = (jax.random.normal(jax.random.fold_in(key, i), (B, T, n)).astype(dtype)
                                   for i, n in enumerate((Hv, Hv, 24, 8)))
    source = jnp.concatenate([before, b_raw, a_raw, after], axis=-1)
    mixer = SimpleNamespace(A_log=jnp.log(jnp.array([0.5, 4.0])), dt_bias=jnp.array([0.3, -1.0], dtype))
    num_valid = jnp.array([T, 41])
    g, beta = gdn_gates(mixer, a_raw, b_raw)
    real = (jnp.arange(T)[None, :] < num_valid[:, None])[..., None]
    g, beta = jnp.where(real, g, 0.0), jnp.where(real, beta, 0.0)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    want, want_s = gdn_chunked_pallas(q, k, v, g, beta, s0)
    got, got_s = gdn_chunked_pallas(q, k, v, None, None, s0,
                                    gates=GateSource(source, 24, mixer.A_log, mixer.dt_bias, num_valid))
    assert max_err(got, want) <= 1e-5 * max(1.0, float(jnp.abs(want).max()))
    assert max_err(got_s, want_s) <= 1e-5 * max(1.0, float(jnp.abs(want_s).max()))
    with pytest.raises(ValueError, match="g = beta = None"):
        gdn_chunked_pallas(q, k, v, g, beta, s0, gates=GateSource(source, 24, mixer.A_log, mixer.dt_bias))
    with pytest.raises(ValueError, match="b and a columns"):  # the a columns would run past the source
        gdn_chunked_pallas(q, k, v, None, None, s0, gates=GateSource(source, 34, mixer.A_log, mixer.dt_bias))
    # jitted as the layer runs it (compiled on a GPU: the gpu tests below)
    got_jit, _ = jax.jit(lambda src, n: gdn_chunked_pallas(q, k, v, None, None, s0, gates=GateSource(
        src, 24, mixer.A_log, mixer.dt_bias, n)))(source, num_valid)
    assert max_err(got_jit, want) <= 1e-5 * max(1.0, float(jnp.abs(want).max()))


def test_gate_needs_the_chunked_kernel():
    q, k, v, g, beta, s0 = random_inputs(T=5)
    gate = OutputGate(jnp.ones(v.shape), jnp.ones(v.shape[-1]), 1e-6)
    with pytest.raises(ValueError, match="chunked Pallas kernel"):
        gated_delta_rule(q, k, v, g, beta, s0, impl="chunked", gate=gate)


def test_gdn_layer_with_the_norm_in_the_kernel_equals_the_xla_norm():
    """impl "pallas": the layer hands its gated norm to the chunked kernel, which reads z out of the fused
    projection's product (the engine's params); output and state equal the XLA chunked form with the norm
    in XLA, padded rows included. (Unfused params pass z itself: the kernel tests above.)"""
    from helpers import small_config

    from jaxgdn.model.config import LINEAR_ATTENTION
    from jaxgdn.model.gdn import gdn_inputs, gdn_layer
    from jaxgdn.model.params import fuse_projections, init_random_params
    from pallas_kernels.gdn import runs_chunked_pallas

    cfg = small_config()
    params = fuse_projections(init_random_params(cfg, seed=3))
    p = params.layers[cfg.layer_types.index(LINEAR_ATTENTION)].mixer
    assert runs_chunked_pallas("pallas", 40) and not runs_chunked_pallas("chunked", 40)
    x = jax.random.normal(jax.random.PRNGKey(4), (2, 40, cfg.hidden_size))
    num_valid = jnp.array([40, 23])
    assert gdn_inputs(p, cfg, x, jnp.zeros((2, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim)), num_valid,
                      impl="pallas").gates is not None  # the prep kernel computes g and beta in place
    want, want_state = gdn_layer(p, cfg, x, None, impl="chunked", num_valid=num_valid)
    got, got_state = gdn_layer(p, cfg, x, None, impl="pallas", num_valid=num_valid)
    assert max_err(got, want) <= 1e-4 * max(1.0, float(jnp.abs(want).max()))
    assert max_err(got_state.ssm, want_state.ssm) <= 1e-5
    np.testing.assert_allclose(np.asarray(got_state.conv), np.asarray(want_state.conv), rtol=1e-6, atol=1e-6)


def test_chunked_kernel_strong_decay_is_finite():
    q, k, v, g, beta, s0 = random_inputs(T=128, decay=(5.0, 30.0), seed=3)
    o, s = gdn_chunked_pallas(q, k, v, g, beta, s0)
    o_ref, s_ref = gdn_recurrent_reference(q, k, v, g, beta, s0)
    assert bool(jnp.isfinite(o).all()) and max_err(o, o_ref) <= 1e-5 and max_err(s, s_ref) <= 1e-5


def test_kernels_in_bf16_stay_close_to_fp32_reference():
    """bf16 q/k/v (the served dtype): matmuls on bf16 operands, fp32 state; error at bf16 scale."""
    q, k, v, g, beta, s0 = random_inputs(B=1, T=70, Hk=2, Hv=2, dk=32, dv=32, seed=9)
    o_ref, s_ref = gdn_recurrent_reference(q, k, v, g, beta, s0)
    bf = lambda x: x.astype(jnp.bfloat16)  # noqa: E731
    for fn in (gdn_chunked_pallas, gdn_recurrent_pallas):
        o, s = fn(bf(q), bf(k), bf(v), g, beta, s0)[:2]
        scale = float(jnp.abs(o_ref).max())
        assert max_err(o, o_ref) <= 3e-2 * scale, fn.__name__
        assert max_err(s, s_ref) <= 3e-2 * float(jnp.abs(s_ref).max()), fn.__name__


def test_chunked_kernel_returns_o_in_the_dtype_asked_for():
    """out_dtype=bf16 (fla's output dtype, what `bench kernels` compares): the fp32 output rounded once,
    the state unchanged. The gated norm's output is in z's dtype: out_dtype there is refused."""
    q, k, v, g, beta, s0 = random_inputs(B=1, T=70, Hk=2, Hv=2, dk=32, dv=32, seed=11)
    o32, s32 = gdn_chunked_pallas(q, k, v, g, beta, s0)
    o16, s16 = gdn_chunked_pallas(q, k, v, g, beta, s0, out_dtype=jnp.bfloat16)
    assert o32.dtype == jnp.float32 and o16.dtype == jnp.bfloat16
    assert bool(jnp.all(o16 == o32.astype(jnp.bfloat16))) and max_err(s16, s32) == 0.0
    z = jnp.ones((1, 70, 2, 32), jnp.float32)
    with pytest.raises(ValueError, match="z's dtype"):
        gdn_chunked_pallas(q, k, v, g, beta, s0, gate=(z, jnp.ones(32), 1e-6), out_dtype=jnp.bfloat16)


def test_pallas_impls_are_registered():
    q, k, v, g, beta, s0 = random_inputs(T=5)
    o_ref, s_ref = gdn_recurrent_reference(q, k, v, g, beta, s0)
    for impl in ("pallas", "pallas_recurrent"):
        o, s = gated_delta_rule(q, k, v, g, beta, s0, impl=impl)
        assert max_err(o, o_ref) <= 1e-5 and max_err(s, s_ref) <= 1e-5


@pytest.mark.parametrize("kernel", ["chunked", "chunked-gated", "recurrent", "pooled", "pooled-gates"])
def test_kernels_lower_to_triton_without_a_gpu(kernel):
    """Lowering for CUDA runs the Pallas Triton lowering on CPU: a primitive Triton cannot express fails
    here, in CI, instead of on the device."""
    q, k, v, g, beta, s0 = random_inputs(B=1, T=70, Hk=2, Hv=4, dk=128, dv=128)
    bf = lambda x: x.astype(jnp.bfloat16)  # noqa: E731
    if kernel == "chunked":
        fn = lambda *a: gdn_chunked_pallas(*a, interpret=False)  # noqa: E731
    elif kernel == "chunked-gated":
        z = jnp.ones((1, 70, 4, 128), jnp.bfloat16)
        fn = lambda *a: gdn_chunked_pallas(*a, interpret=False, gate=(z, jnp.ones(128), 1e-6))  # noqa: E731
    elif kernel == "recurrent":
        fn = lambda *a: gdn_recurrent_pallas(*a, keep_states=True, interpret=False)  # noqa: E731
    else:
        from pallas_kernels.gdn_pallas import gdn_recurrent_pooled

        pool, slots = jnp.zeros((3, 2, 4, 128, 128)), jnp.array([2])
        flag = jnp.array([True])
        gates = None
        if kernel == "pooled-gates":  # g and beta formed from a projection's b and a columns in the kernel
            gates = GateSource(jnp.ones((1, 70, 16), jnp.bfloat16), 8, jnp.ones(4), jnp.ones(4), jnp.array([60]))
        fn = lambda q, k, v, g, b, _: gdn_recurrent_pooled(  # noqa: E731
            pack_qkv(q, k, v), None if gates else g, None if gates else b, pool, slots, slots - 1, flag, flag,
            interpret=False, gates=gates)
    text = jax.jit(fn).trace(bf(q), bf(k), bf(v), g, beta, s0).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text.lower()


def test_scan_pipeline_depth_fits_the_shared_memory():
    """fp32 inputs at dk = 128: the scan's 3-stage pipeline would ask 240 KiB of the H200's 227 KiB and not
    compile; the depth is lowered to 2 there, kept for bf16, and the lowered call carries it."""
    from pallas_kernels.gdn_chunked import SCAN_SHARED_MEMORY_BUDGET, scan_pipeline_depth

    assert scan_pipeline_depth(3, 128, 16, 4) == 2
    assert scan_pipeline_depth(3, 128, 16, 2) == 3
    assert scan_pipeline_depth(2, 128, 64, 2) == 2
    assert scan_pipeline_depth(3, 1024, 128, 4) == 1  # nothing fits: no pipelining
    for stages in (1, 2, 3):  # whatever it returns fits, or is the unpipelined loop
        for dk, bv, size in [(128, 16, 4), (256, 64, 4), (128, 128, 2)]:
            d = scan_pipeline_depth(stages, dk, bv, size)
            assert 1 <= d <= stages
            assert d == 1 or (d - 1) * 64 * (3 * dk + bv + 64) * size <= SCAN_SHARED_MEMORY_BUDGET
    q, k, v, g, beta, s0 = random_inputs(B=1, T=70, Hk=2, Hv=4, dk=128, dv=128)

    def scan_stages(dtype):
        fn = lambda *a: gdn_chunked_pallas(*a, interpret=False, scan_stages=3)  # noqa: E731
        args = (q.astype(dtype), k.astype(dtype), v.astype(dtype), g, beta, s0)
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        return {int(n) for n in re.findall(r"num_stages = (\d+)", text)} - {1}  # the other kernels run 1

    assert scan_stages(jnp.float32) == {2} and scan_stages(jnp.bfloat16) == {3}


def gates_in_product(g, beta, T, rng):
    """A GateSource over a product y [B, T, 5 + 2 * Hv] with b and a at columns 3 .. 3 + 2 * Hv, with A_log,
    dt_bias and num_valid [B] (row 1 padded after its first token), and the (g, beta) that
    `jaxgdn.model.gdn.gdn_projections` forms from them (zero past num_valid). g, beta give the shape."""
    from jaxgdn.model.gdn import gdn_gates
    from jaxgdn.model.params import GDNParams

    B, _, Hv = g.shape
    y = jnp.asarray(rng.standard_normal((B, T, 5 + 2 * Hv)), jnp.float32)
    A_log, dt_bias = (jnp.asarray(rng.standard_normal(Hv), jnp.float32) for _ in range(2))
    num_valid = jnp.asarray([T, 1] + [T] * (B - 2))
    p = GDNParams(**{f: None for f in GDNParams.__dataclass_fields__} | {"A_log": A_log, "dt_bias": dt_bias})
    g, beta = gdn_gates(p, y[..., 3 + Hv : 3 + 2 * Hv], y[..., 3 : 3 + Hv])  # gdn_gates(p, a, b)
    valid = (jnp.arange(T)[None, :] < num_valid[:, None])[..., None]
    gates = GateSource(y, 3, A_log, dt_bias, num_valid)
    return gates, jnp.where(valid, g, 0.0), jnp.where(valid, beta, 0.0)


def check_pooled_kernel(T, B=4, Hk=2, Hv=4, dk=16, dv=32, W=3, tol=1e-5, from_product=False, **options):
    """Rows read pool[slot, start] (zeros when fresh); verify rows write the state after each window
    position to checkpoints 0..min(T, W)-1, other rows write their final state to checkpoint 0; other
    slots and checkpoints are untouched. Rows alternate verify / not, every third is fresh; errors are
    relative to the largest reference value. options: the kernel's program-shape keywords; from_product: the
    kernel forms g and beta from an in_proj product's b and a columns (row 1 padded after one token)."""
    from pallas_kernels.gdn_pallas import gdn_recurrent_pooled

    q, k, v, g, beta, _ = random_inputs(B=B, T=T, Hk=Hk, Hv=Hv, dk=dk, dv=dv, seed=5 + T)
    rng = np.random.default_rng(1)
    pool = jnp.asarray(rng.standard_normal((B + 2, W, Hv, dk, dv)), jnp.float32)
    slots = jnp.asarray(rng.permutation(B + 2)[:B])
    start = jnp.asarray(rng.integers(0, W, B))
    fresh, verify = jnp.arange(B) % 3 == 2, jnp.arange(B) % 2 == 0
    if from_product:  # b and a in an in_proj product, the gates formed in the kernel (`gates_in_product`)
        gates, g, beta = gates_in_product(g, beta, T, rng)
        run = jax.jit(lambda qkv, *a: gdn_recurrent_pooled(qkv, None, None, *a, **options, gates=gates))
        o, new = run(pack_qkv(q, k, v), pool, slots, start, fresh, verify)
    else:
        run = jax.jit(lambda *a: gdn_recurrent_pooled(*a, **options))
        o, new = run(pack_qkv(q, k, v), g, beta, pool, slots, start, fresh, verify)
    expect = np.asarray(pool).copy()
    rel = lambda a, b: max_err(a, b) / max(float(jnp.abs(b).max()), 1.0)  # noqa: E731
    with jax.default_matmul_precision("highest"):
        for b in range(B):
            s0 = jnp.zeros_like(pool[0, 0]) if fresh[b] else pool[slots[b], start[b]]
            o_ref, s_ref, states = gdn_recurrent_checkpoints(*(x[b : b + 1] for x in (q, k, v, g, beta)), s0[None])
            assert rel(o[b], o_ref[0]) <= tol, b
            if verify[b]:
                expect[int(slots[b]), : min(T, W)] = np.asarray(states[0, :W])
            else:
                expect[int(slots[b]), 0] = np.asarray(s_ref[0])
    assert rel(new, expect) <= tol


@pytest.mark.parametrize("T, options", [(3, {}), (1, {}), (4, {}),
                                        (3, {"block_v": 16, "evict_first": False, "num_warps": 4}),
                                        (1, {"from_product": True}), (3, {"from_product": True})])
def test_pooled_kernel_reads_the_start_checkpoint_and_writes_in_place(T, options):
    """See check_pooled_kernel. T = 1 (decode) has its own store path; T = 4 runs past the 3 checkpoints
    (a verify row keeps the first 3); the options (a narrower dv tile, no cache hints, 4 warps at T = 3)
    change only how the kernel runs; from_product: the gates formed in the kernel, as the engine's chain does."""
    check_pooled_kernel(T, **options)


def test_engine_with_pool_kernel_equals_plain_greedy():
    """PD + MTP K=2 on the ragged GDN kernels (interpret mode): short rows (decode, verify windows, prompt
    tails, short chunks) on the token loop over the pool, the longer prompt chunks on the chunked form;
    every request equals one-request greedy decoding."""
    from helpers import naive_greedy, small_config

    from jaxgdn.engine.config import EngineConfig
    from jaxgdn.engine.request import SamplingParams
    from jaxgdn.engine.workers import DecodeWorker, PrefillWorker, run_disaggregated
    from jaxgdn.model.params import init_random_params

    cfg = small_config(eos_token_ids=(), linear_value_head_dim=32)
    params = init_random_params(cfg, seed=7)
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(0, cfg.vocab_size, n)] for n in (1, 2, 5, 9, 23)]
    ecfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, kv_page_size=4,
                        dtype="float32", num_speculative_tokens=2, pd=True, gdn_impl="pallas")
    P = PrefillWorker(params, cfg, ecfg, garbage_seed=1)
    D = DecodeWorker(params, cfg, ecfg, garbage_seed=2)  # garbage in the slots: fresh rows must ignore it
    sp = SamplingParams(temperature=0, max_tokens=5)
    rids = run_disaggregated(P, D, prompts, [sp] * len(prompts))
    for r, p in zip(rids, prompts):
        assert D.output(r).token_ids == naive_greedy(params, cfg, p, 5)


@gpu_test
@pytest.mark.parametrize("shape", [(2, 37, 2, 4, 16, 24), (1, 300, 4, 4, 128, 128), (3, 130, 2, 4, 64, 128)])
def test_pallas_gdn_kernels_compiled_equal_reference(shape):
    """The Triton-lowered GDN kernels against the fp32 scan reference (fp32 inputs: IEEE matmuls), and the
    chunked kernel on bf16 inputs (bf16 tensor cores, the solve's block combination on TF32) against the
    reference on the same rounded inputs, with and without the gated norm."""

    B, T, Hk, Hv, dk, dv = shape
    q, k, v, g, beta, s0 = random_inputs(B=B, T=T, Hk=Hk, Hv=Hv, dk=dk, dv=dv, seed=T)
    with jax.default_matmul_precision("highest"):
        o_ref, s_ref, states_ref = jax.jit(gdn_recurrent_checkpoints)(q, k, v, g, beta, s0)
    err = lambda a, b: float(jnp.abs(a - b).max() / jnp.abs(b).max())  # noqa: E731
    for stages in (2, 3):  # the scan's two pipeline depths (large and small grids; fp32 at dk=128 fits 2 only)
        o, s = jax.jit(functools.partial(gdn_chunked_pallas, scan_stages=stages))(q, k, v, g, beta, s0)
        assert err(o, o_ref) <= 1e-4 and err(s, s_ref) <= 1e-4, stages
    bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    with jax.default_matmul_precision("highest"):
        o_bf_ref, s_bf_ref = jax.jit(gdn_recurrent_checkpoints)(*(x.astype(jnp.float32) for x in bf), g, beta, s0)[:2]
    o_bf, s_bf = jax.jit(gdn_chunked_pallas)(*bf, g, beta, s0)
    assert err(o_bf, o_bf_ref) <= 3e-2 and err(s_bf, s_bf_ref) <= 3e-2
    z = jax.random.normal(jax.random.PRNGKey(T), o.shape)
    want = gated_rms_norm(o, z, jnp.ones(dv), 1e-6, jnp.float32)
    got, _ = jax.jit(lambda *a: gdn_chunked_pallas(*a, gate=(z, jnp.ones(dv), 1e-6)))(q, k, v, g, beta, s0)
    assert err(got, want) <= 1e-4
    o, s, states = jax.jit(lambda *a: gdn_recurrent_pallas(*a, keep_states=True))(q, k, v, g, beta, s0)
    assert err(o, o_ref) <= 1e-4 and err(s, s_ref) <= 1e-4 and err(states, states_ref) <= 1e-4


@gpu_test
def test_chunked_kernel_gates_from_the_projection_compiled():
    """The prep kernel's in-place gates (GateSource) compiled: against the kernel fed XLA's g and beta."""
    for dtype in (jnp.float32, jnp.bfloat16):
        check_gates_from_source(dtype)


@gpu_test
@pytest.mark.parametrize("T, B, from_product", [(1, 64, False), (2, 32, False), (4, 8, False), (1, 64, True),
                                                (3, 32, True)])
def test_gdn_pool_kernel_compiled_at_the_0_8b_widths_equals_reference(T, B, from_product):
    """The in-place pool kernel as the engine runs it (dv tiles of `_value_block`, `pool_warps(T)` warps,
    evict-first hints; decode rows on the one-store path, verify windows on masked per-position stores; the
    gates given or formed from the projection) against the fp32 reference: reads the start checkpoint, writes
    checkpoints in place, leaves the rest."""
    check_pooled_kernel(T, B=B, Hk=16, Hv=16, dk=128, dv=128, W=4, tol=1e-4, from_product=from_product)
