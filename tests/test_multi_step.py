"""Several decode steps per launch (decode_steps_per_launch), and several MTP verify steps per launch:
outputs, finish reasons, drafts accepted and fed tokens are exactly those of one step per launch, also
when a request stops inside a launch or reaches its length limit, and the pools drain."""

import pytest
from helpers import (
    assert_async_equals_sync,
    naive_greedy,
    outside_sampling_support,
    random_prompt,
    run_recorded,
    shipped_workload,
    small_config,
    small_engine,
)

from jaxgdn.engine.config import EngineConfig
from jaxgdn.engine.llm_engine import LLMEngine
from jaxgdn.engine.request import RowKind, SamplingParams
from jaxgdn.model.params import init_random_params

CFG = small_config(eos_token_ids=())
PARAMS = init_random_params(CFG, seed=41)


def prompt(i: int, length: int) -> list[int]:
    return random_prompt(4000 + i, length, CFG.vocab_size)


def engine(steps: int, **kw) -> LLMEngine:
    return small_engine(PARAMS, CFG, garbage_seed=3, decode_steps_per_launch=steps,
                        **{"max_num_batched_tokens": 64, **kw})


def test_multi_step_launches_equal_single_steps_with_stops_lengths_and_sampling():
    # Prompt lengths around the page size (8): the launches' later steps write KV into the next page.
    prompts = [prompt(i, n) for i, n in enumerate((1, 7, 9, 15, 30, 2, 40, 6))]
    # Stop tokens from the greedy continuation: these requests stop inside a launch of 3 steps (outputs 2-4,
    # 5-7, ... come from one launch each).
    stops = [naive_greedy(PARAMS, CFG, prompts[i], 6)[j] for i, j in ((1, 2), (4, 5))]
    params = [SamplingParams(temperature=0, max_tokens=3 + 3 * i) for i in range(8)]
    params[1] = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=(stops[0],))
    params[4] = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=(stops[1],))
    params[6] = SamplingParams(temperature=0.9, top_p=0.8, seed=11, max_tokens=14)
    params[7] = SamplingParams(temperature=1.2, top_k=5, seed=12, max_tokens=17)
    single_out, single_fed = run_recorded(engine(1), prompts, params)
    eng = engine(3)
    free_pages = eng.scheduler.pages.num_free
    multi_out, multi_fed = run_recorded(eng, prompts, params)
    assert single_out[1].finish_reason == "stop" and single_out[4].finish_reason == "stop"
    assert len(single_out[1].token_ids) == 3 and len(single_out[4].token_ids) == 6
    for s, m in zip(single_out, multi_out):
        assert (m.token_ids, m.finish_reason) == (s.token_ids, s.finish_reason)
    # Every token fed one step per launch is fed the same; a stop inside a launch (and the launch after
    # it, already dispatched) may feed up to 2 * 3 - 1 more that are discarded.
    for s, m in zip(single_fed, multi_fed):
        assert set(s) <= set(m) and len(m) - len(s) <= 5
    assert eng.num_launches < eng.num_steps  # launches of 3 steps did run
    assert eng.scheduler.pages.num_free == free_pages
    assert eng.scheduler.slots.num_free == eng.ecfg.max_num_seqs


def test_a_stop_inside_a_launch_ends_the_request_there():
    p = prompt(50, 5)
    greedy = naive_greedy(PARAMS, CFG, p, 8)
    eng = engine(4)
    rid = eng.add_request(p, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=(greedy[2],)))
    scheduled = []
    while eng.has_unfinished:
        scheduled.append(eng.step())
    eng.run_until_done()
    out = eng.output(rid)
    assert (out.token_ids, out.finish_reason) == (greedy[:3], "stop")
    # The prompt step, then launches of 4 decode steps: the stop (output 3) comes back from the first.
    assert eng.num_steps == 1 + 4 * (eng.num_launches - 1) and eng.num_launches <= 3


