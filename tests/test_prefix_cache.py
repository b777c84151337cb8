"""Prefix caching: pages by content, GDN state snapshots, and outputs equal to computing every prompt whole."""

import numpy as np
import pytest
from helpers import naive_greedy, small_config

from jaxgdn.engine.config import EngineConfig
from jaxgdn.engine.llm_engine import LLMEngine
from jaxgdn.engine.prefix_cache import PageCache, PrefixCache, SnapshotIndex, page_keys
from jaxgdn.engine.request import Request, RequestMetrics, SamplingParams
from jaxgdn.model.params import init_random_params

CFG = small_config(eos_token_ids=())
PARAMS = init_random_params(CFG, seed=1)
PAGE, INTERVAL = 4, 8
RNG = np.random.default_rng(0)
BASE = [int(t) for t in RNG.integers(0, CFG.vocab_size, 40)]


def suffix(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(0, CFG.vocab_size, n)]


def engine(every_boundary: bool = True, **overrides) -> LLMEngine:
    """every_boundary: snapshots at every interval boundary, not only every COARSE-th one outside a shared prefix
    (the exactness tests put boundaries everywhere; the rule itself has its own test)."""
    ecfg = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=80, kv_page_size=PAGE, dtype="float32",
                prefix_cache_state_interval=INTERVAL, num_state_snapshots=32, compilation_cache=False)
    eng = LLMEngine(PARAMS, CFG, EngineConfig(**{**ecfg, **overrides}))
    if every_boundary:
        eng.prefix.coarse = 1
    return eng


def request(tokens, rid=0, **fields) -> Request:
    req = Request(rid, list(tokens), SamplingParams(), RequestMetrics(0.0))
    for name, value in fields.items():
        setattr(req, name, value)
    return req


# ------------------------------------------------------------------------------------------------ host side
def test_page_keys_chain_and_read_one_token_past_the_page():
    keys = page_keys(list(range(13)), 4)
    assert len(keys) == 3  # page 2 (8..11) needs token 12; page 3 would need token 16
    assert page_keys(list(range(12)), 4) == keys[:2] and len(page_keys(list(range(12)), 4, lookahead=0)) == 3
    other_next = page_keys(list(range(8)) + [99, 9, 10, 11, 12], 4)
    assert other_next[0] == keys[0] and other_next[1] != keys[1]  # the token after page 1 is part of its key
    changed_first = page_keys([7] + list(range(1, 13)), 4)
    assert all(a != b for a, b in zip(changed_first, keys))  # the chain carries every earlier token


def test_page_cache_shares_by_reference_and_evicts_least_recently_used_first():
    cache = PageCache(6)  # pages 1..5
    a = cache.allocate(3)
    assert a == [1, 2, 3] and cache.num_free == 2
    for page, key in zip(a, (b"k1", b"k2", b"k3")):
        cache.publish(page, key)
    cache.publish(4, b"k1")  # the same content elsewhere: the first page keeps the name
    assert cache.page_of[b"k1"] == 1 and 4 not in cache.key_of
    cache.acquire(cache.lookup([b"k1", b"k2", b"nope", b"k3"]))  # a second request shares pages 1 and 2
    assert list(cache.refs[1:4]) == [2, 2, 1]
    cache.free(a)  # the first request ends: 3 goes to the LRU first (a tail before its head), 1 and 2 stay held
    assert cache.num_free == 3 and cache.lookup([b"k1", b"k2", b"k3"]) == [1, 2, 3]
    cache.free([1, 2])
    got = cache.allocate(4)  # the free pages first, then the LRU: 3 (its tail), then 2
    assert got[:2] == [4, 5] and got[2:] == [3, 2] and cache.num_evicted == 2
    assert cache.lookup([b"k1", b"k2"]) == [1] and cache.num_free == 1
    with pytest.raises(MemoryError):
        cache.allocate(2)
    cache.reset()
    assert cache.lookup([b"k1"]) == [] and cache.num_free == 1


def test_snapshot_index_evicts_least_recently_used():
    snaps = SnapshotIndex(3)  # ids 1, 2
    assert [snaps.add(b"a"), snaps.add(b"b")] == [1, 2]
    assert snaps.get(b"a") == 1  # used: b is now the oldest
    assert snaps.add(b"c") == 2 and b"b" not in snaps and snaps.get(b"c") == 2


