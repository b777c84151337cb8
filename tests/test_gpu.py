"""GPU-only checks (pytest -m gpu): compiled kernels against their references, and the PD + MTP engine
with the Triton and Pallas input-assembly kernels against plain greedy decoding."""

import functools

import jax
import numpy as np
import pytest
from helpers import naive_greedy, outside_sampling_support, shipped_model, small_config

from jaxgdn.engine.config import EngineConfig
from jaxgdn.engine.request import SamplingParams
from jaxgdn.engine.workers import DecodeWorker, PrefillWorker, run_disaggregated
from jaxgdn.model.params import init_random_params

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")]


@pytest.mark.parametrize("input_impl, dv, gdn_impl", [("triton", 24, "auto"), ("pallas", 24, "auto"), ("pallas", 32, "auto"),
                                                     ("pallas", 32, "xla")])
def test_pd_mtp_engine_on_gpu_equals_plain_greedy(input_impl, dv, gdn_impl):
    """auto with dv 32: the ragged GDN kernels (short rows on the pool in place, long rows chunked); dv 24 (not
    a tile, so the pool cannot be read in place) and xla: the XLA recurrence; the attention kernels either way."""
    cfg = small_config(eos_token_ids=(), linear_value_head_dim=dv)
    params = init_random_params(cfg, seed=2)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, 256, n)] for n in (1, 2, 3, 5, 9, 17, 40, 70)]
    ecfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, kv_page_size=8,
                        dtype="float32", num_speculative_tokens=2, pd=True, gdn_impl=gdn_impl)
    P = PrefillWorker(params, cfg, ecfg, input_impl=input_impl, garbage_seed=1)
    D = DecodeWorker(params, cfg, ecfg, input_impl=input_impl, garbage_seed=2)
    sp = SamplingParams(temperature=0, max_tokens=6)
    rids = run_disaggregated(P, D, prompts, [sp] * len(prompts))
    for r, p in zip(rids, prompts):
        assert D.output(r).token_ids == naive_greedy(params, cfg, p, 6)


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs two devices")
def test_pd_across_two_devices():
    """Prefill worker on device 0, decode worker on device 1: handoffs cross devices, outputs unchanged."""
    import tempfile

    from jaxgdn import LLM
    from jaxgdn.model.checkpoint import save_checkpoint

    cfg = small_config(eos_token_ids=())
    params = init_random_params(cfg, seed=4)
    with tempfile.TemporaryDirectory() as d:
        save_checkpoint(d, cfg, params)
        ecfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, kv_page_size=8,
                            dtype="float32", num_speculative_tokens=1, pd=True, prefill_device=0, decode_device=1)
        llm = LLM(d, ecfg, handoff_transport="bytes")
        assert llm.prefill_worker.runner.device != llm.engine.runner.device
        rng = np.random.default_rng(1)
        prompts = [[int(t) for t in rng.integers(0, 256, n)] for n in (2, 7, 30, 4)]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert [o.token_ids for o in outs] == [naive_greedy(params, cfg, p, 5) for p in prompts]
    assert llm.metrics()["handoff_bytes"] > 0


@pytest.mark.parametrize("shape", [(2, 37, 2, 4, 16, 24), (1, 300, 4, 4, 128, 128), (3, 130, 2, 4, 64, 128)])
def test_pallas_gdn_kernels_compiled_equal_reference(shape):
    """The Triton-lowered GDN kernels against the fp32 scan reference (fp32 inputs: IEEE matmuls), and the
    chunked kernel on bf16 inputs (bf16 tensor cores, the solve's block combination on TF32) against the
    reference on the same rounded inputs, with and without the gated norm."""
    import jax.numpy as jnp
    from test_gdn_core import random_inputs

    from jaxgdn.model.norms import gated_rms_norm
    from pallas_kernels.gdn import gdn_recurrent_checkpoints
    from pallas_kernels.gdn_chunked import gdn_chunked_pallas
    from pallas_kernels.gdn_pallas import gdn_recurrent_pallas

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


def test_chunked_kernel_gates_from_the_projection_compiled():
    """The prep kernel's in-place gates (GateSource) compiled: against the kernel fed XLA's g and beta."""
    import jax.numpy as jnp
    from test_gdn_pallas import check_gates_from_source

    for dtype in (jnp.float32, jnp.bfloat16):
        check_gates_from_source(dtype)


