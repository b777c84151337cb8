"""Async scheduling: step n+1 is scheduled and launched before step n's tokens are back. Outputs, finish
reasons, fed tokens and the pools must be exactly those of the synchronous engine."""

import pytest
from helpers import assert_async_equals_sync, naive_greedy, random_prompt, run_recorded, small_config, small_engine

from jaxgdn.engine.config import EngineConfig
from jaxgdn.engine.llm_engine import LLMEngine
from jaxgdn.engine.request import PLACEHOLDER_TOKEN, SamplingParams
from jaxgdn.model.params import init_random_params

CFG = small_config(eos_token_ids=())
PARAMS = init_random_params(CFG, seed=31)


def prompt(i: int, length: int) -> list[int]:
    return random_prompt(3000 + i, length, CFG.vocab_size)


def engine(async_scheduling: bool | None, **kw) -> LLMEngine:
    return small_engine(PARAMS, CFG, garbage_seed=5, async_scheduling=async_scheduling, **kw)


def test_async_equals_sync_with_stops_lengths_and_sampling():
    prompts = [prompt(i, n) for i, n in enumerate((1, 3, 9, 17, 30, 2, 40, 5))]
    # Stop tokens taken from the greedy continuation, so some requests stop while their next step is
    # already launched (that row must be discarded and its placeholder dropped).
    stops = [naive_greedy(PARAMS, CFG, prompts[i], 4)[2] for i in (1, 4)]
    params = [SamplingParams(temperature=0, max_tokens=1 + i % 5) for i in range(8)]
    params[1] = SamplingParams(temperature=0, max_tokens=9, stop_token_ids=(stops[0],))
    params[4] = SamplingParams(temperature=0, max_tokens=9, stop_token_ids=(stops[1],))
    params[6] = SamplingParams(temperature=0.9, top_p=0.8, seed=11, max_tokens=6)
    params[7] = SamplingParams(temperature=1.2, top_k=5, seed=12, max_tokens=7)
    sync_out, sync_fed = run_recorded(engine(False), prompts, params)
    eng = engine(True)
    free_pages = eng.scheduler.pages.num_free
    async_out, async_fed = run_recorded(eng, prompts, params)
    assert [o.finish_reason for o in sync_out][1] == "stop" and sync_out[4].finish_reason == "stop"
    for s, a in zip(sync_out, async_out):
        assert (a.token_ids, a.finish_reason) == (s.token_ids, s.finish_reason)
    # Every token the synchronous engine fed is fed the same by the async one (which may also have fed one
    # discarded row after a stop).
    for s, a in zip(sync_fed, async_fed):
        assert set(s) <= set(a) and len(a) - len(s) <= 1
    assert eng.scheduler.pages.num_free == free_pages
    assert eng.scheduler.slots.num_free == eng.ecfg.max_num_seqs


def test_async_preemption_recomputes_from_real_tokens():
    """A pool too small for every request: preemption happens, and only after the step in flight is
    applied (a recompute must never see a placeholder)."""
    prompts = [prompt(100 + i, 20 + 7 * i) for i in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=20)] * len(prompts)
    outs, _ = run_recorded(engine(True, num_kv_pages=1 + 16, max_num_batched_tokens=64), prompts, params, per_step=5)
    assert sum(o.num_preemptions for o in outs) > 0
    for o, p in zip(outs, prompts):
        assert o.token_ids == naive_greedy(PARAMS, CFG, p, 20)


def test_async_launches_the_next_step_before_fetching_the_last():
    eng = engine(True)
    events = []
    dispatch, fetch = eng.runner.dispatch, eng.runner.fetch
    eng.runner.dispatch = lambda *args: events.append("d") or dispatch(*args)
    eng.runner.fetch = lambda pending: events.append("f") or fetch(pending)
    eng.add_request(prompt(7, 4), SamplingParams(temperature=0, max_tokens=4))
    eng.step()
    assert events == ["d"] and eng.output(0).token_ids == []  # the first token is still on the device
    eng.run_until_done()
    assert events == ["d", "d", "f", "d", "f", "d", "f", "f"]  # 4 steps: each fetch after the next launch
    assert eng.output(0).token_ids == naive_greedy(PARAMS, CFG, prompt(7, 4), 4)


