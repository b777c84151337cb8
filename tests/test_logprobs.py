"""Logprobs of sampled and prompt tokens: equal to a float64 log-softmax of the HF reference's logits in every
mode (plain, MTP, async scheduling, multi-step launches, PD, PD + MTP); shapes as vLLM's."""

import numpy as np
import pytest
from helpers import hf_causal_lm, hf_logits, run_staggered, shipped_model, small_config

from jaxgdn.engine.config import EngineConfig
from jaxgdn.engine.llm_engine import LLMEngine
from jaxgdn.engine.logprobs import Logprob, Sampler, launch_sampler, top_k_blocked
from jaxgdn.engine.request import SamplingParams
from jaxgdn.engine.workers import decode_engine, prefill_engine, run_disaggregated
from jaxgdn.model.params import init_random_params

CFG = small_config(eos_token_ids=())
PARAMS = init_random_params(CFG, seed=7)
TOP = 5
PROMPTS = [[int(t) for t in np.random.default_rng(900 + i).integers(0, CFG.vocab_size, n)]
           for i, n in enumerate((1, 3, 9, 23, 40))]
_hf = []


def reference_logprobs(ids) -> np.ndarray:
    """[len(ids), V] float64 log-softmax of the HF model's fp32 logits over ids."""
    if not _hf:
        _hf.append(hf_causal_lm(CFG, PARAMS))
    logits = hf_logits(_hf[0], [ids])[0].astype(np.float64)
    return logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)


def check_entry(entry: dict, token: int, ref_row: np.ndarray, num_top: int):
    """vLLM's entry: the target token first, then the top num_top by rank; values equal the reference's."""
    assert next(iter(entry)) == token and all(isinstance(v, Logprob) for v in entry.values())
    assert abs(entry[token].logprob - ref_row[token]) < 1e-4
    assert entry[token].rank == 1 + int(np.sum(ref_row > ref_row[token] + 1e-6))
    order = np.argsort(-ref_row)[:num_top]
    top = sorted((v.rank, t) for t, v in entry.items() if v.rank <= num_top)
    assert [t for _, t in top][:num_top] == [int(t) for t in order] or token in order
    for t in order:
        assert abs(entry[int(t)].logprob - ref_row[t]) < 1e-4


def check_output(out, num_top: int = TOP):
    ids = out.prompt_token_ids + out.token_ids
    ref = reference_logprobs(ids)
    n = len(out.prompt_token_ids)
    assert len(out.logprobs) == len(out.token_ids)
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        check_entry(entry, token, ref[n - 1 + i], num_top)
    assert len(out.prompt_logprobs) == n and out.prompt_logprobs[0] is None
    for p in range(1, n):
        check_entry(out.prompt_logprobs[p], out.prompt_token_ids[p], ref[p - 1], num_top)


def ecfg(**kw):
    base = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=96, kv_page_size=4, dtype="float32",
                compilation_cache=False)
    return EngineConfig(**{**base, **kw})


PARAMS_GREEDY = SamplingParams(temperature=0, max_tokens=7, logprobs=TOP, prompt_logprobs=TOP)


@pytest.mark.parametrize("K, pd, async_scheduling, launch", [
    (0, False, False, 1), (2, False, True, 1), (0, False, True, 4), (1, True, None, 1), (3, True, None, 1)])
def test_logprobs_equal_the_reference_in_every_mode(K, pd, async_scheduling, launch):
    cfg = ecfg(num_speculative_tokens=K, pd=pd, async_scheduling=async_scheduling, decode_steps_per_launch=launch)
    if pd:
        P, D = prefill_engine(PARAMS, CFG, cfg), decode_engine(PARAMS, CFG, cfg)
        rids = run_disaggregated(P, D, PROMPTS, [PARAMS_GREEDY] * len(PROMPTS), transport_bytes=True)
        outs = [D.output(r) for r in rids]
    else:
        eng = LLMEngine(PARAMS, CFG, cfg)
        outs = [eng.output(r) for r in run_staggered(eng, PROMPTS, 2, PARAMS_GREEDY)]
    for out in outs:
        assert out.error is None
        check_output(out)


