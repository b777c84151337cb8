"""PD handoffs written in place by programs compiled at start-up (engine/state_copies.py): once `LLM(...)` returns,
no PD mode compiles anything (JAX's own compile events, not the engine's counters), an import or transfer leaves the
decode worker's pools in the buffers they were in, and a prefill worker holds a finished prompt's pages and slot
only until its handoff is taken."""

import jax
import pytest
from helpers import naive_greedy, random_prompt, small_config

from jaxgdn.engine.compile_times import CompileEvents
from jaxgdn.engine.config import EngineConfig
from jaxgdn.engine.request import SamplingParams
from jaxgdn.engine.state_copies import page_buckets
from jaxgdn.engine.workers import decode_engine, prefill_engine, run_disaggregated
from jaxgdn.llm import LLM
from jaxgdn.model.checkpoint import save_checkpoint
from jaxgdn.model.params import init_random_params

CFG = small_config(eos_token_ids=())
PARAMS = init_random_params(CFG, seed=17)


def ecfg(**kw):
    base = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, kv_page_size=4, dtype="float32",
                prefix_cache_state_interval=8, pd=True)
    return EngineConfig(**{**base, **kw})


def prompt(i, n):
    return random_prompt(40 + i, n, CFG.vocab_size, low=2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(save_checkpoint(tmp_path_factory.mktemp("pd") / "ck", CFG, PARAMS))


def workload():
    """Mixed lengths (one token, one chunk, several chunks), two prompts sharing a 24-token prefix with an earlier
    one (prefix-cache hits on the prefill worker), greedy and seeded sampling, and prompt logprobs."""
    shared = prompt(0, 30)
    prompts = [shared, prompt(1, 1), prompt(2, 5), prompt(3, 70), shared[:24] + prompt(4, 6), shared[:24] + [7, 8],
               prompt(5, 13), prompt(6, 2)]
    params = [SamplingParams(temperature=0, max_tokens=5, prompt_logprobs=2 if i == 2 else None) if i % 3 else
              SamplingParams(temperature=0.9, seed=i, max_tokens=5) for i in range(len(prompts))]
    return prompts, params


@pytest.mark.parametrize("K, transport", [(1, "object"), (0, "bytes")])
def test_no_pd_mode_compiles_after_start_up(checkpoint, K, transport):
    """PD + MTP with in-place transfers, prefix-cache hits and prompt logprobs; PD with every handoff exported as
    bytes and imported: zero JAX compile events from the end of LLM(...) on, and every greedy request's tokens are
    one-request greedy decoding's."""
    prompts, params = workload()
    with LLM(checkpoint, ecfg(num_speculative_tokens=K), handoff_transport=transport) as llm:
        llm.prefill_worker.prefix.coarse = 1  # a snapshot at every interval boundary: the shared prefix hits
        with CompileEvents() as events:
            outs = llm.generate(prompts[:1], params[:1], use_tqdm=False)  # fills the prefix cache
            outs += llm.generate(prompts[1:], params[1:], use_tqdm=False)
        assert events.count == 0, dict(events.names)
        assert llm.compiles_after_startup == 0
        m = llm.metrics()
        assert m["handoff_bytes"] > 0 and m["prefix_cache_hits"] > 0
        assert (llm.engine.role.source is not None) == (transport == "object")  # in place, or exported and imported
    for out, p, sp in zip(outs, prompts, params):
        assert out.error is None and len(out.token_ids) == 5
        if sp.temperature == 0:
            assert out.token_ids == naive_greedy(PARAMS, CFG, p, 5, pad_to=128)
    assert len(outs[2].prompt_logprobs) == len(prompts[2]) and outs[2].prompt_logprobs[0] is None
    assert outs[4].num_cached_tokens > 0


def _pointers(state) -> list[int]:
    return [x.unsafe_buffer_pointer() for x in jax.tree.leaves(state)]


@pytest.mark.parametrize("transport", ["object", "bytes"])
def test_a_handoff_writes_the_decode_pools_in_place(transport):
    """Every pool buffer of the decode worker keeps its device address through an import or transfer (and the step
    after it): the handoff is written into the pools, no new pool is allocated (an eager `.at[].set` makes one)."""
    cfg = ecfg(num_speculative_tokens=1)
    P, D = prefill_engine(PARAMS, CFG, cfg), decode_engine(PARAMS, CFG, cfg)
    D.role.connect(P, transport)
    P.precompile(sampled=False)
    D.precompile()
    P.role.submit(prompt(7, 41), SamplingParams(temperature=0, max_tokens=3))
    while P.has_unfinished:
        P.step()
    (h,) = P.role.pop_handoffs()
    if transport == "bytes":
        from jaxgdn.engine.pd import Handoff

        h = Handoff.from_bytes(h.to_bytes())
    jax.block_until_ready(D.runner.state)
    before = _pointers(D.runner.state)
    rid = D.role.submit(h)
    D.step()  # admits it: the handoff is written into its pages and slot, then the prompt tail runs
    jax.block_until_ready(D.runner.state)
    assert _pointers(D.runner.state) == before
    D.run_until_done()
    assert D.output(rid).token_ids == naive_greedy(PARAMS, CFG, prompt(7, 41), 3, pad_to=128)
    assert not P.role.parked and P.usage()["slots_used"] == 0 and P.usage()["kv_pages_used"] == 0


def test_a_prefill_worker_holds_a_prompt_until_its_handoff_is_taken():
    """A finished prompt keeps its pages and slot (its state is read from there); taking the handoff (a transfer, an
    export, an abort, or dropping it unused) frees them, and a prefill worker whose slots all wait on its decode
    worker waits instead of failing."""
    cfg = ecfg(max_num_seqs=2)
    P, D = prefill_engine(PARAMS, CFG, cfg), decode_engine(PARAMS, CFG, cfg)
    D.role.connect(P)
    for i in range(3):
        P.role.submit(prompt(10 + i, 9), SamplingParams(temperature=0, max_tokens=2))
    for _ in range(6):  # two prompts park; the third waits for a slot, without an error
        P.step()
    assert len(P.role.parked) == 2 and P.usage()["slots_used"] == 2 and P.usage()["waiting"] == 1
    first, second = P.role.pop_handoffs()
    D.role.submit(first)
    D.step()  # transferred: its slot is free
    assert len(P.role.parked) == 1
    del second  # dropped without being taken: freed at the prefill worker's next step
    P.step()
    assert len(P.role.parked) <= 1 and P.usage()["waiting"] == 0
    P.step()
    (third,) = P.role.pop_handoffs()
    third.export()  # gathered into arrays: its pages and slot are free
    assert not P.role.parked and P.usage()["kv_pages_used"] == 0
    assert third.valid_pages == -(-third.num_computed // cfg.kv_page_size)
    assert third.kv_k.shape[1] in page_buckets(cfg.max_pages_per_seq)


def test_run_disaggregated_frees_everything_in_both_workers():
    prompts, params = workload()
    P, D = prefill_engine(PARAMS, CFG, ecfg()), decode_engine(PARAMS, CFG, ecfg())
    rids = run_disaggregated(P, D, prompts, params)
    assert all(D.output(r).error is None for r in rids)
    P.reset_prefix_cache()
    assert not P.role.parked
    for e in (P, D):
        assert e.usage()["slots_used"] == 0 and e.usage()["kv_pages_used"] == 0


def test_the_copy_programs_temporaries_are_in_the_memory_plan():
    """Every state copy program a PD pair compiles needs at most the temporaries its worker's memory plan set aside
    for copies (XLA's memory analysis of the compiled programs)."""
    cfg = ecfg(num_speculative_tokens=1)
    P, D = prefill_engine(PARAMS, CFG, cfg), decode_engine(PARAMS, CFG, cfg)
    D.role.connect(P)
    P.role.exports = True  # the export programs too
    P.precompile(sampled=False)
    D.precompile()
    D.copies.precompile(D.runner.state, D.copies.program_names(False, True, False, False))  # and its imports
    for worker in (P, D):
        programs = dict(worker.copies._programs)
        assert {name for name, *_ in programs} >= ({"export", "save", "restore", "copy_pages"} if worker is P
                                                   else {"import", "transfer"})
        for key, program in programs.items():
            temp = program.memory_analysis().temp_size_in_bytes
            assert temp <= worker.memory.copy_peak, (key, temp, worker.memory.copy_peak)