def test_a_hit_resumes_at_the_longest_prefix_with_a_snapshot_and_leaves_a_token():
    cache = PrefixCache(32, PAGE, 8, INTERVAL, enabled=True)  # snapshots every 4 * 8 tokens, or 8 where shared
    first = request(BASE[:20])
    keys = cache.keys(first)
    first.pages = cache.pages.allocate(5)
    assert len(keys) == 4  # page 4 (16..19) has no next token yet
    assert cache.chunk_end(first, 20) == 20  # a prefix nobody computed before is not cut
    assert cache.publish(first, 0, 20) is None and cache.match(request(BASE[:20], rid=1)) is None  # no snapshot yet
    second = request(BASE[:20], rid=1)
    second.pages = cache.pages.allocate(5)
    assert cache.chunk_end(second, 20) == 8  # it shares first's pages: cut where a snapshot is due
    for start, end in ((0, 8), (8, 16), (16, 20)):  # chunks as the scheduler cuts them
        key = cache.publish(second, start, end)
        if key is not None:
            cache.snapshots.add(key)
    assert len(cache.snapshots) == 2  # at 8 and 16
    hit = cache.match(request(BASE[:20], rid=2))
    assert hit.num_tokens == 16 and hit.pages == first.pages[:4]  # the first request's pages keep the names
    assert cache.match(request(BASE[:16], rid=3)).num_tokens == 8  # 16 would leave nothing to compute
    assert cache.match(request(BASE[:15] + [0, 0], rid=4)).num_tokens == 8  # parts at 15: pages 0-2, snapshot 8
    assert cache.match(request([BASE[0] + 1] + BASE[1:20], rid=5)) is None
    assert cache.match(request(BASE[:20], rid=6, next_prompt_token=BASE[20])).num_tokens == 16
    assert PrefixCache(32, PAGE, 8, INTERVAL, enabled=False).match(request(BASE[:20], rid=7)) is None


def test_prompts_that_share_nothing_are_cut_only_at_every_fourth_boundary():
    """A prefix nobody shares yet gets a snapshot at every 4th interval boundary (32 here) only, so prompts that
    share nothing are rarely cut; a later request on it resumes there."""
    eng = engine(every_boundary=False)
    sp = SamplingParams(temperature=0, max_tokens=2)
    prompts = [suffix(40, 500 + i) for i in range(3)]
    rids = [eng.add_request(p, sp) for p in prompts]
    eng.run_until_done()
    assert all(eng.output(r).token_ids == naive_greedy(PARAMS, CFG, p, 2) for r, p in zip(rids, prompts))
    assert eng.prefix.stats.snapshots_saved == 3 + 3  # at 32 and at each end (inside a page)
    again = []
    for _ in range(2):
        again.append(eng.add_request(prompts[0][:36] + [1, 2, 3], sp))
        eng.run_until_done()
    assert [eng.output(r).num_cached_tokens for r in again] == [32, 32]
    assert eng.prefix.stats.snapshots_saved == 6 + 1  # the first's end (the second ends where it did)


# ------------------------------------------------------------------------------------------------ exactness
def shared_prompts():
    """Prompts that part from BASE on a page boundary (16), one token before (15), one after (17), mid-chunk (27),
    and BASE again, each with its own tail."""
    return [BASE[:n] + suffix(5, n) for n in (16, 15, 17, 27)] + [BASE]


def run_two_waves(eng, prompts, sp):
    """BASE first, alone (its pages and snapshots are published), then every prompt at once."""
    first = eng.add_request(BASE + suffix(3, 99), sp)
    eng.run_until_done()
    rids = [eng.add_request(p, sp) for p in prompts]
    eng.run_until_done()
    return first, rids


@pytest.mark.parametrize("mode", [
    dict(async_scheduling=False),
    dict(async_scheduling=True),
    dict(num_speculative_tokens=1, async_scheduling=False),
    dict(num_speculative_tokens=2, async_scheduling=True, decode_steps_per_launch=2),
    dict(num_speculative_tokens=3, async_scheduling=False),
])
def test_greedy_tokens_with_hits_equal_the_whole_computation(mode):
    """Every mode's greedy tokens equal full recomputation, for prefixes that part on a page boundary, one token
    before or after it, mid-chunk, or not at all; the hits are where the snapshots allow."""
    eng = engine(**mode)
    sp = SamplingParams(temperature=0, max_tokens=6)
    prompts = shared_prompts()
    _, rids = run_two_waves(eng, prompts, sp)
    for rid, p in zip(rids, prompts):
        assert eng.output(rid).token_ids == naive_greedy(PARAMS, CFG, p, 6), rid
    assert [eng.output(r).num_cached_tokens for r in rids] == expected_hits(mode.get("num_speculative_tokens", 0))


