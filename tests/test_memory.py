"""Memory planned up front: the KV pages get what the budget leaves after what is in use, the GDN slots and the
largest step program's temporaries; a configuration that cannot hold one sequence fails at construction,
naming the knobs; off the GPU the pool holds every slot at max_model_len."""

import gc
import os

import pytest
from helpers import small_config

from jaxgdn.engine import llm_engine as engine_module
from jaxgdn.engine.config import EngineConfig
from jaxgdn.engine.llm_engine import LLMEngine
from jaxgdn.engine.memory import MARGIN_BYTES, GiB, gdn_slot_bytes, kv_bytes_per_page, plan_memory
from jaxgdn.model.params import init_random_params

CFG = small_config()


def ecfg(**kw):
    return EngineConfig(**{**dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, kv_page_size=16), **kw})


def test_the_pages_get_what_the_budget_leaves():
    config = ecfg(gpu_memory_utilization=0.5)
    page, gdn = kv_bytes_per_page(CFG, config, False), gdn_slot_bytes(CFG, config)
    peaks = []
    plan = plan_memory(CFG, config, False, (4 * GiB, GiB), lambda pages: peaks.append(pages) or 100 << 20)
    assert peaks == [config.max_pages_per_seq + 1]  # measured on a pool of one sequence
    budget = int(0.5 * 4 * GiB - GiB)
    want = (budget - gdn - (100 << 20) - MARGIN_BYTES) // page
    assert plan.num_kv_pages == min(want, 8 * config.max_pages_per_seq + 1)
    assert plan.budget == budget and plan.step_peak == 100 << 20 and "KV pages" in plan.describe(config)
    half = plan_memory(CFG, config, False, (4 * GiB, GiB), lambda pages: 0, share=0.5)
    assert half.budget == budget // 2
    # off the GPU: every slot at max_model_len; num_kv_pages given: as given
    assert plan_memory(CFG, config, False, None, None).num_kv_pages == 8 * config.max_pages_per_seq + 1
    assert plan_memory(CFG, ecfg(num_kv_pages=40), False, (GiB, 0), None).num_kv_pages == 40


def test_the_gdn_slots_count_against_the_budget_and_a_tight_one_fails_naming_the_knobs():
    """Qwen3.5-0.8B's GDN state is 1 MiB a layer and checkpoint: 256 slots with K = 3 take 18 GiB."""
    from jaxgdn.model.config import qwen35_0_8b

    big = qwen35_0_8b()
    config = EngineConfig(max_num_seqs=256, num_speculative_tokens=3)
    assert gdn_slot_bytes(big, config) > 18 * GiB
    with pytest.raises(ValueError, match="max_num_seqs 256.*gpu_memory_utilization"):
        plan_memory(big, config, True, (20 * GiB, 2 * GiB), lambda pages: GiB)


def test_an_engine_plans_its_pool_from_the_device_memory_and_measures_its_largest_program(monkeypatch):
    """With a device that reports 1 GiB (faked on the CPU) the engine compiles its largest program to measure
    its temporaries and sizes its pool from what is left."""
    monkeypatch.setattr(engine_module, "device_memory", lambda device=None: (GiB, 64 << 20))
    params = init_random_params(CFG, seed=0)
    eng = LLMEngine(params, CFG, ecfg(gpu_memory_utilization=0.9, dtype="float32", max_num_seqs=2))
    plan = eng.memory
    assert plan.step_peak > 0 and plan.budget == int(0.9 * GiB - (64 << 20))
    assert eng.runner.state.layers[-1].k.shape[0] == plan.num_kv_pages == eng.scheduler.pages.num_free + 1
    monkeypatch.setattr(engine_module, "device_memory", lambda device=None: (64 << 20, 0))
    with pytest.raises(ValueError, match="Lower max_num_seqs, max_num_batched_tokens or max_model_len"):
        LLMEngine(params, CFG, ecfg(dtype="float32"))


