"""GPU-only checks (pytest -m gpu): compiled kernels against their references, and the PD + MTP engine
with the Triton and Pallas input-assembly kernels against plain greedy decoding."""

import jax
import numpy as np
import pytest
from helpers import naive_greedy, outside_sampling_support, shipped_model, small_config

from jaxgdn.engine.config import EngineConfig
from jaxgdn.engine.request import SamplingParams
from jaxgdn.engine.workers import decode_engine, prefill_engine, run_disaggregated
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
                        dtype="float32", num_speculative_tokens=2, pd=True, gdn_impl=gdn_impl, input_impl=input_impl)
    P = prefill_engine(params, cfg, ecfg, garbage_seed=1)
    D = decode_engine(params, cfg, ecfg, garbage_seed=2)
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
    assert eng.update.spec_counters.metrics()["num_accepted"] > 0


def test_verify_launches_of_four_steps_on_gpu_equal_single_steps():
    """With MTP the GPU default runs 4 verify steps per launch (the pool kernel reads the checkpoint the
    launch's previous step committed) under async scheduling (each launch booked as if every draft were
    accepted, the next one rebased on the device's count): on the shipped model, which accepts most drafts,
    outputs and acceptance equal one synchronous step per launch, greedy ones plain greedy decoding, and
    sampled ones lie in their sampling support (both forms could hold the same wrong token)."""
    params, cfg, prompts = shipped_model()
    prompts = prompts[:4]
    sps = [SamplingParams(temperature=0, max_tokens=30), SamplingParams(temperature=0, max_tokens=9),
           SamplingParams(temperature=0.9, top_p=0.8, seed=3, max_tokens=25),
           SamplingParams(temperature=1.1, top_k=5, seed=4, max_tokens=20)]
    outs = {}
    for steps, scheduling in ((None, None), (1, False)):  # None: the engine's GPU default
        eng, rids = serve_shipped_mtp(params, cfg, prompts, sps, steps, scheduling)
        outs[steps] = ([eng.output(r).token_ids for r in rids], eng.update.spec_counters.metrics())
        expected = (4, True, True) if steps is None else (1, False, False)
        assert (eng.decode_steps_per_launch, eng.num_launches < eng.num_steps, eng.async_scheduling) == expected
    assert outs[None] == outs[1]
    assert outs[1][1]["acceptance_rate"] > 0.5
    for p, sp, got in zip(prompts[:2], sps[:2], outs[None][0][:2]):  # (a request may stop on its eos)
        assert got and got == naive_greedy(params, cfg, p, sp.max_tokens)[: len(got)]
    for p, sp, got in zip(prompts[2:], sps[2:], outs[None][0][2:]):
        assert outside_sampling_support(params, cfg, p, got, sp) == []
