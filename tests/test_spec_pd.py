"""MTP speculative decoding + PD disaggregation: greedy losslessness, PD state equivalence, the
invariants of docs/vllm-pd-mtp-gdn.md §8.1, and the #47466 regression reproduced on demand."""

import dataclasses
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import naive_greedy, random_prompt, run_staggered, small_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxgdn.engine.config import EngineConfig
from jaxgdn.engine.llm_engine import LLMEngine
from jaxgdn.engine.pd import Handoff
from jaxgdn.engine.request import RowKind, SamplingParams
from jaxgdn.engine.structured import StructuredOutputsParams
from jaxgdn.engine.workers import decode_engine, prefill_engine, run_disaggregated
from jaxgdn.model.cache import init_cache
from jaxgdn.model.forward import forward
from jaxgdn.model.params import init_random_params

CFG = small_config(eos_token_ids=())
PARAMS = init_random_params(CFG, seed=41)
GREEDY = SamplingParams(temperature=0, max_tokens=6)
LENGTHS = (1, 2, 3, 4, 5, 9, 17, 40)  # 1, 1+K and < conv width included
_refs: dict = {}


def prompt(i, n):
    return random_prompt(500 + i, n, CFG.vocab_size)


def ref(p, n=6):
    if (tuple(p), n) not in _refs:
        _refs[(tuple(p), n)] = naive_greedy(PARAMS, CFG, p, n)
    return _refs[(tuple(p), n)]


def ecfg(**kw):
    base = dict(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128, kv_page_size=4, dtype="float32")
    return EngineConfig(**{**base, **kw})


def serve(prompts, K, pd, eager=False, bug=False, per_step=2, garbage=3, params=GREEDY, transport_bytes=False,
          **kw):
    """Serve prompts with staggered arrivals; returns (outputs, decode engine)."""
    cfg = ecfg(num_speculative_tokens=K, enforce_eager=eager, reproduce_pd_mtp_bug=bug, pd=pd, **kw)
    if pd:
        P = prefill_engine(PARAMS, CFG, cfg, garbage_seed=garbage)
        D = decode_engine(PARAMS, CFG, cfg, garbage_seed=garbage + 1)
        D.update.record_inputs = True
        rids = run_disaggregated(P, D, prompts, [params] * len(prompts), transport_bytes=transport_bytes)
        return [D.output(r) for r in rids], D
    eng = LLMEngine(PARAMS, CFG, cfg, garbage_seed=garbage)
    eng.update.record_inputs = True
    rids = run_staggered(eng, prompts, per_step, params)
    return [eng.output(r) for r in rids], eng


def assert_prompt_fidelity(eng, outputs):
    for out in outputs:
        p = out.prompt_token_ids
        assert all(tok == p[pos] for pos, tok in eng.update.fed_tokens.get(out.request_id, []) if pos < len(p))


# The default suite keeps one case per axis (no PD / PD, buckets / eager, K = 1, 2, 3); `-m slow` adds the rest.
SLOW = pytest.mark.slow


@pytest.mark.parametrize("K, pd, eager, concurrency", [(1, False, False, 16), (2, True, False, 8),
                                                       pytest.param(3, True, False, 1, marks=SLOW),
                                                       pytest.param(1, True, True, 4, marks=SLOW), (3, False, True, 8)])
def test_greedy_losslessness(K, pd, eager, concurrency):
    n = 16 if concurrency == 16 else 10
    prompts = [prompt(i, LENGTHS[i % len(LENGTHS)]) for i in range(n)]
    outs, eng = serve(prompts, K, pd, eager, transport_bytes=pd, max_num_seqs=concurrency, per_step=3)
    for out, p in zip(outs, prompts):
        assert out.error is None and out.token_ids == ref(p), f"prompt length {len(p)}"
    assert_prompt_fidelity(eng, outs)
    assert eng.update.spec_counters.metrics()["num_drafted"] > 0
    if pd:
        assert eng.role.handoff_bytes_in > 0


