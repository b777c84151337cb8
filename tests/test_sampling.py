"""Sampling: filters, position-keyed randomness independent of batch mates, LLM facade and tokenizer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import outside_sampling_support, shipped_model, small_config

from jaxgdn import LLM, EngineConfig, SamplingParams
from jaxgdn.engine.sampling import filtered_log_probs, position_keys, sample_tokens
from jaxgdn.model.checkpoint import save_checkpoint
from jaxgdn.model.params import init_random_params

CFG = small_config(eos_token_ids=())


def test_filters_keep_exactly_the_intended_tokens():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 3, jnp.float32))
    logp = filtered_log_probs(logits, jnp.ones(3), jnp.asarray([2, 0, 0]), jnp.asarray([1.0, 0.7, 0.81]))
    kept = np.isfinite(np.asarray(logp))
    assert kept.tolist() == [[True, True, False, False], [True, True, False, False], [True, True, True, False]]
    np.testing.assert_allclose(np.exp(np.asarray(logp[0, :2])), [0.625, 0.375], rtol=1e-6)


def test_sampling_matches_the_distribution():
    """20k draws with distinct position keys follow softmax(logits / T)."""
    logits = jnp.asarray([[2.0, 1.0, 0.0, -1.0]], jnp.float32)
    n = 20000
    keys = position_keys(jnp.full(n, 3, jnp.uint32), jnp.zeros(n, jnp.uint32), jnp.arange(n, dtype=jnp.uint32))
    toks = sample_tokens(jnp.repeat(logits, n, 0), jnp.full(n, 2.0), jnp.zeros(n, jnp.int32), jnp.ones(n), keys)
    freq = np.bincount(np.asarray(toks), minlength=4) / n
    expected = np.asarray(jax.nn.softmax(logits[0] / 2.0))
    assert np.abs(freq - expected).max() < 0.015


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ck") / "tiny"
    save_checkpoint(path, CFG, init_random_params(CFG, seed=31))
    return path


def test_seeded_sampling_does_not_depend_on_batch_mates(checkpoint):
    cfg = EngineConfig(max_num_seqs=8, max_model_len=128, kv_page_size=8, dtype="float32", precompile=False)
    sp = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, max_tokens=12, seed=1234)
    alone = LLM(str(checkpoint), cfg).generate([[5, 6, 7]], sp, use_tqdm=False)[0].token_ids
    others = [[9] * 40, [1, 2], [100, 101, 102, 103, 104]]
    crowd = LLM(str(checkpoint), cfg).generate(others[:2] + [[5, 6, 7]] + others[2:], sp, use_tqdm=False)
    assert crowd[2].token_ids == alone
    greedy = LLM(str(checkpoint), cfg).generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert alone != greedy[0].token_ids  # the sampler really samples
    top1 = LLM(str(checkpoint), cfg).generate([[5, 6, 7]], SamplingParams(temperature=1.0, top_k=1, max_tokens=12, seed=9), use_tqdm=False)
    assert top1[0].token_ids == greedy[0].token_ids


def test_text_prompts_need_a_tokenizer(checkpoint):
    llm = LLM(str(checkpoint), EngineConfig(max_model_len=64, kv_page_size=8, dtype="float32", precompile=False))
    outs = llm.generate(["hello", [1, 2, 3]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert outs[0].finish_reason == "error" and "no tokenizer" in outs[0].error
    assert outs[1].error is None and len(outs[1].token_ids) == 3 and outs[1].ttft is not None


def test_tokenizer_json_gives_text(checkpoint, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(CFG.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    ck = tmp_path / "with_tok"
    import shutil

    shutil.copytree(checkpoint, ck)
    tok.save(str(ck / "tokenizer.json"))
    llm = LLM(str(ck), EngineConfig(max_model_len=64, kv_page_size=8, dtype="float32", precompile=False))
    text_out, ids_out = llm.generate(["w5 w6 w7", [5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert text_out.token_ids == ids_out.token_ids
    assert text_out.text == " ".join(f"w{t}" for t in ids_out.token_ids)


def test_greedy_only_branch_equals_the_general_verifier():
    """verify_drafts skips the vocabulary sort and noise when every row is greedy; the general path must
    give the same tokens and counts on the same all-greedy input."""
    import jax.numpy as jnp
    import numpy as np

    from jaxgdn.engine.spec_decode import _verify

    rng = np.random.default_rng(0)
    R, K, V = 5, 2, 50
    logits = jnp.asarray(rng.standard_normal((R, K + 1, V)), jnp.float32)
    argmax = np.asarray(jnp.argmax(logits, -1))
    drafts = np.where(rng.random((R, K)) < 0.6, argmax[:, :K], rng.integers(0, V, (R, K)))
    drafts[0, 0] = -1  # a placeholder draft is never accepted
    args = (logits, jnp.asarray(drafts, jnp.int32), jnp.array([2, 2, 1, 0, 2]), jnp.zeros(R), jnp.zeros(R, jnp.int32),
            jnp.ones(R), jax_keys(R, K))
    fast, general = _verify(*args, stochastic=False), _verify(*args, stochastic=True)
    np.testing.assert_array_equal(np.asarray(fast[0]), np.asarray(general[0]))
    np.testing.assert_array_equal(np.asarray(fast[1]), np.asarray(general[1]))


def jax_keys(R, K):
    import jax

    return jax.vmap(lambda i: jax.random.key(i))(jax.numpy.arange(R * (K + 1))).reshape(R, K + 1)


# Outputs of shipped-model prompts 2 and 3 under MTP K=2, one synchronous verify step per launch: on the H200
# before the sampler pinned its scaled logits and on the CPU with the same engine and kernels interpreted (the
# fixed H200 run gives the CPU's tokens).
TOP_P_ROW = SamplingParams(temperature=0.9, top_p=0.8, seed=3, max_tokens=25)
TOP_K_ROW = SamplingParams(temperature=1.1, top_k=5, seed=4, max_tokens=20)
ON_H200 = ([3, 49, 77, 69, 3, 0, 89, 93, 0, 23, 16, 3, 87, 0, 33, 21, 22, 18, 4, 45, 88, 3, 88, 86, 77],
           [3, 49, 77, 69, 3, 75, 77, 90, 73, 87, 3, 69, 91, 69, 93, 3, 28, 16, 3, 0])
ON_CPU = ([3, 49, 77, 69, 3, 80, 83, 87, 73, 87, 3, 23, 16, 3, 87, 83, 3, 24, 27, 17, 23, 33, 24, 24, 18],
          [3, 49, 77, 69, 3, 75, 77, 90, 73, 87, 3, 69, 91, 69, 93, 3, 28, 16, 3, 87])


def test_support_check_flags_the_pad_tokens_sampled_on_the_gpu_and_passes_the_cpu_outputs():
    """outside_sampling_support (the GPU test's check of sampled MTP rows) can fail: it flags the pad
    token 0 (never trained) that the H200 emitted, and passes the CPU's outputs of the same engine."""
    params, cfg, prompts = shipped_model()
    for prompt, sp, gpu, cpu in zip(prompts[2:4], (TOP_P_ROW, TOP_K_ROW), ON_H200, ON_CPU):
        flagged = outside_sampling_support(params, cfg, prompt, gpu, sp)
        zeros = [(i, t) for i, t in enumerate(gpu) if t == 0]
        assert set(zeros) <= set(flagged) and flagged[0] == zeros[0]
        assert outside_sampling_support(params, cfg, prompt, cpu, sp) == []


def test_sampler_and_verifier_read_the_scaled_logits_from_one_pinned_buffer():
    """The fix of the H200 pad-token bug: the programs that sample and verify hold an optimization barrier on
    the scaled logits, so XLA cannot recompute them inside the sort's and the mask's fusions with bits that
    disagree."""
    from jaxgdn.engine.spec_decode import verify_drafts

    R, W, V = 2, 3, 16
    logits = jnp.zeros((R, W, V))
    params = (jnp.ones(R), jnp.zeros(R, jnp.int32), jnp.ones(R))
    keys = jax_keys(R, W - 1)
    sample = jax.jit(lambda *a: sample_tokens(*a)).lower(logits[:, 0], *params, keys[:, 0]).as_text()
    verify = jax.jit(lambda *a: verify_drafts(*a, True)).lower(
        logits, jnp.zeros((R, W - 1), jnp.int32), jnp.full(R, W - 1), *params, keys).as_text()
    assert "optimization_barrier" in sample and "optimization_barrier" in verify