@pytest.mark.parametrize("T, B, from_product", [(1, 64, False), (2, 32, False), (4, 8, False), (1, 64, True),
                                                (3, 32, True)])
def test_gdn_pool_kernel_compiled_at_the_0_8b_widths_equals_reference(T, B, from_product):
    """The in-place pool kernel as the engine runs it (dv tiles of `_value_block`, `pool_warps(T)` warps,
    evict-first hints; decode rows on the one-store path, verify windows on masked per-position stores; the
    gates given or formed from the projection) against the fp32 reference: reads the start checkpoint, writes
    checkpoints in place, leaves the rest."""
    from test_gdn_pallas import check_pooled_kernel

    check_pooled_kernel(T, B=B, Hk=16, Hv=16, dk=128, dv=128, W=4, tol=1e-4, from_product=from_product)


@pytest.mark.parametrize("T, K, dtype", [(1, 0, "bfloat16"), (3, 2, "bfloat16"), (4, 3, "float32")])
def test_gdn_mixer_kernel_compiled_at_the_0_8b_widths_equals_the_unfused_chain(T, K, dtype):
    """The one-kernel GDN mixer compiled at the 0.8B layer's head widths (Hk = Hv = 16, dk = dv = 128: one
    whole state tile per program) against the compiled unfused chain; test_gdn_mixer.py runs the smaller
    cases (and, interpreted, on CPU)."""
    import jax.numpy as jnp
    from test_gdn_mixer import assert_same_rows, mixer_case, run_rows

    dt = jnp.dtype(dtype)
    case = mixer_case(T, K, dt, seed=T, Hk=16, Hv=16, dk=128, dv=128)
    want = run_rows(False, *case)
    got = run_rows(True, *case)
    assert_same_rows(got, want, case[3], 2e-2 if dt == jnp.bfloat16 else 1e-4)


@pytest.mark.parametrize("Q, dtype, pages_per_tile, form", [
    (1, "bfloat16", 1, "head"), (1, "bfloat16", 2, "head"), (4, "bfloat16", 1, "head"), (4, "bfloat16", 2, "head"),
    (2, "float32", None, "head"), (1, "bfloat16", 1, "grouped"), (4, "bfloat16", 2, "grouped"),
    (2, "float32", None, "grouped"), (1, "bfloat16", 1, "split"), (4, "bfloat16", 2, "split"),
    (2, "float32", None, "split")])
def test_decode_attention_kernel_compiled_at_the_0_8b_widths_equals_the_xla_chain(Q, dtype, pages_per_tile, form):
    """The one-kernel decode attention compiled at the 0.8B layer's widths (Hq = 8, Hkv = 2, D = 256, RoPE over
    64) against the compiled XLA path, on tiles of one and two pages (None: the layout rule's pick), one program
    per query head or per KV head (grouped), or that with each row's page tiles split over programs (split);
    test_decode_attention.py runs the smaller cases interpreted on CPU."""
    import jax.numpy as jnp
    from test_decode_attention import assert_same_layer, attention_case, layout_for, run_layer

    dt = jnp.dtype(dtype)
    cfg, p, x, view, kv = attention_case(Q, dt, seed=Q, num_attention_heads=8, num_key_value_heads=2, head_dim=256)
    want = run_layer(False, cfg, p, x, view, kv)
    got = run_layer(True, cfg, p, x, view, kv, layout_for(form, pages_per_tile))
    assert_same_layer(got, want, view, kv, 3e-2 if dt == jnp.bfloat16 else 1e-4)


@pytest.mark.parametrize("Hq, Hkv, D, dtype, pad_tokens", [(8, 2, 256, "bfloat16", 7), (8, 2, 256, "bfloat16", 0),
                                                            (4, 2, 32, "float32", 7)])