def test_regression_47466_reproduced_and_fixed():
    """Pre-fix behaviour: PD + MTP at concurrency >= 4 makes requests diverge; concurrency 1 does not."""
    prompts = [prompt(100 + i, 6 + i) for i in range(6)]
    fixed, _ = serve(prompts, 1, pd=True)
    assert all(o.token_ids == ref(p) for o, p in zip(fixed, prompts))
    buggy, _ = serve(prompts, 1, pd=True, bug=True)
    assert sum(o.token_ids != ref(p) for o, p in zip(buggy, prompts)) >= 1
    for p in prompts[:3]:  # one request at a time: the tail is never padded, so the bug cannot fire
        alone, _ = serve([p], 1, pd=True, bug=True)
        assert alone[0].token_ids == ref(p)


def test_regression_47466_reproduced_with_prefix_cache_hits():
    """With the prefill worker resuming every prompt from its cache, the fix still holds and the bug still fires."""
    shared = prompt(200, 24)
    prompts = [shared + prompt(210 + i, 3 + i) for i in range(6)]
    outs = {}
    for bug in (False, True):
        cfg = ecfg(num_speculative_tokens=1, pd=True, reproduce_pd_mtp_bug=bug, prefix_cache_state_interval=8)
        P, D = prefill_engine(PARAMS, CFG, cfg, garbage_seed=3), decode_engine(PARAMS, CFG, cfg, garbage_seed=4)
        P.prefix.coarse = 1  # a snapshot at every interval boundary, not every 4th only
        run_disaggregated(P, D, [shared + [5, 6]], [GREEDY])  # fills the cache
        rids = run_disaggregated(P, D, prompts, [GREEDY] * len(prompts))
        outs[bug] = [D.output(r) for r in rids]
        assert all(o.num_cached_tokens == 16 for o in outs[bug])
    assert all(o.token_ids == ref(p) for o, p in zip(outs[False], prompts))
    assert sum(o.token_ids != ref(p) for o, p in zip(outs[True], prompts)) >= 1


def committed_states(eng, slot):
    """(conv window, ssm) per GDN layer at the committed offset num_accepted - 1."""
    st = eng.runner.state
    a = int(st.num_accepted[slot]) - 1
    kc1 = CFG.linear_conv_kernel_dim - 1
    return [(np.asarray(st.layers[i].conv[slot, a : a + kc1]), np.asarray(st.layers[i].ssm[slot, a]))
            for i in CFG.gdn_layer_ids]


def test_handoff_bytes_round_trip_every_field_and_reject_other_data():
    """to_bytes/from_bytes keep each array's dtype (bf16 KV, fp32 state), shape and bits, and the request
    fields; data that is not a handoff, or a cut one, is refused with a ValueError."""
    rng = np.random.default_rng(3)
    arrays = {name: jnp.asarray(rng.normal(size=shape), dtype) for name, shape, dtype in (
        ("kv_k", (2, 3, 4, 1, 8), jnp.bfloat16), ("kv_v", (2, 3, 4, 1, 8), jnp.bfloat16),
        ("mtp_k", (1, 3, 4, 1, 8), jnp.bfloat16), ("mtp_v", (0, 3, 4, 1, 8), jnp.bfloat16),
        ("conv", (3, 3, 20), jnp.float32), ("ssm", (3, 2, 4, 5), jnp.float32))}
    sp = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, max_tokens=11, seed=4, stop_token_ids=(9, 2))
    h = Handoff(prompt_token_ids=[5, 6, 7], num_computed=2, sampling_params=sp, request_id=12, **arrays)
    data = h.to_bytes()
    back = Handoff.from_bytes(data)
    assert (back.prompt_token_ids, back.num_computed, back.sampling_params, back.request_id) == ([5, 6, 7], 2, sp, 12)
    for name, arr in arrays.items():
        got = getattr(back, name)
        assert got.dtype == arr.dtype and got.shape == arr.shape
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(arr).view(np.uint8))
    for bad in (b"not a handoff at all", data[: len(data) - 4]):
        with pytest.raises(ValueError):
            Handoff.from_bytes(bad)


def test_sampling_params_survive_the_json_of_a_prefill_request():
    """What a decode server sends its prefill server (the fields as JSON) comes back equal: a JSON schema, logit
    bias, bad words and stop tokens included."""
    sp = SamplingParams(temperature=0.5, seed=3, stop_token_ids=(4, 9), logit_bias={7: -2.0}, bad_words=["ab"],
                        logprobs=2, structured_outputs=StructuredOutputsParams(json={"type": "object"}))
    assert SamplingParams.from_dict(json.loads(json.dumps(dataclasses.asdict(sp)))) == sp