def expected_hits(K):
    """shared_prompts()' hits after BASE: with MTP, BASE[:16] + tail matches pages 0-2 only (page 3's key reads the
    tail's first token), so it resumes at the snapshot at 8; without MTP at 16. BASE again: 32 (39 tokens to
    resume in, no snapshot at 36)."""
    return [8 if K else 16, 8, 16, 24, 32]


def test_mtp_kv_on_a_hit_equals_that_of_the_whole_computation():
    """The MTP layer's cached KV entries were computed with the same next token: when a request first drafts,
    the MTP layer's K for every prompt position equals that of the same request computed whole (a cached
    page's last entry reused for another next token would differ there), and so do its drafts."""
    sp = SamplingParams(temperature=0, max_tokens=8)
    prompts = shared_prompts()
    seen = []
    for caching in (True, False):
        eng = engine(num_speculative_tokens=2, async_scheduling=False, enable_prefix_caching=caching)
        first_kv, drafts = {}, {}

        def record(req, d, eng=eng, first_kv=first_kv, drafts=drafts):
            if req.request_id not in first_kv:  # the prompt is computed: its MTP entries are final
                n = len(req.prompt_token_ids) - 1
                k = np.asarray(eng.runner.state.mtp_layers[0].k[np.asarray(req.pages)])
                first_kv[req.request_id] = k.reshape(-1, *k.shape[2:])[:n]
            drafts.setdefault(req.request_id, []).append(list(d))
            return d

        eng.update.draft_override = record
        _, rids = run_two_waves(eng, prompts, sp)
        seen.append(([first_kv[r] for r in rids], [drafts[r] for r in rids],
                     [eng.output(r).num_cached_tokens for r in rids]))
    (kv_hit, drafts_hit, cached), (kv_whole, drafts_whole, _) = seen
    for a, b in zip(kv_hit, kv_whole):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert drafts_hit == drafts_whole
    assert cached == expected_hits(2)


@pytest.mark.parametrize("mode, exact_tail", [
    (dict(async_scheduling=False), True),
    (dict(async_scheduling=True, decode_steps_per_launch=2), True),
    (dict(num_speculative_tokens=2, async_scheduling=False), False),
    (dict(num_speculative_tokens=2, async_scheduling=True, decode_steps_per_launch=2), False),
])
def test_a_conversation_resumes_after_its_previous_turn(mode, exact_tail):
    """Turn n+1's prompt is turn n's prompt, its output and a new message: it resumes where turn n's state was
    kept at its end (inside a page: the partial page is copied), or at an interval snapshot where MTP verify
    windows left that end known only on the device. Tokens equal whole computation, turn after turn."""
    eng = engine(**mode)
    sp = SamplingParams(temperature=0, max_tokens=6)
    prompt, previous = BASE[:30], 0
    for turn in range(3):
        rid = eng.add_request(prompt, sp)
        eng.run_until_done()
        out = eng.output(rid)
        assert out.token_ids == naive_greedy(PARAMS, CFG, prompt, 6), turn
        allowed = {previous} if exact_tail else {previous, previous // INTERVAL * INTERVAL}
        assert out.num_cached_tokens in allowed, turn
        previous = len(prompt) + 5  # its tokens but the last output, which it never fed
        prompt = prompt + out.token_ids + suffix(3 + turn, 300 + turn)


@pytest.mark.parametrize("mode", [dict(async_scheduling=True, decode_steps_per_launch=4),
                                  dict(num_speculative_tokens=2, async_scheduling=True, decode_steps_per_launch=2)])
def test_a_request_that_stops_on_a_token_keeps_its_exact_end_state(mode):
    """A request that samples its stop token mid-way through a launch of several steps, with the next launch
    already booked: the device runs its later rows on the null slot, so the next turn resumes right after that
    turn's tokens (where the stop token ends a verify window), and every output equals whole computation."""
    eng = engine(**mode)
    prompt = BASE[:30]
    free_run = naive_greedy(PARAMS, CFG, prompt, 12)
    stop = free_run[5]
    sp = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=(stop,))
    rid = eng.add_request(prompt, sp)
    eng.run_until_done()
    out = eng.output(rid)
    assert out.finish_reason == "stop" and out.token_ids == free_run[: free_run.index(stop) + 1]
    follow = prompt + out.token_ids + suffix(4, 400)
    rid = eng.add_request(follow, SamplingParams(temperature=0, max_tokens=6))
    eng.run_until_done()
    cached = eng.output(rid).num_cached_tokens
    exact = len(prompt) + len(out.token_ids) - 1
    assert cached == exact if not mode.get("num_speculative_tokens") else cached in (exact, 24)
    assert eng.output(rid).token_ids == naive_greedy(PARAMS, CFG, follow, 6)