def test_rows_near_their_length_limit_take_only_the_steps_they_may():
    """Near max_tokens or max_model_len a row takes fewer steps of a launch; the launch still runs 4 (one
    program per bucket: no single-step decode program is compiled for the tail)."""
    p, q = prompt(60, 117), prompt(61, 3)
    eng = engine(4)
    free_pages = eng.scheduler.pages.num_free
    rids = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=50)),  # max_model_len 128: 11 outputs
            eng.add_request(q, SamplingParams(temperature=0, max_tokens=6))]
    eng.run_until_done()
    outs = [eng.output(r) for r in rids]
    assert outs[0].token_ids == naive_greedy(PARAMS, CFG, p, 11) and outs[0].finish_reason == "length"
    assert outs[1].token_ids == naive_greedy(PARAMS, CFG, q, 6) and outs[1].finish_reason == "length"
    # Launches: p's first prompt chunk with q's prompt, p's last chunk with q's first decode, then only
    # launches of 4 steps (q takes 4 = its last, p 4, 4 and the 2 that max_model_len leaves).
    assert (eng.num_launches, eng.num_steps) == (5, 2 + 4 * 3)
    assert eng.scheduler.pages.num_free == free_pages and not eng.scheduler.running


def test_decode_steps_per_launch_config():
    assert EngineConfig().resolved_decode_steps("gpu") == 4
    assert EngineConfig().resolved_decode_steps("cpu") == 1
    assert EngineConfig(async_scheduling=False).resolved_decode_steps("gpu") == 1
    assert EngineConfig(decode_steps_per_launch=8).resolved_decode_steps("cpu") == 8
    with pytest.raises(ValueError, match="decode_steps_per_launch"):
        EngineConfig(decode_steps_per_launch=0)
    with pytest.raises(ValueError, match="needs async scheduling"):
        EngineConfig(decode_steps_per_launch=2, async_scheduling=False)


# ---------------------------------------------------------------------------------- MTP verify steps
def verify_engine(params, cfg, steps: int, K: int, **kw) -> LLMEngine:
    base = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, kv_page_size=8, dtype="float32",
                num_speculative_tokens=K, async_scheduling=False)  # (the default is async)
    return LLMEngine(params, cfg, EngineConfig(**{**base, **kw}, decode_steps_per_launch=steps), garbage_seed=5)


def assert_same_serving(single, multi, single_eng, multi_eng):
    (s_out, s_fed), (m_out, m_fed) = single, multi
    for s, m in zip(s_out, m_out):
        assert (m.token_ids, m.finish_reason, m.num_drafted, m.num_accepted_drafts) == (
            s.token_ids, s.finish_reason, s.num_drafted, s.num_accepted_drafts)
    assert m_fed == s_fed  # the same tokens at the same positions, step by step
    assert multi_eng.update.spec_counters.metrics() == single_eng.update.spec_counters.metrics()
    assert multi_eng.num_launches < multi_eng.num_steps  # launches of several verify steps did run
    assert multi_eng.scheduler.pages.num_free == multi_eng.runner.state.layers[-1].k.shape[0] - 1  # all but null
    assert multi_eng.scheduler.slots.num_free == multi_eng.ecfg.max_num_seqs


@pytest.mark.parametrize("K, sync_launches", [(2, False), pytest.param(2, True, marks=pytest.mark.slow),
                                               pytest.param(1, True, marks=pytest.mark.slow),
                                               pytest.param(3, True, marks=pytest.mark.slow)])
