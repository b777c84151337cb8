"""Engines that free what they hold: LLM.close() (or `with LLM(...)`) drops the engine's compiled programs and
device buffers, so a process that builds engines of many configurations one after another stays bounded."""

import gc

import jax
import pytest
from helpers import small_config

from jaxgdn.engine import runner
from jaxgdn.engine.config import EngineConfig
from jaxgdn.engine.request import SamplingParams
from jaxgdn.llm import LLM
from jaxgdn.model.checkpoint import save_checkpoint
from jaxgdn.model.params import init_random_params


def mapped_regions() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def test_twenty_engines_of_different_configurations_built_and_closed(tmp_path):
    cfg = small_config()
    path = save_checkpoint(tmp_path / "ck", cfg, init_random_params(cfg, seed=0))
    prompt, sp = [3, 4, 5], SamplingParams(temperature=0, max_tokens=4)
    gc.collect()
    arrays_before, maps = len(jax.live_arrays()), []
    programs_before = set(runner._COMPILED.keys())  # those of engines other tests on this worker still hold
    want = None
    for i in range(20):
        config = EngineConfig(max_num_seqs=2 + i % 5, max_num_batched_tokens=16 * (1 + i % 4),
                              max_model_len=64 + 16 * (i % 3), dtype="float32", precompile=False,
                              num_speculative_tokens=i % 2)
        with LLM(str(path), config) as llm:
            tokens = llm.generate([prompt], sp, use_tqdm=False)[0].token_ids
            settings = list(llm.engine.runner._settings)
        assert tokens == (want := want or tokens)  # every configuration's greedy tokens are the model's
        assert not any(s in runner._STEP_FUNCTIONS for s in settings)  # its jitted steps went with it
        with pytest.raises(RuntimeError, match="closed"):
            llm.generate([prompt], sp, use_tqdm=False)
        del llm
        gc.collect()
        assert len(jax.live_arrays()) == arrays_before  # weights, pools and buffers freed
        assert set(runner._COMPILED.keys()) <= programs_before  # no program outlives the engines that used it
        maps.append(mapped_regions())
    # the compiled programs' memory mappings do not pile up: the last ten engines add almost none
    assert maps[-1] - maps[9] < 200, maps
