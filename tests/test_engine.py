"""The engine: greedy outputs equal a naive full-recompute reference under continuous batching, chunked
prefill, buckets on/off, garbage-filled slots and preemption; bad input is isolated; pools drain."""

import numpy as np
import pytest
from helpers import naive_greedy, random_prompt, run_staggered, small_config, small_engine

from jaxgdn.engine.config import EngineConfig
from jaxgdn.engine.llm_engine import LLMEngine
from jaxgdn.engine.request import RowKind, SamplingParams
from jaxgdn.engine.runner import layout_tokens
from jaxgdn.model.params import init_random_params

CFG = small_config(eos_token_ids=())
PARAMS = init_random_params(CFG, seed=21)
LENGTHS = (1, 2, 3, 4, 63, 64, 65, 200)
GREEDY = SamplingParams(temperature=0, max_tokens=5)
_reference_cache: dict = {}


def prompt(i: int, length: int) -> list[int]:
    return random_prompt(1000 + i, length, CFG.vocab_size)


def reference(p: list[int], n: int) -> list[int]:
    key = (tuple(p), n)
    if key not in _reference_cache:
        _reference_cache[key] = naive_greedy(PARAMS, CFG, p, n)
    return _reference_cache[key]


def engine(**kw) -> LLMEngine:
    return small_engine(PARAMS, CFG, **{"garbage_seed": 7, "max_num_seqs": 8, "max_model_len": 256, **kw})


@pytest.mark.parametrize("enforce_eager", [False, pytest.param(True, marks=pytest.mark.slow)])  # eager: test_spec_pd
def test_sixteen_staggered_requests_equal_naive_reference(enforce_eager):
    """Also: steps of >= 16 tokens run the library-GEMM program (EngineConfig.library_gemms_min_tokens; the
    same math, its compiler option matters on a GPU only), shorter ones the default program."""
    prompts = [prompt(i, LENGTHS[i % len(LENGTHS)]) for i in range(16)]
    eng = engine(enforce_eager=enforce_eager, library_gemms_min_tokens=16)
    eng.update.record_inputs = True
    r = eng.runner
    assert r.program((("input_ids", (16,), "int32"),)) is r._library_step is not r._step
    assert r.program((("input_ids", (15,), "int32"),)) is r._step
    rids = run_staggered(eng, prompts, 2, GREEDY)
    for rid, p in zip(rids, prompts):
        out = eng.output(rid)
        assert out.error is None and out.finish_reason == "length"
        assert out.token_ids == reference(p, 5), f"request {rid} (prompt length {len(p)})"
        # Prompt fidelity: every token fed at a position < prompt length is the prompt token.
        fed = eng.update.fed_tokens[rid]
        assert all(tok == p[pos] for pos, tok in fed if pos < len(p))
    if not enforce_eager:  # the program set bounds the compiles: token buckets 16 and 32, greedy
        assert eng.runner.num_programs <= 2
    token_buckets = {layout_tokens(key[0]) for key in eng.runner.program_keys}
    assert min(token_buckets) < 16 <= max(token_buckets) if enforce_eager else token_buckets == {16, 32}


@pytest.mark.parametrize("n_requests, fold_norms", [(1, False), (3, True)])  # the norms unfolded too
def test_low_concurrency_and_pallas_input_kernel(n_requests, fold_norms):
    prompts = [prompt(50 + i, LENGTHS[(3 * i + 4) % len(LENGTHS)]) for i in range(n_requests)]
    eng = engine(input_impl="pallas", max_num_batched_tokens=512, fold_norms=fold_norms)
    assert (eng.runner.params.layers[0].input_layernorm is None) == fold_norms
    rids = run_staggered(eng, prompts, n_requests, GREEDY)
    assert [eng.output(r).token_ids for r in rids] == [reference(p, 5) for p in prompts]


def test_tiny_budget_forces_chunks_and_row_kinds_follow_state():
    p = prompt(99, 65)
    eng = engine(max_num_batched_tokens=4)
    rid = eng.add_request(p, GREEDY)
    kinds = []
    while eng.has_unfinished:
        kinds += [(row.kind, row.num_tokens) for row in eng.step().rows]
    assert eng.output(rid).token_ids == reference(p, 5)
    # 65 prompt tokens in chunks of 4: 16 chunks, then a 1-token prompt tail, then 4 decodes.
    assert kinds == [(RowKind.PREFILL_CHUNK, 4)] * 16 + [(RowKind.PROMPT_TAIL, 1)] + [(RowKind.DECODE, 1)] * 4