@pytest.mark.parametrize("padded", [False, True])
def test_pd_state_equivalence_after_first_decode_step(padded):
    """After D's first step the committed conv and recurrent states equal a monolithic prefill."""
    K = 2
    p = prompt(7, 11)
    cfg = ecfg(num_speculative_tokens=K, pd=True)
    P = prefill_engine(PARAMS, CFG, cfg, garbage_seed=5)
    D = decode_engine(PARAMS, CFG, cfg, garbage_seed=6)
    P.role.submit(p, GREEDY)
    while P.has_unfinished:
        P.step()
    (h,) = P.role.pop_handoffs()
    assert h.num_computed == len(p) - 1 and Handoff.from_bytes(h.to_bytes()).num_computed == h.num_computed
    if padded:  # a running request in D makes the scheduler pad the tail to 1+K placeholders
        D.add_request(prompt(8, 3), SamplingParams(temperature=0, max_tokens=20))
        D.step()
    rid = D.role.submit(h)
    out = D.step()
    (row,) = [r for r in out.rows if r.request.request_id == rid]
    assert row.kind == RowKind.PROMPT_TAIL and row.padded_tail == padded
    assert row.num_tokens == (1 + K if padded else 1)
    # Monolithic reference: the whole prompt through the dense-cache model.
    _, _, cache = forward(PARAMS, CFG, jnp.asarray([p]), init_cache(CFG, 1, 32))
    for (conv, ssm), i in zip(committed_states(D, row.request.slot), CFG.gdn_layer_ids):
        np.testing.assert_allclose(conv, np.asarray(cache.layers[i].conv[0]), atol=1e-5)
        np.testing.assert_allclose(ssm, np.asarray(cache.layers[i].ssm[0]), atol=1e-5)
    assert D.output(rid).token_ids == ref(p, 1)


@pytest.mark.parametrize("kind", ["placeholder", pytest.param("zero", marks=SLOW), pytest.param("out_of_range", marks=SLOW),
                                  pytest.param("true_argmax", marks=SLOW), "mixed"])
def test_adversarial_drafts_change_acceptance_only(kind):
    K = 3
    prompts = [prompt(300 + i, 5 + 3 * i) for i in range(4)]
    truth = {tuple(p): ref(p, 12) for p in prompts}

    def override(req, drafts):
        n = len(req.output_token_ids)
        true = (truth[tuple(req.prompt_token_ids)] + [0] * 8)[n : n + K]
        return {"placeholder": [-1] * K, "zero": [0] * K, "out_of_range": [CFG.vocab_size + 5] * K,
                "true_argmax": true, "mixed": [true[0], -1, true[2]]}[kind]

    cfg = ecfg(num_speculative_tokens=K)
    eng = LLMEngine(PARAMS, CFG, cfg, garbage_seed=2)
    eng.update.draft_override = override
    rids = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=12)) for p in prompts]
    accepted_in_range = True
    while eng.has_unfinished:
        out = eng.step()
        na = np.asarray(eng.runner.state.num_accepted)
        for row in out.rows:  # accounting: 1 <= num_accepted <= 1+K for every slot still held
            if row.request.slot:
                accepted_in_range &= bool(1 <= na[row.request.slot] <= 1 + K)
    assert accepted_in_range
    for r, p in zip(rids, prompts):
        assert eng.output(r).token_ids == truth[tuple(p)]
    m = eng.update.spec_counters.metrics()
    if kind == "true_argmax":
        assert m["acceptance_rate"] > 0.9
    elif kind in ("placeholder", "out_of_range"):
        assert m["num_accepted"] == 0
    elif kind == "mixed":
        assert m["acceptance_rate_per_position"][1] == 0 and m["acceptance_rate_per_position"][0] > 0.9


