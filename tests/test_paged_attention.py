"""Paged attention: the Pallas flash kernel (interpret mode on CPU) against the gather reference, and the
reference against the model's dense attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgdn.attention import gqa_attention
from pallas_kernels.paged_attention import paged_attention_pallas, paged_attention_reference


def paged_case(seed=0, R=3, Q=5, Hq=4, Hkv=2, D=16, ps=16, MP=4, dtype=jnp.float32, lens=(5, 23, 49),
               whole_prompts=False):
    """Random pool with NaN in the null page and past each row's end, rows at different lengths, Q queries at the end of
    each row (a prefill chunk or decode/verify window), and one padding query per row (position -1).
    whole_prompts: the queries are instead each row's whole prompt, positions 0 .. len-1, then padding."""
    r = np.random.default_rng(seed)
    P = R * MP + 1
    k_pool = r.standard_normal((P, ps, Hkv, D)).astype(np.float32)
    v_pool = r.standard_normal((P, ps, Hkv, D)).astype(np.float32)
    seq_lens = np.array(lens)[:R]
    perm = r.permutation(np.arange(1, P))
    block_tables = np.zeros((R, MP), np.int32)
    k_pool[0] = v_pool[0] = np.nan  # the null page: garbage must never leak in
    for i in range(R):
        n = -(-seq_lens[i] // ps)
        block_tables[i, :n] = perm[i * MP : i * MP + n]
        tail = seq_lens[i] - (n - 1) * ps  # slots of the last page past seq_len are unwritten
        k_pool[block_tables[i, n - 1], tail:] = v_pool[block_tables[i, n - 1], tail:] = np.nan
    if whole_prompts:
        q_positions = np.stack([np.where(np.arange(Q) < s, np.arange(Q), -1) for s in seq_lens]).astype(np.int32)
    else:
        q_positions = np.stack([np.arange(s - Q + 1, s + 1) for s in seq_lens]).astype(np.int32)
        q_positions = np.maximum(q_positions, -1)
        q_positions[:, 0] = -1  # a padding cell: sees no key
    q = r.standard_normal((R, Q, Hq, D)).astype(np.float32)
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return (cast(q), cast(k_pool), cast(v_pool), jnp.asarray(block_tables), jnp.asarray(q_positions),
            jnp.asarray(seq_lens, jnp.int32))


def test_reference_equals_dense_gqa_attention():
    q, k_pool, v_pool, bt, qpos, seq = paged_case()
    out = paged_attention_reference(q, k_pool, v_pool, bt, qpos, seq)
    R, MP = bt.shape
    ps, Hkv, D = k_pool.shape[1:]
    k = k_pool[bt].reshape(R, MP * ps, Hkv, D)
    v = v_pool[bt].reshape(R, MP * ps, Hkv, D)
    k_pos = jnp.broadcast_to(jnp.arange(MP * ps), (R, MP * ps))
    valid = k_pos < seq[:, None]
    dense = gqa_attention(q, jnp.where(valid[..., None, None], k, 0), jnp.where(valid[..., None, None], v, 0),
                          qpos, k_pos, valid)
    real = np.asarray(qpos >= 0)
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(dense)[real], atol=1e-5)
    assert np.all(np.asarray(out)[~real] == 0)


@pytest.mark.parametrize("Q", [1, 3, 20])
def test_pallas_kernel_equals_reference(Q):
    q, k_pool, v_pool, bt, qpos, seq = paged_case(seed=Q, Q=Q)
    ref = paged_attention_reference(q, k_pool, v_pool, bt, qpos, seq)
    out = paged_attention_pallas(q, k_pool, v_pool, bt, qpos, seq)
    assert out.shape == ref.shape and bool(jnp.isfinite(out).all())
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5)