def test_greedy_tokens_with_and_without_logprobs_are_the_same_and_none_are_returned_unasked():
    eng = LLMEngine(PARAMS, CFG, ecfg(num_speculative_tokens=2))
    plain = SamplingParams(temperature=0, max_tokens=7)
    rids = run_staggered(eng, PROMPTS + PROMPTS, 2, [plain] * len(PROMPTS) + [PARAMS_GREEDY] * len(PROMPTS))
    outs = [eng.output(r) for r in rids]
    for a, b in zip(outs[: len(PROMPTS)], outs[len(PROMPTS):]):
        assert a.token_ids == b.token_ids and a.logprobs is None and a.prompt_logprobs is None
        assert len(b.logprobs) == len(b.token_ids)


def test_accepted_drafts_report_the_target_models_logprobs():
    """The shipped model accepts most MTP drafts: each accepted token's entry comes from the verify logits at its
    position, equal to plain decoding's (launches of 3 verify steps, async)."""
    params, cfg, prompts = shipped_model()
    sp = SamplingParams(temperature=0, max_tokens=24, logprobs=TOP)
    base = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=192, dtype="float32", compilation_cache=False)
    plain, spec = (LLMEngine(params, cfg, EngineConfig(**base, num_speculative_tokens=K, decode_steps_per_launch=n))
                   for K, n in ((0, 1), (2, 3)))
    outs = [[eng.output(r) for r in run_staggered(eng, prompts[:3], 2, sp)] for eng in (plain, spec)]
    assert spec.update.spec_counters.metrics()["acceptance_rate"] > 0.5
    for a, b in zip(*outs):
        assert a.token_ids == b.token_ids and len(b.logprobs) == len(b.token_ids)
        for x, y in zip(a.logprobs, b.logprobs):
            assert list(x) == list(y) and all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
            assert [v.rank for v in x.values()] == [v.rank for v in y.values()]


def test_sampled_requests_report_the_raw_distribution_and_logprobs_zero_only_the_token():
    eng = LLMEngine(PARAMS, CFG, ecfg())
    sp = SamplingParams(temperature=0.7, top_k=5, max_tokens=6, seed=3, logprobs=0)
    out = eng.output(run_staggered(eng, PROMPTS[2:4], 2, sp)[1])
    ref = reference_logprobs(out.prompt_token_ids + out.token_ids)
    n = len(out.prompt_token_ids)
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert list(entry) == [token]  # logprobs=0: the sampled token alone
        assert abs(entry[token].logprob - ref[n - 1 + i][token]) < 1e-4  # before temperature and top-k


def test_the_launch_picks_the_least_program_variant():
    class Row:
        def __init__(self, sp, computed, samples=True):
            self.samples = samples
            self.request = type("R", (), dict(sampling_params=sp, num_computed=computed, prompt_token_ids=[1] * 8,
                                              prefill_only=False))()

    plain, lp = SamplingParams(temperature=0), SamplingParams(temperature=0, logprobs=1)
    prompt_lp = SamplingParams(temperature=0, prompt_logprobs=1)
    assert launch_sampler([Row(plain, 0)]) == Sampler.GREEDY
    assert launch_sampler([Row(plain, 0), Row(lp, 3)]) == Sampler.LOGPROBS
    assert not Sampler.LOGPROBS & Sampler.SAMPLE  # a greedy launch that scores keeps the argmax path
    assert launch_sampler([Row(lp, 3, samples=False)]) == Sampler.GREEDY
    assert launch_sampler([Row(prompt_lp, 6, samples=False)]) == Sampler.STREAM
    assert launch_sampler([Row(prompt_lp, 7)]) == Sampler.GREEDY  # its prompt's last token: nothing to score


@pytest.mark.parametrize("vocab, k", [(1000, 20), (1024, 5), (37, 20), (300, 3)])
def test_blocked_top_k_equals_top_k(vocab, k):
    import jax

    x = np.random.default_rng(vocab).standard_normal((6, vocab)).astype(np.float32)
    x[0, ::2] = -np.inf  # a row with masked entries
    values, ids = top_k_blocked(x, k, block=16)
    want_values, want_ids = jax.lax.top_k(x, k)
    np.testing.assert_array_equal(values, want_values)
    np.testing.assert_array_equal(ids, want_ids)


@pytest.mark.parametrize("field, value", [("logprobs", 21), ("logprobs", -1), ("prompt_logprobs", 1.5)])
def test_bad_logprobs_counts_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}).validate()