def test_ragged_attention_kernel_compiled_equals_reference(Hq, Hkv, D, dtype, pad_tokens):
    """The ragged paged attention kernel compiled (the 0.8B widths first) against the XLA reference on a mix of
    a decode row, prompt chunks, a fresh prompt and a verify window."""
    import jax.numpy as jnp
    from test_ragged_attention import kernel_inputs, ragged_case

    from pallas_kernels.ragged_attention import block_queries, ragged_paged_attention, ragged_paged_attention_reference

    case = ragged_case(seed=D, Hq=Hq, Hkv=Hkv, D=D, dtype=getattr(jnp, dtype), pad_tokens=pad_tokens,
                       rows=((37, 1), (16, 200), (0, 300), (70, 3), (5, 1)), MP=24)
    with jax.default_matmul_precision("highest"):
        ref = jax.jit(ragged_paged_attention_reference)(*case[:7]).astype(jnp.float32)
    out = jax.jit(ragged_paged_attention)(*kernel_inputs(case, block_queries(Hq, Hkv))).astype(jnp.float32)
    tol = 1e-4 if dtype == "float32" else 3e-2
    assert float(jnp.abs(out - ref).max()) <= tol * max(1.0, float(jnp.abs(ref).max()))


@pytest.mark.parametrize("lengths, dtype", [((1, 3, 20, 4, 70, 1, 16, 17, 130), "float32"),
                                            ((1, 4, 300, 2048, 1, 3), "bfloat16")])
def test_ragged_gdn_kernels_compiled_equal_the_reference(lengths, dtype):
    """The ragged GDN kernels compiled at the 0.8B head widths (Hk = Hv = 16, dk = dv = 128): short rows on the
    token loop, long rows on the chunked form, the pool written in place."""
    import jax.numpy as jnp
    from test_gdn_ragged import expected_pool, gdn_case

    from pallas_kernels.gdn_ragged import gdn_ragged_reference
    from pallas_kernels.gdn_ragged_pallas import gdn_ragged_pallas

    q, k, v, g, beta, pool, qsl, token_row, slots, start, fresh, verify = gdn_case(
        len(lengths), lengths, Hk=16, Hv=16, dk=128, dv=128, dtype=getattr(jnp, dtype), pad_tokens=0)
    W = pool.shape[1]
    init = jnp.where(fresh[:, None, None, None], 0, pool[slots, start])
    with jax.default_matmul_precision("highest"):
        o_ref, final, checkpoints = jax.jit(gdn_ragged_reference, static_argnums=8)(
            *(x.astype(jnp.float32) for x in (q, k, v)), g, beta, token_row, qsl, init, W)
    o, new_pool = jax.jit(gdn_ragged_pallas)(q, k, v, g, beta, pool, qsl, slots, start, fresh, verify)
    err = lambda a, b: float(jnp.abs(a - b).max() / max(1.0, float(jnp.abs(b).max())))  # noqa: E731
    tol = 1e-4 if dtype == "float32" else 3e-2
    assert err(o, o_ref) <= tol
    want = expected_pool(pool, (final, checkpoints), slots, np.asarray(verify))
    assert err(new_pool[1:], jnp.asarray(want[1:])) <= tol


def test_decode_launches_of_four_steps_on_gpu_equal_single_steps():
    """The GPU default runs 4 decode steps per launch (pool kernel, command buffers with a loop): greedy
    outputs equal plain greedy decoding, sampled ones those of one step per launch and lie in their
    sampling support (an absolute check: both launch forms could share a wrong token)."""
    from jaxgdn.engine.llm_engine import LLMEngine

    cfg = small_config(eos_token_ids=(), linear_value_head_dim=32)
    params = init_random_params(cfg, seed=6)
    rng = np.random.default_rng(2)
    prompts = [[int(t) for t in rng.integers(0, 256, n)] for n in (1, 7, 9, 30)]
    sps = [SamplingParams(temperature=0, max_tokens=13), SamplingParams(temperature=0, max_tokens=10),
           SamplingParams(temperature=0.9, top_p=0.8, seed=3, max_tokens=11),
           SamplingParams(temperature=1.1, top_k=5, seed=4, max_tokens=9)]
    outs = {}
    for steps in (None, 1):  # None: the engine's GPU default
        ecfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, kv_page_size=8,
                            dtype="float32", decode_steps_per_launch=steps)
        eng = LLMEngine(params, cfg, ecfg, garbage_seed=1)
        rids = [eng.add_request(p, sp) for p, sp in zip(prompts, sps)]
        eng.run_until_done()
        outs[steps] = [eng.output(r).token_ids for r in rids]
        assert (eng.decode_steps_per_launch, eng.num_launches < eng.num_steps) == ((4, True) if steps is None else (1, False))
    assert outs[None] == outs[1]
    for p, sp, got in zip(prompts[:2], sps[:2], outs[None][:2]):
        assert got == naive_greedy(params, cfg, p, sp.max_tokens)
    for p, sp, got in zip(prompts[2:], sps[2:], outs[None][2:]):
        assert outside_sampling_support(params, cfg, p, got, sp) == []