@pytest.mark.parametrize("block_q", [16, 32])
def test_pallas_kernel_on_whole_prompts_equals_reference(block_q):
    """Rows that are whole prompts (queries at positions 0 .. len-1, then padding): query blocks stop at
    their last query's page (causal bound), so early blocks read fewer pages than the row has."""
    q, k_pool, v_pool, bt, qpos, seq = paged_case(seed=block_q, R=2, Q=72, MP=5, lens=(70, 40), whole_prompts=True)
    ref = paged_attention_reference(q, k_pool, v_pool, bt, qpos, seq)
    out = paged_attention_pallas(q, k_pool, v_pool, bt, qpos, seq, block_q=block_q)
    assert bool(jnp.isfinite(out).all())
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5)
    assert np.all(np.asarray(out)[1, 40:] == 0)  # padding queries see no key


def test_pallas_kernel_lowers_to_triton_without_a_gpu():
    q, k_pool, v_pool, bt, qpos, seq = paged_case(D=256, dtype=jnp.bfloat16)
    fn = lambda *a: paged_attention_pallas(*a, interpret=False)  # noqa: E731
    text = jax.jit(fn).trace(q, k_pool, v_pool, bt, qpos, seq).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text.lower()


def test_engine_with_paged_kernel_equals_plain_greedy(monkeypatch):
    """PD + MTP K=2 with attention_impl="pallas" (interpret mode): trunk and MTP attention read pages in
    place, the prompts' q/k/v come out of the prefill kernel (`prompt_qkv`); every request equals
    one-request greedy decoding."""
    from helpers import naive_greedy, small_config
    from jaxgdn import paged_forward
    from jaxgdn.engine_config import EngineConfig
    from jaxgdn.params import init_random_params
    from jaxgdn.pd_workers import DecodeWorker, PrefillWorker, run_disaggregated
    from jaxgdn.request import SamplingParams

    cfg = small_config(eos_token_ids=())
    params = init_random_params(cfg, seed=8)
    rng = np.random.default_rng(4)
    prompts = [[int(t) for t in rng.integers(0, cfg.vocab_size, n)] for n in (1, 3, 17, 40)]
    ecfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=96, kv_page_size=16,
                        dtype="float32", num_speculative_tokens=2, pd=True, attention_impl="pallas")
    traced = []  # prompt_qkv calls while the steps trace
    prompt_qkv = paged_forward.prompt_qkv
    monkeypatch.setattr(paged_forward, "prompt_qkv", lambda *a, **k: traced.append(a[0].shape) or prompt_qkv(*a, **k))
    P = PrefillWorker(params, cfg, ecfg, garbage_seed=1)
    D = DecodeWorker(params, cfg, ecfg, garbage_seed=2)  # NaN-free garbage in the pools: must not leak in
    sp = SamplingParams(temperature=0, max_tokens=5)
    rids = run_disaggregated(P, D, prompts, [sp] * len(prompts))
    for r, p in zip(rids, prompts):
        assert D.output(r).token_ids == naive_greedy(params, cfg, p, 5)
    assert traced and all(shape[1] > paged_forward.DECODE_ATTENTION_MAX_QUERIES for shape in traced)


def kv_write_case(seed=0, P=9, ps=4, Hkv=2, D=16, N=7, dtype=jnp.float32):
    """Random pools; N tokens at distinct slots off the null page, two more padding tokens on null slot 0."""
    r = np.random.default_rng(seed)
    pools = [jnp.asarray(r.standard_normal((P, ps, Hkv, D)), dtype) for _ in range(2)]
    slots = np.concatenate([r.choice(np.arange(ps, P * ps), N, replace=False), [0, 0]]).astype(np.int32)
    k, v = (jnp.asarray(r.standard_normal((N + 2, Hkv, D)), dtype) for _ in range(2))
    return (*pools, jnp.asarray(slots), k, v)


def test_kv_write_kernel_equals_scatter():
    """Bit for bit off the null page; nothing else of the pools changes."""
    from pallas_kernels.paged_attention import write_kv_pallas

    k_pool, v_pool, slots, k, v = kv_write_case()
    new_k, new_v = write_kv_pallas(k_pool, v_pool, slots, k, v)
    for pool, new, x in ((k_pool, new_k, k), (v_pool, new_v, v)):
        expect = pool.reshape(-1, *pool.shape[2:]).at[slots].set(x).reshape(pool.shape)
        np.testing.assert_array_equal(np.asarray(new)[1:], np.asarray(expect)[1:])
        assert not np.array_equal(np.asarray(new)[1:], np.asarray(pool)[1:])