def test_accounting_identities():
    """num_computed advances by q - rejected; rejected = drafts - (sampled - 1); logits rows = 1 + drafts."""
    K = 2
    cfg = ecfg(num_speculative_tokens=K)
    eng = LLMEngine(PARAMS, CFG, cfg)
    for i in range(3):
        eng.add_request(prompt(600 + i, 4 + i), SamplingParams(temperature=0, max_tokens=8))
    while eng.has_unfinished:
        before = {r.request_id: (r.num_computed, r.num_tokens) for r in eng.scheduler.running + list(eng.scheduler.waiting)}
        out = eng.step()
        for row in out.rows:
            req = row.request
            c0, n0 = before[req.request_id]
            produced = req.num_tokens - n0
            if row.kind == RowKind.SPEC_VERIFY and req.finish_reason is None:
                rejected = len(row.spec_tokens) - (produced - 1)
                assert 0 <= rejected <= len(row.spec_tokens)
                assert req.num_computed == c0 + row.num_tokens - rejected
            elif row.kind == RowKind.PREFILL_CHUNK and not row.samples:
                assert req.num_computed == c0 + row.num_tokens and produced == 0


def test_padding_is_a_no_op():
    prompts = [prompt(700 + i, 3 + 4 * i) for i in range(5)]
    padded, _ = serve(prompts, 2, pd=True, pad_prompt_tail=True)
    unpadded, _ = serve(prompts, 2, pd=True, pad_prompt_tail=False)
    assert [o.token_ids for o in padded] == [o.token_ids for o in unpadded] == [ref(p) for p in prompts]


def test_temperature_sampling_with_mtp_matches_plain_sampling():
    """Chi-square homogeneity of the 3rd sampled token, K=2 with drafts that are sometimes right vs K=0."""
    cfg_v = small_config(vocab_size=8, eos_token_ids=())
    params = init_random_params(cfg_v, seed=3)
    sp = SamplingParams(temperature=1.0, max_tokens=3)

    def third_tokens(K):
        eng = LLMEngine(params, cfg_v, ecfg(num_speculative_tokens=K, max_num_seqs=32, max_num_batched_tokens=128))
        if K:
            eng.update.draft_override = lambda req, d: [req.output_token_ids[-1] % 8, 2][:K]
        rids = [eng.add_request([1, 2, 3], sp) for _ in range(1500)]
        eng.run_until_done()
        return np.bincount([eng.output(r).token_ids[2] for r in rids], minlength=8), eng

    plain, _ = third_tokens(0)
    spec, eng = third_tokens(2)
    assert eng.update.spec_counters.metrics()["num_accepted"] > 50  # both the accept and the residual paths ran
    table = np.stack([plain, spec]).astype(float)
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    keep = expected.min(0) > 0
    chi2 = float((((table - expected) ** 2) / np.where(expected > 0, expected, 1))[:, keep].sum())
    assert chi2 < 24.3, (chi2, plain, spec)  # df <= 7, p = 0.001


FUZZ_EXAMPLES = int(os.environ.get("JAXGDN_FUZZ_EXAMPLES", "4"))


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(
    lengths=st.lists(st.sampled_from([1, 2, 3, 4, 6, 11, 33]), min_size=1, max_size=6),
    K=st.integers(1, 3),
    max_num_seqs=st.sampled_from([2, 4, 8]),
    pd=st.booleans(),
    eager=st.booleans(),
    per_step=st.integers(1, 3),
)
def test_random_workloads_equal_plain_greedy(lengths, K, max_num_seqs, pd, eager, per_step):
    prompts = [prompt(900 + i, n) for i, n in enumerate(lengths)]
    outs, _ = serve(prompts, K, pd, eager, per_step=per_step, max_num_seqs=max_num_seqs,
                    params=SamplingParams(temperature=0, max_tokens=4))
    assert [o.token_ids for o in outs] == [ref(p, 4) for p in prompts]


def test_mtp_draft_equals_dense_mtp_head():
    """The engine's first draft is the argmax of the dense MTP head on (hidden of the last prompt
    position, sampled token): paged MTP KV, positions and the shift-left input are right."""
    from jaxgdn.model.mtp import mtp_forward

    p = prompt(1000, 9)
    # synchronous: the step brings its drafts to the host (async scheduling leaves them on the device)
    eng = LLMEngine(PARAMS, CFG, ecfg(num_speculative_tokens=1, async_scheduling=False))
    eng.add_request(p, SamplingParams(temperature=0, max_tokens=3))
    eng.step()  # the prefill samples y_1 and drafts d_1
    req = eng.scheduler.running[0]
    y1 = req.output_token_ids[0]
    _, hidden, _ = forward(PARAMS, CFG, jnp.asarray([p]))
    logits, _, _ = mtp_forward(PARAMS, CFG, hidden, jnp.asarray([p[1:] + [y1]]))
    assert req.spec_token_ids == [int(jnp.argmax(logits[0, -1]))]