def test_library_gemms_fold_the_residual_adds_into_the_products_compiled():
    """Prompt-sized steps (EngineConfig.library_gemms_min_tokens) compile their products for cuBLAS(Lt): the
    compiled step then adds the residual stream in the products' epilogues (GEMMs with beta = 1, at least
    one per layer), which the default program's Triton-claimed products do not; greedy tokens stay those
    of plain greedy decoding."""
    import jax.numpy as jnp

    from jaxgdn.engine.llm_engine import LLMEngine

    cfg = small_config(eos_token_ids=())
    params = init_random_params(cfg, seed=8)
    prompt = [int(t) for t in np.random.default_rng(5).integers(0, 256, 300)]
    ecfg = EngineConfig(max_num_seqs=2, max_num_batched_tokens=512, max_model_len=320, kv_page_size=8,
                        dtype="float32", library_gemms_min_tokens=256)
    eng = LLMEngine(params, cfg, ecfg, garbage_seed=1)
    rid = eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=4))
    eng.step()  # the whole prompt: one step of a >= 256-token bucket
    r = eng.runner
    host_buf, layout, *static = r.last_device_args
    assert r.program(layout) is r._library_step

    def fused_bias_gemms(program):
        text = program.lower(r.params, r.state, jnp.zeros(host_buf.size + 1, jnp.int32), jnp.asarray(host_buf),
                             layout, *static).compile().as_text()
        return text.count('"beta":1')

    library, default = fused_bias_gemms(r._library_step), fused_bias_gemms(r._step)
    assert library >= cfg.num_hidden_layers and library > default, (library, default)
    eng.run_until_done()
    assert eng.output(rid).token_ids == naive_greedy(params, cfg, prompt, 4, pad_to=320)


def serve_shipped_mtp(params, cfg, prompts, sps, steps, scheduling):
    """Serve prompts with MTP K=2 (fp32) to the end; decode_steps_per_launch=steps, async_scheduling=
    scheduling (None: the defaults). Returns (engine, request ids)."""
    from jaxgdn.engine.llm_engine import LLMEngine

    ecfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=256, kv_page_size=8,
                        dtype="float32", num_speculative_tokens=2, decode_steps_per_launch=steps,
                        async_scheduling=scheduling)
    eng = LLMEngine(params, cfg, ecfg, garbage_seed=1)
    rids = [eng.add_request(p, sp) for p, sp in zip(prompts, sps)]
    eng.run_until_done()
    return eng, rids


@pytest.mark.parametrize("steps, scheduling", [(1, False), (None, None)])
def test_sampled_mtp_tokens_on_gpu_lie_in_the_sampling_support(steps, scheduling):
    """Every token a sampled MTP row emits (an accepted draft, a residual draw or the bonus token) lies in
    the top_k / top_p support of the reference distribution at its position, however the noise fell. (The
    H200 once emitted the never-trained pad token 0 here while the CPU did not: Triton GEMM fusions
    recomputed the logits for the sort and the mask with different bits; the sampler pins them.)"""
    params, cfg, prompts = shipped_model()
    sps = [SamplingParams(temperature=0.9, top_p=0.8, seed=3 + i, max_tokens=25) for i in range(3)] + [
        SamplingParams(temperature=1.1, top_k=5, seed=7 + i, max_tokens=25) for i in range(3)]
    eng, rids = serve_shipped_mtp(params, cfg, prompts, sps, steps, scheduling)
    bad = {r: outside_sampling_support(params, cfg, p, eng.output(r).token_ids, sp)
           for r, p, sp in zip(rids, prompts, sps)}
    assert not any(bad.values()), bad
    assert eng.spec_metrics()["num_accepted"] > 0