def test_verify_launches_sync_and_async_equal_single_steps_on_accepted_drafts(K, sync_launches):
    """The shipped model accepts most drafts, so each verify step of a launch starts at a position only
    the device knows, and async scheduling (the default) books every launch as if all were accepted and
    rebases the next on the device's count. Launches of 3 verify steps, async (and synchronous, under -m
    slow; the rejected-drafts test runs them by default) serve what one synchronous step per launch does:
    greedy and seeded sampling, a stop token and max_tokens inside a launch; the sampled rows' tokens lie in
    their top_p / top_k support."""
    params, cfg, prompts, sp = shipped_workload()
    single_eng = verify_engine(params, cfg, 1, K)
    async_eng = verify_engine(params, cfg, 3, K, async_scheduling=True)
    single = run_recorded(single_eng, prompts, sp)
    if sync_launches:
        multi_eng = verify_engine(params, cfg, 3, K)
        assert_same_serving(single, run_recorded(multi_eng, prompts, sp), single_eng, multi_eng)
    asyn = run_recorded(async_eng, prompts, sp)
    assert single[0][1].finish_reason == "stop" and single[0][2].finish_reason == "length"
    assert single_eng.update.spec_counters.metrics()["acceptance_rate"] > 0.5
    assert async_eng.num_launches < async_eng.num_steps
    assert_async_equals_sync(single, asyn, single_eng, async_eng, extra_fed=2 * 3 * (1 + K))
    for i in (3, 4):  # the seeded samplers
        assert outside_sampling_support(params, cfg, prompts[i], single[0][i].token_ids, sp[i]) == []


def test_verify_launches_equal_single_steps_on_rejected_drafts_and_near_max_model_len():
    """Random weights reject most drafts; rows close to max_model_len fall back to one step a launch."""
    prompts = [prompt(70 + i, n) for i, n in enumerate((3, 9, 17, 100, 2))]
    sp = [SamplingParams(temperature=0, max_tokens=24) for _ in prompts]
    sp[2] = SamplingParams(temperature=1.5, seed=3, max_tokens=24)  # sampled: some drafts accepted
    sp[4] = SamplingParams(temperature=0, max_tokens=5)
    single_eng = verify_engine(PARAMS, CFG, 1, 2, max_model_len=120)
    multi_eng = verify_engine(PARAMS, CFG, 4, 2, max_model_len=120)
    single = run_recorded(single_eng, prompts, sp)
    multi = run_recorded(multi_eng, prompts, sp)
    assert single[0][3].finish_reason == "length" and len(single[0][3].token_ids) == 20  # 100 + 20 = 120
    assert_same_serving(single, multi, single_eng, multi_eng)


def test_verify_launch_reserves_pages_for_every_window_and_budgets_rows():
    eng = verify_engine(PARAMS, CFG, 4, 2)
    rids = [eng.add_request(prompt(80, 5), SamplingParams(temperature=0, max_tokens=30)),
            eng.add_request(prompt(81, 6), SamplingParams(temperature=0, max_tokens=3))]
    eng.step()  # the prompts (drafts proposed)
    out = eng.scheduler.schedule()
    assert [r.kind for r in out.rows] == [RowKind.SPEC_VERIFY] * 2
    assert eng.scheduler.launch_steps(out, 4) == 4
    for row, budget in zip(out.rows, (30 - 1, 3 - 1)):
        req = row.request
        # pages for 4 windows of 1+K from num_computed, plus the K positions the MTP chain writes
        assert len(req.pages) == -(-(req.num_computed + 4 * 3 + 2) // 8)
        assert (row.launch_steps, row.token_budget) == (4, budget)
    assert rids


def test_verify_launches_config():
    assert EngineConfig(num_speculative_tokens=1).resolved_decode_steps("gpu") == 4
    assert EngineConfig(num_speculative_tokens=1).resolved_decode_steps("cpu") == 1
    assert EngineConfig(num_speculative_tokens=1, pd=True).resolved_decode_steps("gpu") == 1
    assert EngineConfig(num_speculative_tokens=2, decode_steps_per_launch=3).resolved_decode_steps("cpu") == 3
    with pytest.raises(ValueError, match="decode_steps_per_launch"):
        EngineConfig(decode_steps_per_launch=2, num_speculative_tokens=1, pd=True)