def test_preemption_recomputes_and_never_corrupts():
    """A pool too small for all requests at once: some are preempted and recomputed, outputs unchanged."""
    prompts = [prompt(200 + i, 20 + 7 * i) for i in range(6)]
    eng = engine(num_kv_pages=1 + 32, max_model_len=256, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=30)
    rids = [eng.add_request(p, params) for p in prompts]
    while eng.has_unfinished:
        eng.step()
    outs = [eng.output(r) for r in rids]
    assert sum(o.num_preemptions for o in outs) > 0
    for o, p in zip(outs, prompts):
        assert o.token_ids == reference(p, 30)
    assert eng.scheduler.pages.num_free == 32 and eng.scheduler.slots.num_free == 8


@pytest.mark.parametrize(
    "bad_prompt, bad_params, message",
    [
        ([], GREEDY, "empty prompt"),
        ([3, 256, 4], GREEDY, "outside the vocabulary"),
        ([-1, 2], GREEDY, "outside the vocabulary"),
        (list(range(1, 100)) * 3, GREEDY, "max_model_len"),
        ([1, 2], SamplingParams(temperature=-0.5), "temperature"),
        ([1, 2], SamplingParams(top_p=0.0), "top_p"),
        ([1, 2], SamplingParams(top_p=1.5), "top_p"),
        ([1, 2], SamplingParams(max_tokens=0), "max_tokens"),
    ],
)
def test_bad_input_is_an_error_for_that_request_only(bad_prompt, bad_params, message):
    eng = engine()
    good = prompt(300, 9)
    r1 = eng.add_request(good, GREEDY)
    bad = eng.add_request(bad_prompt, bad_params)
    r2 = eng.add_request(good, GREEDY)
    while eng.has_unfinished:
        eng.step()
    out = eng.output(bad)
    assert out.finish_reason == "error" and message in out.error and out.token_ids == []
    assert eng.output(r1).token_ids == eng.output(r2).token_ids == reference(good, 5)


def test_thousand_requests_leave_every_page_and_slot_free():
    eng = engine(max_num_seqs=16, num_kv_pages=1 + 40, max_num_batched_tokens=64, kv_page_size=4, max_model_len=64)
    rng = np.random.default_rng(5)
    rids = []
    for i in range(1000):
        n = int(rng.integers(1, 6))
        rids.append(eng.add_request([int(t) for t in rng.integers(0, 256, n)],
                                    SamplingParams(temperature=0, max_tokens=int(rng.integers(1, 4)))))
    while eng.has_unfinished:
        eng.step()
    assert all(eng.output(r).finish_reason == "length" for r in rids)
    assert eng.scheduler.pages.num_free == 40 and eng.scheduler.slots.num_free == 16


def test_stops_on_eos_stop_ids_and_max_model_len():
    p = prompt(400, 6)
    free_run = reference(p, 5)
    # eos from the checkpoint config
    eng = LLMEngine(PARAMS, CFG.replace(eos_token_ids=(free_run[2],)), EngineConfig(max_model_len=64, kv_page_size=8, dtype="float32"))
    rid = eng.add_request(p, GREEDY)
    eng.run_until_done()
    first = free_run.index(free_run[2])
    assert eng.output(rid).token_ids == free_run[: first + 1] and eng.output(rid).finish_reason == "stop"
    # ignore_eos keeps going
    rid = eng.add_request(p, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    eng.run_until_done()
    assert eng.output(rid).token_ids == free_run
    # stop_token_ids
    eng2 = engine()
    rid = eng2.add_request(p, SamplingParams(temperature=0, max_tokens=5, stop_token_ids=(free_run[1],)))
    eng2.run_until_done()
    assert eng2.output(rid).token_ids == free_run[: free_run.index(free_run[1]) + 1]
    # max_model_len: 6 prompt tokens + 2 outputs = 8
    eng3 = engine(max_model_len=8)
    rid = eng3.add_request(p, SamplingParams(temperature=0, max_tokens=50))
    eng3.run_until_done()
    assert eng3.output(rid).token_ids == free_run[:2] and eng3.output(rid).finish_reason == "length"


def test_default_bf16_config_serves_like_fp32():
    """The default EngineConfig (bf16 weights/activations, fp32 GDN state) with PD + MTP gives the fp32
    greedy tokens on this model (bf16 rounding could flip near-ties; these prompts have none)."""
    import jax.numpy as jnp

    from jaxgdn.engine.workers import decode_engine, prefill_engine, run_disaggregated

    p16 = init_random_params(CFG, seed=21, dtype=jnp.bfloat16)
    ecfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, kv_page_size=8,
                        num_speculative_tokens=2, pd=True)
    assert ecfg.dtype == "bfloat16"
    P, D = prefill_engine(p16, CFG, ecfg), decode_engine(p16, CFG, ecfg)
    prompts = [prompt(1100 + i, n) for i, n in enumerate((1, 5, 30))]
    rids = run_disaggregated(P, D, prompts, [SamplingParams(temperature=0, max_tokens=4)] * 3)
    assert [D.output(r).token_ids for r in rids] == [reference(p, 4) for p in prompts]