def test_verify_launches_of_four_steps_on_gpu_equal_single_steps():
    """With MTP the GPU default runs 4 verify steps per launch (the pool kernel reads the checkpoint the
    launch's previous step committed) under async scheduling (each launch booked as if every draft were
    accepted, the next one rebased on the device's count): on the shipped model, which accepts most drafts,
    outputs and acceptance equal one synchronous step per launch, greedy ones plain greedy decoding, and
    sampled ones lie in their sampling support (r16: both forms held the same wrong pad tokens)."""
    params, cfg, prompts = shipped_model()
    prompts = prompts[:4]
    sps = [SamplingParams(temperature=0, max_tokens=30), SamplingParams(temperature=0, max_tokens=9),
           SamplingParams(temperature=0.9, top_p=0.8, seed=3, max_tokens=25),
           SamplingParams(temperature=1.1, top_k=5, seed=4, max_tokens=20)]
    outs = {}
    for steps, scheduling in ((None, None), (1, False)):  # None: the engine's GPU default
        eng, rids = serve_shipped_mtp(params, cfg, prompts, sps, steps, scheduling)
        outs[steps] = ([eng.output(r).token_ids for r in rids], eng.spec_metrics())
        expected = (4, True, True) if steps is None else (1, False, False)
        assert (eng.decode_steps_per_launch, eng.num_launches < eng.num_steps, eng.async_scheduling) == expected
    assert outs[None] == outs[1]
    assert outs[1][1]["acceptance_rate"] > 0.5
    for p, sp, got in zip(prompts[:2], sps[:2], outs[None][0][:2]):  # (a request may stop on its eos)
        assert got and got == naive_greedy(params, cfg, p, sp.max_tokens)[: len(got)]
    for p, sp, got in zip(prompts[2:], sps[2:], outs[None][0][2:]):
        assert outside_sampling_support(params, cfg, p, got, sp) == []


@pytest.mark.parametrize("T, K", [(1, 0), (4, 3)])
def test_conv_kernel_compiled_equals_the_xla_path(T, K):
    """The Triton-lowered conv kernel at the 0.8B width (C = 6144, bf16) against the engine's XLA path."""
    import jax.numpy as jnp
    from test_conv_pallas import conv_case, xla_conv_path

    from pallas_kernels.conv_pallas import causal_conv_pooled

    args = conv_case(seed=T, T=T, K=K, C=6144, dtype=jnp.bfloat16)
    u_ref, pool_ref = jax.jit(xla_conv_path)(*args)
    u, pool = jax.jit(lambda x, w, pool, *rows: causal_conv_pooled(x, w.shape[0], w, pool, *rows))(*args)
    real = np.asarray(args[-1]) > 0
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    np.testing.assert_allclose(f32(u)[real], f32(u_ref)[real], rtol=2e-2, atol=2e-2)
    np.testing.assert_array_equal(f32(pool)[1:], f32(pool_ref)[1:])


@pytest.mark.parametrize("T", [300, 2048])
def test_prompt_conv_kernel_compiled_equals_the_xla_conv(T):
    """The Triton-lowered whole-prompt conv at the 0.8B widths (q, k, v of 2048 channels, bf16, read out
    of the fused projection's 8224) against gdn.causal_conv_silu; T = 300 ends on a partial tile."""
    import jax.numpy as jnp

    from jaxgdn.model.gdn import causal_conv_silu
    from pallas_kernels.conv_pallas import causal_conv_prompt

    r = np.random.default_rng(T)
    x = jnp.asarray(r.standard_normal((2, T, 8224)), jnp.bfloat16)
    window = jnp.asarray(r.standard_normal((2, 3, 6144)), jnp.bfloat16)
    weight = jnp.asarray(r.standard_normal((6144, 1, 4)) * 0.5, jnp.bfloat16)
    u_ref, _ = jax.jit(causal_conv_silu)(x[..., :6144], window, weight)
    outs = jax.jit(lambda x, w, win: causal_conv_prompt(x, (2048, 2048, 2048), w, win))(x, weight, window)
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    np.testing.assert_allclose(f32(jnp.concatenate(outs, -1)), f32(u_ref), rtol=2e-2, atol=2e-2)