def test_a_hit_computes_fewer_prompt_tokens():
    """Every token a hit skips is a prompt token not computed: counted, the same workload with caching off."""
    sp = SamplingParams(temperature=0, max_tokens=2)
    stats = []
    for caching in (True, False):
        eng = engine(enable_prefix_caching=caching)
        run_two_waves(eng, shared_prompts(), sp)
        stats.append(eng.prefix.stats)
    on, off = stats
    assert on.hits > 0 and off.hits == 0
    assert on.computed == off.computed - on.hits


def test_seeded_sampling_is_the_same_with_a_hit():
    eng = engine()
    sp = SamplingParams(temperature=1.0, seed=7, max_tokens=8)
    prompt = BASE + suffix(3, 5)
    rids = []
    for _ in range(2):
        rids.append(eng.add_request(prompt, sp))
        eng.run_until_done()
    a, b = eng.output(rids[0]), eng.output(rids[1])
    assert b.num_cached_tokens == 40 and b.token_ids == a.token_ids


def test_eviction_under_memory_pressure_keeps_outputs_exact():
    """A pool of 40 pages and 2 snapshots for 12 requests over 3 shared prefixes: pages and snapshots are
    evicted all the time, requests are preempted, shared pages are never freed under a reader."""
    eng = engine(num_kv_pages=41, num_state_snapshots=2, max_model_len=64)
    sp = SamplingParams(temperature=0, max_tokens=10)
    prompts = [BASE[: 20 + 4 * (i % 3)] + suffix(1 + i % 5, 100 + i) for i in range(12)]
    rids = [eng.add_request(p, sp) for p in prompts]
    eng.run_until_done()
    for rid, p in zip(rids, prompts):
        assert eng.output(rid).token_ids == naive_greedy(PARAMS, CFG, p, 10), rid
    assert eng.prefix.pages.num_evicted > 0 and eng.prefix.stats.hits > 0
    assert eng.prefix.pages.num_free == 40 and not eng.prefix.pages.refs.any()  # every reference returned


def test_reset_and_switch_off():
    eng = engine()
    sp = SamplingParams(temperature=0, max_tokens=2)
    for _ in range(2):
        rid = eng.add_request(BASE, sp)
        eng.run_until_done()
    assert eng.output(rid).num_cached_tokens == 32
    eng.reset_prefix_cache()
    rid = eng.add_request(BASE, sp)
    eng.run_until_done()
    assert eng.output(rid).num_cached_tokens == 0
    off = engine(enable_prefix_caching=False)
    for _ in range(2):
        rid = off.add_request(BASE, sp)
        off.run_until_done()
    assert off.output(rid).num_cached_tokens == 0 and not off.cache.snapshots


def test_pd_prefill_worker_caches_and_the_handoff_says_so():
    """PD + MTP: the prefill worker resumes from its cache; the decode worker's outputs equal whole computation
    and report the cached tokens."""
    from jaxgdn.engine.workers import decode_engine, prefill_engine, run_disaggregated

    ecfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=80, kv_page_size=PAGE,
                        dtype="float32", prefix_cache_state_interval=INTERVAL, num_state_snapshots=32,
                        compilation_cache=False, pd=True,
                        num_speculative_tokens=2)
    P, D = prefill_engine(PARAMS, CFG, ecfg), decode_engine(PARAMS, CFG, ecfg)
    assert P.prefix.enabled and not D.prefix.enabled
    sp = SamplingParams(temperature=0, max_tokens=5)
    P.prefix.coarse = 1  # snapshots at every boundary (see engine())
    run_disaggregated(P, D, [BASE + suffix(2, 1)], [sp])
    prompts = shared_prompts()
    rids = run_disaggregated(P, D, prompts, [sp] * len(prompts))
    for rid, p in zip(rids, prompts):
        assert D.output(rid).token_ids == naive_greedy(PARAMS, CFG, p, 5), rid
    assert [D.output(r).num_cached_tokens for r in rids] == expected_hits(2)
    # the prompt boundary a prefill worker exported (inside a page) resumes a prompt that goes on from there
    longer = BASE + suffix(6, 77)
    (rid,) = run_disaggregated(P, D, [longer], [sp])
    assert D.output(rid).num_cached_tokens == len(BASE) - 1 + 0 and D.output(rid).token_ids == naive_greedy(
        PARAMS, CFG, longer, 5)