def test_the_planned_peak_bounds_every_programs_temporaries(monkeypatch):
    """A vocabulary large beside the token bucket (16 rows, MTP K = 2): a split launch's sample program with every
    feature holds more temporaries than the largest step program; the plan counts it."""
    monkeypatch.setattr(engine_module, "device_memory", lambda device=None: (GiB, 64 << 20))
    cfg = small_config(vocab_size=8192)
    eng = LLMEngine(init_random_params(cfg, seed=0), cfg, ecfg(gpu_memory_utilization=0.9, dtype="float32",
                                                                max_num_seqs=16, max_num_batched_tokens=16,
                                                                num_speculative_tokens=2))
    eng.precompile()
    temps = {key if isinstance(key[0], str) else ("step", *key[1:]): p.memory_analysis().temp_size_in_bytes
             for key, p in eng.runner._programs.items()}
    assert max(temps.values()) <= eng.memory.step_peak, (eng.memory.step_peak, sorted(temps.items(), key=lambda kv: -kv[1])[:3])
    assert max(v for k, v in temps.items() if k[0] == "sample") > max(v for k, v in temps.items() if k[0] == "step")


@pytest.mark.parametrize("role, limit_mib", [("both", 360), ("prefill", 200), ("decode", 200)])
def test_pd_workers_plan_together_within_the_fraction(monkeypatch, role, limit_mib):
    """PD + MTP (K = 2) with both workers on one device that reports 360 MiB (faked on the CPU; in use: the
    live arrays): the plans' pools, live after construction, plus every worker's largest step temporaries stay
    within gpu_memory_utilization of the device, each plan bound by the budget (not by max_num_seqs); the same
    for a server's prefill or decode role alone."""
    import jax

    from jaxgdn.engine import memory
    from jaxgdn.generate import default_checkpoint
    from jaxgdn.llm import LLM

    gc.collect()
    others = sum(a.nbytes for a in jax.live_arrays())  # earlier tests' arrays are not on this fake device
    live = lambda: sum(a.nbytes for a in jax.live_arrays()) - others  # noqa: E731
    limit, fraction = limit_mib << 20, 0.9
    monkeypatch.setattr(memory, "MARGIN_BYTES", 1 << 20)
    monkeypatch.setattr(engine_module, "device_memory", lambda device=None: (limit, live()))
    before = live()
    config = EngineConfig(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=2048, num_speculative_tokens=2,
                          pd=True, precompile=False, dtype="float32", gpu_memory_utilization=fraction)
    llm = LLM(str(default_checkpoint()), config, role=role)
    assert len(llm.engines) == (2 if role == "both" else 1)
    for e in llm.engines:
        assert e.memory.num_kv_pages < config.max_num_seqs * config.max_pages_per_seq + 1, e.memory
        assert e.memory.step_peak > 0
    used = live() - before + sum(e.memory.step_peak for e in llm.engines) + memory.MARGIN_BYTES
    assert before + used <= fraction * limit, (before, used, [e.memory for e in llm.engines])


def test_utilization_is_a_fraction_of_the_gpu_capped_at_jaxs_allocator(monkeypatch):
    """gpu_memory_utilization counts against the device's memory; JAX's allocator limit caps it; the command
    lines set that limit from the knob unless the user set one."""
    from jaxgdn.engine.memory import allocator_fraction
    from jaxgdn.engine_args import use_memory_fraction

    config = ecfg(gpu_memory_utilization=0.9)
    total, in_use = 8 * GiB, GiB
    free = plan_memory(CFG, config, False, (total, in_use, total), lambda pages: 0)
    capped = plan_memory(CFG, config, False, (total, in_use, int(0.75 * total)), lambda pages: 0)
    assert free.budget == int(0.9 * total - in_use) and capped.budget == int(0.75 * total - in_use)
    for name in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
        monkeypatch.setenv(name, "")  # restored (to unset, where it was) after the test
        monkeypatch.delenv(name)
    assert allocator_fraction() == 0.75  # JAX's default
    use_memory_fraction(0.6)
    assert allocator_fraction() == 0.6
    monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    use_memory_fraction(0.9)  # the user's choice stands
    assert allocator_fraction() == 0.5 and "XLA_CLIENT_MEM_FRACTION" not in os.environ