def test_async_scheduling_refuses_pd():
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(async_scheduling=True, pd=True)


def test_async_scheduling_is_the_default_where_it_can_be():
    assert EngineConfig().uses_async_scheduling
    assert EngineConfig(num_speculative_tokens=1).uses_async_scheduling
    assert not EngineConfig(num_speculative_tokens=1, async_scheduling=False).uses_async_scheduling
    assert not EngineConfig(pd=True).uses_async_scheduling
    assert not EngineConfig(async_scheduling=False).uses_async_scheduling
    assert engine(None).async_scheduling and not engine(False).async_scheduling


# ---------------------------------------------------------------------------------- with MTP drafts
def mtp_engine(params, cfg, async_scheduling: bool, steps: int, K: int, **kw) -> LLMEngine:
    base = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, kv_page_size=8, dtype="float32",
                num_speculative_tokens=K, decode_steps_per_launch=steps)
    return LLMEngine(params, cfg, EngineConfig(**{**base, **kw}, async_scheduling=async_scheduling), garbage_seed=5)


def test_async_mtp_equals_sync_on_rejected_drafts_near_max_model_len_and_preempted():
    """Random weights reject most drafts (the booking is undone every launch); a request runs into
    max_model_len; a small pool preempts."""
    prompts = [prompt(200 + i, n) for i, n in enumerate((3, 9, 17, 100, 2, 1))]
    sp = [SamplingParams(temperature=0, max_tokens=24) for _ in prompts]
    sp[2] = SamplingParams(temperature=1.5, seed=3, max_tokens=24)  # sampled: some drafts accepted
    sp[4] = SamplingParams(temperature=0, max_tokens=5)
    kw = dict(max_model_len=120, num_kv_pages=1 + 24)
    sync_eng = mtp_engine(PARAMS, CFG, False, 2, 2, **kw)
    async_eng = mtp_engine(PARAMS, CFG, True, 2, 2, **kw)
    sync = run_recorded(sync_eng, prompts, sp)
    asyn = run_recorded(async_eng, prompts, sp)
    assert sync[0][3].finish_reason == "length" and len(sync[0][3].token_ids) == 20  # 100 + 20 = 120
    assert_async_equals_sync(sync, asyn, sync_eng, async_eng, extra_fed=2 * 2 * 3)
    assert sum(o.num_preemptions for o in asyn[0]) > 0


def test_async_mtp_books_every_draft_accepted_and_undoes_it():
    eng = mtp_engine(PARAMS, CFG, True, 1, 2)
    rid = eng.add_request(prompt(300, 5), SamplingParams(temperature=0, max_tokens=30))
    req = eng.requests[rid]
    eng.step()  # the prompt: one token booked, drafts on the device
    assert (req.num_computed, req.output_token_ids, len(req.spec_token_ids)) == (5, [PLACEHOLDER_TOKEN], 2)
    eng.step()  # a verify window booked as all accepted; the prompt's token applied
    assert req.num_computed == 5 + 3 and len(req.output_token_ids) == 1 + 3 and req.output_slack == 2
    assert req.output_token_ids[0] != PLACEHOLDER_TOKEN
    eng.step()  # the first window applied: random drafts are rejected, so its unused 2 come off
    emitted = 1 + eng.update.spec_counters.accepted_per_position.sum()
    assert req.num_computed == 5 + emitted + 3 and len(req.output_token_ids) == 1 + emitted + 3
    assert req.spec_excess == 3 - emitted
    eng.run_until_done()
    assert eng.output(rid).token_ids == naive_greedy(PARAMS, CFG, prompt(300, 5), 30)
