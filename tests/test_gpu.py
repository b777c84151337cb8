"""GPU-only checks (pytest -m gpu): compiled kernels against their references, and the PD + MTP engine
with the Triton and Pallas input-assembly kernels against plain greedy decoding."""

import jax
import numpy as np
import pytest

from helpers import naive_greedy, small_config
from jaxgdn.engine_config import EngineConfig
from jaxgdn.params import init_random_params
from jaxgdn.pd_workers import DecodeWorker, PrefillWorker, run_disaggregated
from jaxgdn.request import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")]


@pytest.mark.parametrize("input_impl", ["triton", "pallas"])
def test_pd_mtp_engine_on_gpu_equals_plain_greedy(input_impl):
    cfg = small_config(eos_token_ids=())
    params = init_random_params(cfg, seed=2)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, 256, n)] for n in (1, 2, 3, 5, 9, 17, 40, 70)]
    ecfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, kv_page_size=8,
                        dtype="float32", num_speculative_tokens=2, pd=True)
    P = PrefillWorker(params, cfg, ecfg, input_impl=input_impl, garbage_seed=1)
    D = DecodeWorker(params, cfg, ecfg, input_impl=input_impl, garbage_seed=2)
    sp = SamplingParams(temperature=0, max_tokens=6)
    rids = run_disaggregated(P, D, prompts, [sp] * len(prompts))
    for r, p in zip(rids, prompts):
        assert D.output(r).token_ids == naive_greedy(params, cfg, p, 6)


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs two devices")
def test_pd_across_two_devices():
    """Prefill worker on device 0, decode worker on device 1: handoffs cross devices, outputs unchanged."""
    from jaxgdn import LLM
    from jaxgdn.checkpoint import save_checkpoint
    import tempfile

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