def test_persistent_compilation_cache_switch(tmp_path, monkeypatch):
    """Off with an empty $JAXGDN_CACHE_DIR; on at the given directory otherwise; a directory the user
    configured in JAX first is left alone; every program is kept, however fast it compiled."""
    import jax

    from jaxgdn.engine.runner import enable_compilation_cache

    before = jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        monkeypatch.setenv("JAXGDN_CACHE_DIR", "")
        assert enable_compilation_cache() is None and not jax.config.jax_compilation_cache_dir
        monkeypatch.setenv("JAXGDN_CACHE_DIR", str(tmp_path / "a"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 2.5)
        assert enable_compilation_cache() == str(tmp_path / "a") == jax.config.jax_compilation_cache_dir
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0  # every program
        assert enable_compilation_cache(str(tmp_path / "b")) == str(tmp_path / "a")  # already chosen
    finally:
        jax.config.update("jax_compilation_cache_dir", before[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])


def test_a_uniform_program_equals_the_ragged_program_on_the_same_step():
    """A step of decode rows runs in a ragged program (the default) or, in a launch of several steps, in a
    uniform one ([R, 1] rows: `forward`); on the same step both must give the same tokens and state."""
    import jax
    import jax.numpy as jnp

    from jaxgdn.engine.step_layout import build_step, pack_step_arrays

    eng = engine()
    for i in range(3):
        eng.add_request(prompt(600 + i, 5 + 2 * i), SamplingParams(temperature=0, max_tokens=8))
    eng.step()  # the prompts
    out = eng.scheduler.schedule()  # three decode rows
    assert [row.kind for row in out.rows] == [RowKind.DECODE] * 3
    results = []
    for shape in (eng.programs.ragged(3, 3), eng.programs.launch(3, 1)):
        arrays = build_step(out.rows, shape, eng.ecfg, eng.executor.slot_prefill_len, eng.executor.block_tables, eng.block_q)
        buf, layout = pack_step_arrays(arrays)
        program = eng.runner.compiled(layout, False, 1, shape.width)
        state = jax.tree_util.tree_map(jnp.copy, eng.runner.state)
        new_state, flat, *_ = program(eng.runner.params, state, jnp.zeros(buf.size + 1, jnp.int32), jnp.asarray(buf))
        flat, R = np.asarray(flat), shape.rows  # [R tokens | R num_sampled | T ids] (K = 0)
        results.append((flat[:3], flat[R : R + 3], jax.tree_util.tree_leaves(new_state)))
    assert eng.programs.ragged(3, 3).tokens == 16 and eng.programs.launch(3, 1) == eng.programs.launch(4, 1)
    np.testing.assert_array_equal(results[0][0], results[1][0])  # tokens
    np.testing.assert_array_equal(results[0][1], results[1][1])  # num_sampled
    for a, b in zip(results[0][2], results[1][2]):
        a, b = np.asarray(a), np.asarray(b)
        if a.ndim > 1:  # pools: entry 0 is the null page / null slot, a sink for padding rows' writes
            a, b = a[1:], b[1:]
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_layers_are_one_nested_jit_per_kind_inlined_by_xla(monkeypatch):
    """forward calls each layer through its own jit (_layer), so the step's lowered module
    holds one function per layer kind, called once per layer, and the compiled step is the same program as
    with the layers traced inline: XLA inlines the calls (no call left, same instruction counts)."""
    import collections
    import functools
    import re

    import jax
    import jax.numpy as jnp

    from jaxgdn.engine import device_step, forward
    from jaxgdn.engine.step_layout import pack_step_arrays

    eng = engine()
    seen = []
    dispatch = eng.runner.dispatch
    eng.runner.dispatch = lambda arrays, *rest: seen.append(arrays) or dispatch(arrays, *rest)
    eng.add_request(prompt(620, 5), SamplingParams(temperature=0, max_tokens=2))
    eng.add_request(prompt(621, 3), SamplingParams(temperature=0, max_tokens=2))
    eng.step()
    buf, layout = pack_step_arrays(seen[0])
    args = (eng.runner.params, eng.runner.state, jnp.zeros(buf.size + 1, jnp.int32), jnp.asarray(buf), layout, False)

    def lowered_and_compiled():
        step = jax.jit(functools.partial(device_step.packed_step, cfg=CFG, policy=eng.policy,
                                         reproduce_pd_mtp_bug=False),
                       static_argnums=(4, 5))
        lowered = step.lower(*args)
        return lowered.as_text(), lowered.compile().as_text()

    nested_module, nested = lowered_and_compiled()
    kinds = collections.Counter(CFG.layer_types)
    layer_funcs = set(re.findall(r"func\.func private @(_layer\w*)", nested_module))
    assert len(layer_funcs) == len(kinds), layer_funcs  # one lowered function per layer kind
    assert len(re.findall(r"call @_layer", nested_module)) == len(CFG.layer_types)
    inline = forward._layer.__wrapped__
    monkeypatch.setattr(forward, "_layer", lambda *a, **k: inline(*a, **k))
    flat_module, flat = lowered_and_compiled()
    assert not re.search(r"@_layer\b", flat_module)

    def opcodes(hlo):  # instruction opcodes of the optimized module, names and shapes dropped
        return collections.Counter(re.findall(r"= \S+ (\w[\w-]*)\(", hlo))

    assert opcodes(flat)["fusion"] > 10 and opcodes(flat)["dot"] + opcodes(flat)["fusion"] > 20  # a real program
    assert opcodes(nested)["call"] == 0
    assert opcodes(nested) == opcodes(flat)


def test_step_input_stays_at_one_device_address_and_outputs_match_the_reference():
    """Each step copies its input into one resident device buffer per size, which the step donates and
    returns (XLA's CUDA graphs keep their buffer addresses); its address must not change from step to step,
    and tokens stay exact."""
    eng = engine()
    seen = []
    dispatch = eng.runner.dispatch

    def recording_dispatch(*args):
        pending = dispatch(*args)
        # read now: the next step of this size donates the buffer
        seen.append({size: buf.unsafe_buffer_pointer() for size, buf in eng.runner._resident_inputs.items()})
        return pending

    eng.runner.dispatch = recording_dispatch
    p = prompt(700, 9)
    rid = eng.add_request(p, GREEDY)
    while eng.has_unfinished:
        eng.step()
    assert eng.requests[rid].output_token_ids == reference(p, GREEDY.max_tokens)
    sizes = set(seen[-1])  # the prompt and the decodes share one program of 16 tokens: one input size
    assert len(seen) >= 4 and len(sizes) == 1
    size = sizes.pop()
    # a size's first step donates a fresh zeroed buffer (on CPU possibly a zero-copy host view that cannot
    # be donated, so its output lands elsewhere); from the second step on, one address
    assert len({addresses[size] for addresses in seen[1:]}) == 1


def test_only_the_first_copy_reads_the_step_input_at_its_new_address():
    """In the compiled step the fresh input buffer has one reader, the copy into the resident buffer; every
    other kernel reads the resident copy (without the spare element XLA would read the input directly)."""
    import jax.numpy as jnp

    eng = engine()
    eng.add_request(prompt(701, 5), GREEDY)
    eng.step()
    host_buf, layout, *static = eng.runner.last_device_args
    r = eng.runner
    hlo = r.program(layout).lower(r.params, r.state, jnp.zeros(host_buf.size + 1, jnp.int32), jnp.asarray(host_buf),
                                  layout, *static).compile().as_text()
    entry = hlo[hlo.index("\nENTRY"):].splitlines()
    (name,) = {line.split("=")[0].strip() for line in entry if "parameter(" in line and "host_input" in line}
    readers = [line for line in entry if name in line.split("=", 1)[-1]]
    assert len(readers) == 1 and "dynamic-update-slice(" in readers[0]


def test_resident_inputs_keep_only_the_newest_sizes_and_tokens_stay_exact():
    """The runner keeps only the most recently used MAX_RESIDENT_INPUTS resident buffers (exact shapes,
    enforce_eager, make a new input size almost every step); an evicted size simply gets a new one. Here
    the limit is 1, so every change of input size evicts."""
    eng = engine()
    eng.runner.MAX_RESIDENT_INPUTS = 1
    p, q = prompt(702, 7), prompt(703, 20)
    rids = [eng.add_request(p, GREEDY)]
    eng.step()  # p's prompt (16-token program), then p's decode beside q's prompt (32), then decodes (16)
    rids.append(eng.add_request(q, GREEDY))
    sizes = []
    while eng.has_unfinished:
        eng.step()
        sizes.append(eng.runner.last_device_args.host_buf.size)
        assert len(eng.runner._resident_inputs) == 1
    assert len(set(sizes)) >= 2
    assert [eng.requests[r].output_token_ids for r in rids] == [reference(p, GREEDY.max_tokens),
                                                                reference(q, GREEDY.max_tokens)]