def test_kv_write_kernel_compiled_equals_scatter():
    import jax.numpy as jnp
    from test_ragged_attention import kv_write_case

    from pallas_kernels.kv_write import write_kv_pallas

    k_pool, v_pool, slots, k, v = kv_write_case(P=300, ps=16, D=256, N=128, dtype=jnp.bfloat16)
    expect = [pool.reshape(-1, 2, 256).at[slots].set(x).reshape(pool.shape) for pool, x in ((k_pool, k), (v_pool, v))]
    new = jax.jit(lambda kp, vp, k, v: write_kv_pallas(kp, vp, slots, k, v))(k_pool, v_pool, k, v)
    for got, want in zip(new, expect):
        np.testing.assert_array_equal(np.asarray(got, np.float32)[1:], np.asarray(want, np.float32)[1:])


@pytest.mark.parametrize("R, Q, dtype", [(1, 2048, "bfloat16"), (2, 300, "bfloat16"), (2, 300, "float32")])
def test_prompt_qkv_kernel_compiled_at_the_0_8b_widths_equals_the_xla_chain(R, Q, dtype):
    """The prefill q/k/v kernel compiled at the 0.8B layer's widths against the compiled XLA chain; 300 cells
    end on a part tile. test_prompt_qkv.py runs the smaller cases interpreted on CPU."""
    import jax.numpy as jnp
    from test_prompt_qkv import test_kernel_matches_the_xla_chain

    test_kernel_matches_the_xla_chain("real", R, Q, jnp.dtype(dtype).type)


@pytest.mark.parametrize("form, m, k, width", [
    ("large", 256, 64, 128), ("large", 512, 192, 384), ("large", 4096, 1024, 3584),
    ("small", 64, 256, 64), ("small", 64, 512, 384), ("small", 64, 1024, 3584)])
def test_swiglu_kernel_compiled_equals_the_rounded_products_silu(form, m, k, width):
    """The Mosaic GPU gate/up kernel (the persistent large form and the decode-sized small one) against
    silu(g) * u in fp32 from the products rounded to bf16 (what it rounds before its epilogue), within a bf16
    rounding of the output; 0.8B widths last."""
    import jax.numpy as jnp

    from pallas_kernels import swiglu_mosaic

    assert swiglu_mosaic.kernel_available()
    product = swiglu_mosaic.swiglu_product if form == "large" else swiglu_mosaic.swiglu_product_small
    kx, kw = jax.random.split(jax.random.PRNGKey(m + k))
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (2 * width, k), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
    y = np.asarray(jax.jit(product)(x, w).astype(jnp.float32))
    gu = jnp.einsum("tk,nk->tn", x, w, preferred_element_type=jnp.float32, precision="highest")
    g, u = np.split(np.asarray(gu.astype(jnp.bfloat16).astype(jnp.float32)), 2, axis=-1)
    ref = g / (1 + np.exp(-g)) * u
    # one accumulation order against another can move g or u by one bf16 step: allow 2^-6 relative
    np.testing.assert_allclose(y, ref, rtol=2**-6, atol=2**-7 * float(np.abs(ref).max()))


@pytest.mark.parametrize("form", ["large", "small"])
def test_model_runs_the_swiglu_kernel_compiled(form):
    """With the policy's swiglu threshold lowered, a bf16 prompt of 512 tokens through the serving layout runs
    every MLP's gate/up product in the Mosaic GPU kernel (its custom call in the lowered program; "small": 64
    tokens, the decode-sized form), and its logits are as close to the fp32 forward of the same weights as the
    XLA form's are (RMS error within 1.25x), their argmax that of the XLA form almost everywhere. Measured
    against fp32, not against the XLA form: the two bf16 forms differ by one SiLU rounding, which 4 layers of
    random weights carry to a max logit difference of ~0.4 against a scale of 5, while their RMS errors against
    fp32 are 0.041 (XLA) and 0.040 (kernel) and a kernel with gate and up swapped is ~1.0."""
    import jax.numpy as jnp

    from jaxgdn.model import forward as model
    from jaxgdn.model.params import cast_params, fold_norms
    from jaxgdn.model.policy import KernelPolicy

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