@pytest.mark.parametrize("bug", [False, pytest.param(True, marks=SLOW)])  # the bug itself: test_regression_47466
def test_one_row_kind_drives_every_consumer(bug):
    """For every scheduled row of a PD + MTP run: the kernel's last_sampled write, the GDN state path,
    the number of logits rows and the sampler all follow from the row kind (and the bug flag)."""

    from pallas_kernels.input_assembly import combine_reference

    K = 2
    cfg = ecfg(num_speculative_tokens=K, pd=True, reproduce_pd_mtp_bug=bug)
    P, D = prefill_engine(PARAMS, CFG, cfg), decode_engine(PARAMS, CFG, cfg)
    seen = set()
    dispatch, fetch = D.runner.dispatch, D.runner.fetch
    launched = {}  # id of a launch's pending results -> its arrays

    def recorded_dispatch(arrays, *rest):
        pending = dispatch(arrays, *rest)
        launched[id(pending)] = arrays
        return pending

    def checked_fetch(pending):
        (res,) = fetch(pending)  # PD runs one step a launch
        arrays = launched.pop(id(pending))
        n_logits = np.diff(arrays.cu_num_logits)
        last = np.full(cfg.num_slots, -7, np.int32)  # a marker: where does last_sampled land?
        drafts = np.full((cfg.num_slots, K), -9, np.int32)
        ids, _ = combine_reference(arrays.input_ids, arrays.idx_mapping, last, arrays.query_start_loc,
                                   arrays.seq_lens, arrays.prefill_len, drafts, arrays.cu_num_logits,
                                   int(arrays.cu_num_logits[-1]), unguarded=bug)
        for b, kind in enumerate(arrays.row_kind):
            kind = RowKind(kind)
            if kind == RowKind.PAD:
                continue
            qs, qe = arrays.query_start_loc[b], arrays.query_start_loc[b + 1]
            wrote_last = bool((ids[qs:qe] == -7).any())
            padded = bool(arrays.pad_tail[b])
            seen.add((kind, padded))
            assert n_logits[b] == (1 + K if kind == RowKind.SPEC_VERIFY or padded else 1)
            assert wrote_last == (kind in (RowKind.DECODE, RowKind.SPEC_VERIFY) or (bug and padded))
            fixed_verify = kind == RowKind.SPEC_VERIFY or padded
            assert bool(arrays.verify_path[b]) == (fixed_verify and not (bug and padded))
            if arrays.samples[b]:
                assert 1 <= res.num_sampled[b] <= n_logits[b]
            else:
                assert kind == RowKind.PREFILL_CHUNK and res.num_sampled[b] == 0
        return [res]

    D.runner.dispatch, D.runner.fetch = recorded_dispatch, checked_fetch
    prompts = [prompt(800 + i, 3 + 5 * i) for i in range(6)]
    run_disaggregated(P, D, prompts, [SamplingParams(temperature=0, max_tokens=5)] * len(prompts))
    assert (RowKind.PROMPT_TAIL, True) in seen and (RowKind.SPEC_VERIFY, False) in seen


def test_a_repeated_workload_compiles_nothing():
    """Serving a workload a second time runs only programs the first run compiled: any lowering inside it
    would be a compile in the middle of serving (a step input of a size the first run saw only once used
    to compile its device write there, 3x slower MTP K >= 2 on the H200)."""
    import jax.monitoring

    eng = LLMEngine(PARAMS, CFG, ecfg(num_speculative_tokens=2))
    prompts = [prompt(700 + i, 3 + 5 * i) for i in range(5)]

    def serve_all():
        rids = run_staggered(eng, prompts, 2, SamplingParams(temperature=0, max_tokens=7))
        assert all(eng.output(r).error is None for r in rids)

    serve_all()
    lowerings = []

    def record(name, secs, **kw):
        if name.startswith("/jax/core/compile/"):
            lowerings.append(name)

    jax.monitoring.register_event_duration_secs_listener(record)
    try:
        serve_all()
    finally:
        jax.monitoring.unregister_event_duration_listener(record)
    assert eng.update.spec_counters.metrics()["acceptance_rate"] < 1  # rejections happened: the verify path varied
    assert lowerings == []
