"""The one-kernel decode attention (`pallas_kernels/decode_attention.py`, interpret mode on CPU, compiled under
-m gpu below) against the ragged XLA path it replaces in uniform steps (`forward.attention_ragged`):
the fused projection's split, q/k RMSNorms, RoPE, the KV write, attention over each row's pages, the gate."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import gpu_test, small_config

from jaxgdn.engine import forward
from jaxgdn.engine.state import PagedKV
from jaxgdn.engine.forward import RowView, StepMeta, attention_ragged, decode_attention_rows, use_decode_attention_kernel
from jaxgdn.model.norms import DeferredNorm, inverse_rms
from jaxgdn.model.params import init_random_params, serving_layout
from jaxgdn.model.policy import KernelPolicy
from pallas_kernels import decode_attention
from pallas_kernels.decode_attention import DecodeAttentionLayout, decode_attention_pooled, decode_attention_supports

PS = 16  # tokens per KV page


def attention_case(Q, dtype, seed=0, **overrides):
    """An attention layer in the serving layout and five rows of Q cells: keys already in the pages 0, 5, 37
    and 70 tokens (70 spans two steps of the kernel's page loop), one row with fewer valid cells than Q,
    a padding row; the pools' unwritten cells, the null page and the padding row's pages hold NaN."""
    cfg = small_config(**overrides)
    params = serving_layout(init_random_params(cfg, seed=seed, dtype=dtype), True)
    p = params.layers[cfg.layer_types.index("full_attention")].mixer
    r = np.random.default_rng(seed)
    old_lens = np.array([0, 5, 37, 70, 0])
    num_valid = np.array([Q, Q, max(Q - 1, 1), Q, 0])
    R, MP, Hkv, D = len(old_lens), 8, cfg.num_key_value_heads, cfg.head_dim
    pages = 1 + np.arange(R * MP).reshape(R, MP)  # distinct pages; page 0 is the null page
    pages[-1] = 0  # the padding row has none
    k_pool, v_pool = (np.full((1 + R * MP, PS, Hkv, D), np.nan, np.float32) for _ in range(2))
    for b, n in enumerate(old_lens):  # the keys earlier steps wrote
        for pos in range(n):
            for pool in (k_pool, v_pool):
                pool[pages[b, pos // PS], pos % PS] = r.standard_normal((Hkv, D))
    t = np.arange(Q)[None, :]
    valid = t < num_valid[:, None]
    positions = np.where(valid, old_lens[:, None] + t, 0)
    kv_slots = np.where(valid, np.take_along_axis(pages, positions // PS, axis=1) * PS + positions % PS, t % PS)
    i32 = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
    view = RowView(token_index=i32(np.where(valid, t, -1)), positions=i32(positions), kv_slots=i32(kv_slots),
                   block_tables=i32(pages), seq_lens=i32(old_lens + num_valid), idx_mapping=i32(np.arange(R)),
                   fresh=jnp.zeros(R, bool), verify_path=jnp.zeros(R, bool))
    x = jnp.asarray(r.standard_normal((R, Q, cfg.hidden_size)), dtype)
    return cfg, p, x, view, PagedKV(k=jnp.asarray(k_pool, dtype), v=jnp.asarray(v_pool, dtype))


def layout_for(form: str, pages_per_step: int | None = None, **kw) -> DecodeAttentionLayout:
    """The kernel's program layout for the test: "head" one program per (row, query head), "grouped" one per
    (row, KV head), "split" that with each row's page tiles split over programs (flash decoding)."""
    return DecodeAttentionLayout(pages_per_step=pages_per_step, grouped_min_rows=None if form == "head" else 1,
                                 grouped_min_keys=None, split_target_programs=1024 if form == "split" else 1, **kw)


def flat_meta(view: RowView) -> StepMeta:
    """The ragged form's metadata of a [R, Q] view: row r's cells are tokens r*Q .. r*Q+Q-1 of the stream."""
    R, Q = view.token_index.shape
    token_row = jnp.where(view.valid, jnp.arange(R, dtype=jnp.int32)[:, None], -1).reshape(-1)
    return StepMeta(positions=view.positions.reshape(-1), token_row=token_row, kv_slots=view.kv_slots.reshape(-1),
                    query_start_loc=jnp.arange(R + 1, dtype=jnp.int32) * Q, seq_lens=view.seq_lens,
                    idx_mapping=view.idx_mapping, block_tables=view.block_tables, fresh=view.fresh,
                    verify_path=view.verify_path, block_row=None, block_start=None)


def run_layer(kernel: bool, cfg, p, h, view, kv, layout: DecodeAttentionLayout = DecodeAttentionLayout()):
    """The layer on the one kernel (the attention kernels on) or on the ragged XLA path (off)."""
    policy = KernelPolicy(attention_kernels=kernel, decode_attention_layout=layout)
    assert use_decode_attention_kernel(p, cfg, h.shape[1], PS, policy) == kernel
    if kernel:
        return jax.jit(lambda h, kv: decode_attention_rows(p, cfg, h, view, kv, layout))(h, kv)
    R, Q = view.token_index.shape
    flat = jax.tree_util.tree_map(lambda a: a.reshape(R * Q, *a.shape[2:]), h)
    out, pools = jax.jit(lambda h, kv: attention_ragged(p, cfg, h, flat_meta(view), kv, policy))(flat, kv)
    return out.reshape(R, Q, -1), pools


def assert_same_layer(got, want, view, kv, atol):
    """Outputs of valid cells close; the pools close off the null page, and written where the cells' slots are."""
    (out, pools), (out_ref, pools_ref) = got, want
    valid = np.asarray(view.valid)
    np.testing.assert_allclose(np.asarray(out, np.float32)[valid], np.asarray(out_ref, np.float32)[valid],
                               atol=atol, rtol=atol)
    for new, ref, old in ((pools.k, pools_ref.k, kv.k), (pools.v, pools_ref.v, kv.v)):
        new, ref, old = (np.asarray(a, np.float32)[1:] for a in (new, ref, old))
        np.testing.assert_allclose(new, ref, atol=atol, rtol=atol)
        assert np.isfinite(new).sum() == np.isfinite(old).sum() + valid.sum() * ref.shape[2] * ref.shape[3]


@pytest.mark.parametrize("Q, dtype, pages_per_tile, form", [
    (1, jnp.float32, 1, "head"), (3, jnp.float32, 2, "head"), (1, jnp.bfloat16, 2, "head"),
    (4, jnp.bfloat16, 1, "head"), (2, jnp.float32, 4, "head"), (1, jnp.float32, 1, "grouped"),
    (3, jnp.bfloat16, 2, "grouped"), (8, jnp.float32, 1, "grouped"), (1, jnp.float32, 1, "split"),
    (3, jnp.bfloat16, 2, "split"), (2, jnp.float32, 1, "split")])
def test_decode_attention_kernel_equals_the_xla_chain(Q, dtype, pages_per_tile, form):
    """Decode (one cell) and verify windows, GQA (two query heads per KV head), partial RoPE, fp32 and bf16
    activations from a plain (pre-normed) input; page-loop tiles of one, two and four pages; one program per
    query head, or per KV head with the group's heads on matrix products (grouped: 2 heads x Q tokens as
    16 matrix rows, duplicates included, or exactly 16 at Q = 8), or that with each row's 8 pages split over
    2 or 4 programs (split: tiles of two pages or one; rows of 0, 5, 37 and 70 keys leave some splits without keys)."""
    cfg, p, x, view, kv = attention_case(Q, dtype, seed=Q)
    want = run_layer(False, cfg, p, x, view, kv)
    got = run_layer(True, cfg, p, x, view, kv, layout_for(form, pages_per_tile))
    assert_same_layer(got, want, view, kv, 3e-2 if dtype == jnp.bfloat16 else 2e-5)


@pytest.mark.parametrize("dtype, form", [(jnp.float32, "head"), (jnp.bfloat16, "head"), (jnp.bfloat16, "grouped"),
                                         (jnp.bfloat16, "split")])
def test_decode_attention_kernel_applies_the_folded_norms_row_scale(dtype, form):
    """With a post-scaled DeferredNorm input (the kernel gets the fp32 product and the 1/rms) the kernel
    equals the chain, which scales and rounds the product first (the split form's gate, merged in XLA,
    included)."""
    cfg, p, x, view, kv = attention_case(2, dtype, seed=7)
    h = DeferredNorm(x, inverse_rms(x, cfg.rms_norm_eps), post_scale=True)
    want = run_layer(False, cfg, p, h, view, kv)
    got = run_layer(True, cfg, p, h, view, kv, layout_for(form))
    assert_same_layer(got, want, view, kv, 3e-2 if dtype == jnp.bfloat16 else 2e-5)


@pytest.mark.parametrize("form", ["head", "grouped", "split"])
def test_decode_attention_kernel_with_whole_rotary_heads_and_one_kv_head(form):
    """RoPE over the whole head (no pass-through part) and all query heads on one KV head."""
    cfg, p, x, view, kv = attention_case(2, jnp.float32, seed=3, partial_rotary_factor=1.0, num_key_value_heads=1)
    want = run_layer(False, cfg, p, x, view, kv)
    got = run_layer(True, cfg, p, x, view, kv, layout_for(form))
    assert_same_layer(got, want, view, kv, 2e-5)


def test_decode_attention_kernel_runs_where_its_tiles_and_weights_allow():
    cfg, p, *_ = attention_case(1, jnp.float32)
    on = KernelPolicy(attention_kernels=True)
    Qmax = on.decode_attention_max_queries
    assert use_decode_attention_kernel(p, cfg, Qmax, PS, on)
    assert not use_decode_attention_kernel(p, cfg, Qmax + 1, PS, on)  # wider rows: the ragged form
    assert not use_decode_attention_kernel(dataclasses.replace(p, fused=None), cfg, 1, PS, on)
    assert not use_decode_attention_kernel(p, cfg, 1, PS, KernelPolicy())  # the attention kernels off
    assert not use_decode_attention_kernel(p, cfg, 1, PS, on.replace(fused_decode=False))  # switched off
    assert decode_attention_supports(256, 16, 64) and not decode_attention_supports(96, 16, 24)
    assert not decode_attention_supports(256, 12, 64) and not decode_attention_supports(256, 16, 63)


def test_layout_rule_and_split_counts():
    """The grouped form for many rows or long tables; splits that fill the grid toward split_target_programs,
    never leave a split without tiles and, when splitting, give each at least split_min_tiles tiles."""
    layout = DecodeAttentionLayout()
    assert not layout.grouped(8, 128)  # a few short rows: one program per query head
    assert layout.grouped(layout.grouped_min_rows, 16) and layout.grouped(1, layout.grouped_min_keys)
    target, least = layout.split_target_programs, layout.split_min_tiles
    for programs in (1, 2, 7, 16, 64, 128, 256, 512):
        for tiles in (1, 2, 3, 4, 7, 33, 64, 129, 1024):
            splits = layout.split_count(programs, tiles)
            per_split = -(-tiles // splits)
            assert splits >= 1 and (splits - 1) * per_split < tiles  # every split has tiles
            assert programs * splits <= max(target, programs)
            if splits > 1:
                assert per_split >= least
    # batch 1 (2 KV heads) over 64 tiles: 32 splits of 2; 33 tiles: 11 of 3 (16 of 3 would leave 5 empty)
    assert layout.split_count(2, 64) == 32 and layout.split_count(2, 33) == 11
    assert layout.split_count(128, 4) == 2 and layout.split_count(256, 64) == 1


@pytest.mark.parametrize("grouped, splits", [(False, None), (True, 1), (True, 2)])
def test_decode_attention_kernel_lowers_to_triton_without_a_gpu(grouped, splits):
    """The 0.8B layer's widths (Hq = 8, Hkv = 2, D = 256, RoPE over 64), a post-scaled product, a verify window;
    every program layout (the grouped one's matrix products and split stores included)."""
    Hq, Hkv, D, R, Q, MP = 8, 2, 256, 2, 3, 4
    bf = jnp.bfloat16
    y = jnp.zeros((R, Q, 2 * Hq * D + 2 * Hkv * D), jnp.float32)
    pool = jnp.zeros((9, PS, Hkv, D), bf)
    ints = lambda *shape: jnp.zeros(shape, jnp.int32)  # noqa: E731
    fn = lambda y, k, v: decode_attention_pooled(  # noqa: E731
        y, jnp.ones((R, Q, 1)), jnp.zeros(D, bf), jnp.zeros(D, bf), 1e-6, jnp.ones((R, Q, 64), bf),
        jnp.zeros((R, Q, 64), bf), k, v, ints(R * Q), ints(R, MP), ints(R, Q), ints(R), ints(R), num_heads=Hq,
        dtype=bf, interpret=False, grouped=grouped, splits=splits)
    text = jax.jit(fn).trace(y, pool, pool).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text.lower()


@pytest.mark.parametrize("fused, form", [(True, "head"), pytest.param(True, "split", marks=pytest.mark.slow),
                                         (False, None)])
def test_engine_fused_decode_kernels_switch(fused, form):
    """KernelPolicy.fused_decode picks the one-kernel forms (GDN mixer, decode attention) or the chains for the
    MTP verify launches of uniform programs (two steps a launch; kernels in interpret mode; the mixer from one
    row; the decode attention one program per query head, or grouped with each row's pages split over
    programs of one-page tiles); either way every request equals one-request greedy decoding."""
    from helpers import naive_greedy

    from jaxgdn.engine import runner
    from jaxgdn.engine.config import EngineConfig
    from jaxgdn.engine.llm_engine import LLMEngine
    from jaxgdn.engine.request import SamplingParams

    calls = {"mixer": 0, "attention": 0, "merge": 0}  # kernel calls traced into the step programs

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    cfg = small_config(eos_token_ids=(), linear_value_head_dim=32)  # dv a power of two: the pool kernels' tiles
    params = init_random_params(cfg, seed=5)
    rng = np.random.default_rng(9)
    prompts = [[int(t) for t in rng.integers(0, cfg.vocab_size, n)] for n in (2, 9, 21)]
    ecfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, kv_page_size=PS,
                        dtype="float32", num_speculative_tokens=2, gdn_impl="pallas", attention_impl="pallas",
                        fused_decode_kernels=fused, compilation_cache=False, decode_steps_per_launch=2)
    layout = layout_for(form or "head", 1, split_min_tiles=1) if form == "split" else layout_for(form or "head")
    policy = ecfg.kernel_policy("cpu").replace(mixer_rows=(1, 16), decode_attention_layout=layout)
    with pytest.MonkeyPatch.context() as m:  # counters around the kernels, traced afresh
        runner.clear_compiled_programs()
        forward._layer.clear_cache()
        m.setattr(forward, "gdn_mixer_pooled", counted("mixer", forward.gdn_mixer_pooled))
        m.setattr(forward, "decode_attention_pooled", counted("attention", forward.decode_attention_pooled))
        m.setattr(decode_attention, "_merge_splits", counted("merge", decode_attention._merge_splits))
        eng = LLMEngine(params, cfg, ecfg, policy=policy)
        sp = SamplingParams(temperature=0, max_tokens=5)
        rids = [eng.add_request(p, sp) for p in prompts]
        while eng.has_unfinished:
            eng.step()
    for rid, p in zip(rids, prompts):
        assert eng.requests[rid].output_token_ids == naive_greedy(params, cfg, p, 5)
    if fused:
        assert calls["mixer"] > 0 and calls["attention"] > 0 and (calls["merge"] > 0) == (form == "split")
    else:
        assert calls == {"mixer": 0, "attention": 0, "merge": 0}


@gpu_test
@pytest.mark.parametrize("Q, dtype, pages_per_tile, form", [
    (1, "bfloat16", 1, "head"), (1, "bfloat16", 2, "head"), (4, "bfloat16", 1, "head"), (4, "bfloat16", 2, "head"),
    (2, "float32", None, "head"), (1, "bfloat16", 1, "grouped"), (4, "bfloat16", 2, "grouped"),
    (2, "float32", None, "grouped"), (1, "bfloat16", 1, "split"), (4, "bfloat16", 2, "split"),
    (2, "float32", None, "split")])
def test_decode_attention_kernel_compiled_at_the_0_8b_widths_equals_the_xla_chain(Q, dtype, pages_per_tile, form):
    """The one-kernel decode attention compiled at the 0.8B layer's widths (Hq = 8, Hkv = 2, D = 256, RoPE over
    64) against the compiled XLA path, on tiles of one and two pages (None: the layout rule's pick), one program
    per query head or per KV head (grouped), or that with each row's page tiles split over programs (split);
    the tests above run smaller cases interpreted on CPU."""
    dt = jnp.dtype(dtype)
    cfg, p, x, view, kv = attention_case(Q, dt, seed=Q, num_attention_heads=8, num_key_value_heads=2, head_dim=256)
    want = run_layer(False, cfg, p, x, view, kv)
    got = run_layer(True, cfg, p, x, view, kv, layout_for(form, pages_per_tile))
    assert_same_layer(got, want, view, kv, 3e-2 if dt == jnp.bfloat16 else 1e-4)