def test_kv_write_kernel_lowers_to_triton_without_a_gpu():
    from pallas_kernels.paged_attention import write_kernel_supports, write_kv_pallas

    assert write_kernel_supports(2, 256) and not write_kernel_supports(3, 32)
    k_pool, v_pool, slots, k, v = kv_write_case(D=256, dtype=jnp.bfloat16)
    fn = lambda kp, vp, k, v: write_kv_pallas(kp, vp, slots, k, v, interpret=False)  # noqa: E731
    text = jax.jit(fn).trace(k_pool, v_pool, k, v).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text.lower()


def _whole_prompt_step(Q=64, ps=16, MP=8, seed=3):
    """One attention layer's inputs for two rows of whole prompts (positions from 0) in Q cells, the second
    with 14 padding cells; pools of noise with a NaN null page."""
    from helpers import small_config
    from jaxgdn.cache import PagedKV
    from jaxgdn.params import init_random_params
    from jaxgdn.paged_forward import RowView

    cfg = small_config()
    p = init_random_params(cfg, seed=seed).layers[cfg.layer_types.index("full_attention")].mixer
    r = np.random.default_rng(seed)
    R, n_new = 2, np.array([Q, Q - 14])
    P, Hkv, D = R * MP + 1, cfg.num_key_value_heads, cfg.head_dim
    pool = lambda: jnp.asarray(r.standard_normal((P, ps, Hkv, D)), jnp.float32).at[0].set(jnp.nan)  # noqa: E731
    block_tables = 1 + np.arange(R * MP, dtype=np.int32).reshape(R, MP)
    block_tables[np.arange(MP)[None, :] >= -(-n_new[:, None] // ps)] = 0  # pages past a row's end: the null page
    j = np.arange(Q)[None, :]
    valid = j < n_new[:, None]
    positions = np.where(valid, j, 0).astype(np.int32)
    page = np.take_along_axis(block_tables, positions // ps, axis=1)
    view = RowView(token_index=jnp.asarray(np.where(valid, np.arange(R * Q).reshape(R, Q), -1), jnp.int32),
                   positions=jnp.asarray(positions), kv_slots=jnp.asarray(np.where(valid, page * ps + positions % ps, 0)),
                   block_tables=jnp.asarray(block_tables), seq_lens=jnp.asarray(n_new, jnp.int32),
                   idx_mapping=jnp.arange(1, R + 1, dtype=jnp.int32), fresh=jnp.ones(R, bool),
                   verify_path=jnp.zeros(R, bool))
    h = jnp.asarray(r.standard_normal((R, Q, cfg.hidden_size)), jnp.float32)
    return p, cfg, h, view, PagedKV(k=pool(), v=pool()), valid


def test_whole_prompt_attention_reads_the_steps_own_keys_like_the_pages():
    """whole_prompts=True (the host's promise that every row starts at position 0) attends to the step's
    own K/V (cuDNN's flash kernel on a GPU, the same XLA form here): it must equal reading the pages, the
    NaN-filled null page and unwritten slots included; breaking it must show in the output."""
    from jaxgdn import paged_forward

    p, cfg, h, view, kv, valid = _whole_prompt_step()
    run = lambda whole: np.asarray(jax.jit(  # noqa: E731
        lambda h, kv: paged_forward.paged_attention(p, cfg, h, view, kv, whole_prompts=whole)[0])(h, kv))[valid]
    own, paged = run(True), run(False)
    assert np.isfinite(own).all()
    np.testing.assert_allclose(own, paged, rtol=1e-5, atol=1e-5)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(paged_forward, "fresh_prompt_attention", lambda q, *_: jnp.zeros_like(q))
        assert not np.allclose(run(True), paged, rtol=1e-5, atol=1e-5)
