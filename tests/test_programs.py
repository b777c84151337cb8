"""The fixed program set: a start-up compiles every step program, and then a mixed workload (staggered
arrivals, prompts of 1..300 tokens, greedy and sampled requests, MTP and PD on and off) compiles nothing
more; greedy requests still equal one-request greedy decoding."""

import numpy as np
import pytest
from helpers import naive_greedy, run_staggered, small_config

from jaxgdn.engine.config import EngineConfig
from jaxgdn.engine.llm_engine import LLMEngine
from jaxgdn.engine.programs import ProgramSet, StepShape
from jaxgdn.engine.request import SamplingParams
from jaxgdn.engine.workers import decode_engine, prefill_engine, run_disaggregated
from jaxgdn.model.params import init_random_params

CFG = small_config(eos_token_ids=())
PARAMS = init_random_params(CFG, seed=31)
LENGTHS = (1, 300, 2, 17, 64, 5, 150, 65, 3, 33)


def workload():
    rng = np.random.default_rng(8)
    prompts = [[int(t) for t in rng.integers(0, CFG.vocab_size, n)] for n in LENGTHS]
    sps = [SamplingParams(temperature=0, max_tokens=4 + i % 3) if i % 3 else
           SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=5) for i in range(len(prompts))]
    return prompts, sps


def ecfg(**kw):
    base = dict(max_num_seqs=6, max_num_batched_tokens=64, max_model_len=320, kv_page_size=8, dtype="float32")
    return EngineConfig(**{**base, **kw})


@pytest.mark.parametrize("K, pd, steps", [(0, False, None), (2, False, 2), (2, True, None)])
def test_a_mixed_workload_after_start_up_compiles_nothing(K, pd, steps):
    """K = 2 with two verify steps a launch adds the uniform programs of such launches to the start-up set."""
    prompts, sps = workload()
    config = ecfg(num_speculative_tokens=K, pd=pd, decode_steps_per_launch=steps)
    if pd:
        P, D = prefill_engine(PARAMS, CFG, config, garbage_seed=1), decode_engine(PARAMS, CFG, config, garbage_seed=2)
        engines = [P, D]
        compiled = P.precompile(sampled=False) + D.precompile()
        rids = run_disaggregated(P, D, prompts, sps)
        outputs = [D.output(r) for r in rids]
    else:
        eng = LLMEngine(PARAMS, CFG, config, garbage_seed=1)
        engines = [eng]
        compiled = eng.precompile()
        rids = run_staggered(eng, prompts, 2, sps)
        eng.run_until_done()
        outputs = [eng.output(r) for r in rids]
    # a PD prefill worker's greedy programs are its decode worker's (one process-wide cache)
    assert compiled == len(set(engines[-1].program_keys()) | set(engines[0].program_keys(sampled=not pd)))
    assert sum(e.compiles_after_startup for e in engines) == 0
    if steps:
        assert engines[-1].num_launches < engines[-1].num_steps  # launches of several steps ran
    for out, p, sp in zip(outputs, prompts, sps):
        assert out.error is None and len(out.token_ids) == sp.max_tokens
        if sp.temperature == 0:
            assert out.token_ids == naive_greedy(PARAMS, CFG, p, sp.max_tokens, pad_to=320)


def test_the_program_set_is_fixed_by_the_configuration():
    """Token buckets: powers of two from 16 to max_num_batched_tokens (rounded up); rows min(T, max_num_seqs);
    uniform programs of power-of-two rows for launches of several steps; a step takes the smallest program
    that holds its tokens and rows; enforce_eager: exact shapes, nothing ahead."""
    progs = ProgramSet(ecfg(max_num_seqs=20, max_num_batched_tokens=100), launch_steps=4)
    assert progs.token_buckets == (16, 32, 64, 128)
    assert progs.ragged(1, 1) == StepShape(16, 16) and progs.ragged(17, 17) == StepShape(32, 20)
    assert progs.ragged(100, 3) == StepShape(128, 20)
    assert progs.launch(5, 4) == StepShape(8, 8, 1, 4) and progs.uniform_rows == (1, 2, 4, 8, 16, 32)
    assert len(progs.all_shapes()) == 4 + 6
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        progs.ragged(129, 1)
    eager = ProgramSet(ecfg(enforce_eager=True))
    assert eager.ragged(37, 3) == StepShape(37, 3) and eager.all_shapes() == []
