"""Shared test helpers: small random configs and a Hugging Face reference model built from our params."""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import numpy as np
import pytest
import torch

from jaxgdn.model.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig, qwen35_0_8b
from jaxgdn.model.params import ModelParams, params_to_tensors

L, F = LINEAR_ATTENTION, FULL_ATTENTION


def gpu_test(test):
    """A GPU-only test (`pytest -m gpu`): kernels compiled for the device, skipped without one."""
    needs_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
    return pytest.mark.gpu(needs_gpu(test))


def small_config(**overrides) -> ModelConfig:
    """The reference's recommended parity config: Hv = 2·Hk, dk != dv, conv 4, layers L,L,L,F."""
    base = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=24,
        linear_conv_kernel_dim=4,
        layer_types=(L, L, L, F),
        tie_word_embeddings=False,
        mtp_num_hidden_layers=1,
        eos_token_ids=(1,),
    )
    base.update(overrides)
    return ModelConfig(**base)


def random_prompt(seed: int, length: int, vocab_size: int, low: int = 0) -> list[int]:
    """length token ids in [low, vocab_size), drawn by a generator seeded with seed."""
    return [int(t) for t in np.random.default_rng(seed).integers(low, vocab_size, length)]


def small_engine(params, cfg: ModelConfig, garbage_seed: int | None = None, **config):
    """An LLMEngine of a small fp32 configuration (4 slots, 32-token steps, 128 positions, 8-token pages); config
    overrides EngineConfig's fields."""
    from jaxgdn.engine.config import EngineConfig
    from jaxgdn.engine.llm_engine import LLMEngine

    base = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, kv_page_size=8, dtype="float32")
    return LLMEngine(params, cfg, EngineConfig(**{**base, **config}), garbage_seed=garbage_seed)


def real_width_config(**overrides) -> ModelConfig:
    """The Qwen3.5-0.8B preset (its widths) cut to 4 layers (L,L,L,F) and a 512-token vocabulary."""
    cut = dict(vocab_size=512, num_hidden_layers=4, layer_types=(L, L, L, F), eos_token_ids=(), pad_token_id=None,
               model_type=ModelConfig.model_type)
    return qwen35_0_8b().replace(**{**cut, **overrides})


def hf_text_config(cfg: ModelConfig):
    from transformers import Qwen3_5TextConfig

    d = {k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "model_type")}
    return Qwen3_5TextConfig(**d)


def to_torch(x) -> torch.Tensor:
    return torch.from_numpy(np.asarray(x, dtype=np.float32).copy())


def hf_causal_lm(cfg: ModelConfig, params: ModelParams):
    """transformers' Qwen3_5ForCausalLM (fp32, eager attention, torch paths) holding our weights."""
    from transformers import Qwen3_5ForCausalLM

    model = Qwen3_5ForCausalLM._from_config(hf_text_config(cfg), attn_implementation="eager", dtype=torch.float32)
    state = {k: to_torch(v) for k, v in params_to_tensors(cfg, params).items() if not k.startswith("mtp.")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    # lm_head is absent from our tensors when tied (HF ties it to the embedding).
    assert set(missing) <= {"lm_head.weight"} and not unexpected, (missing, unexpected)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(np.asarray(ids)), use_cache=False).logits.numpy()


def random_ids(cfg: ModelConfig, batch: int, length: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, length)).astype(np.int32)


def naive_greedy(params, cfg: ModelConfig, prompt: list[int], num_tokens: int, pad_to: int = 256) -> list[int]:
    """Greedy by full recompute (full_logits), no cache."""
    ids = list(prompt)
    for _ in range(num_tokens):
        ids.append(int(full_logits(params, cfg, ids, pad_to)[-1].argmax()))
    return ids[len(prompt):]


_naive_fwd: dict = {}


def full_logits(params, cfg: ModelConfig, ids: list[int], pad_to: int = 256) -> np.ndarray:
    """Logits [len(ids), V] (fp32) of one full forward over ids, no cache. Right padding to a fixed length
    (pad_to, or the next power of two) is exact for a causal model and keeps compiled shapes few."""
    import jax

    from jaxgdn.model.forward import forward

    fwd = _naive_fwd.setdefault(id(cfg), jax.jit(forward, static_argnums=1))
    n = len(ids)
    padded = np.zeros((1, max(pad_to, 1 << (n - 1).bit_length())), np.int32)
    padded[0, :n] = ids
    return np.asarray(fwd(params, cfg, padded)[0])[0, :n].astype(np.float32)


def outside_sampling_support(params, cfg: ModelConfig, prompt: list[int], output: list[int], sp,
                             slack: float = 1e-3) -> list[tuple[int, int]]:
    """(index, token) of each output token that sampling params sp could not have produced: outside
    top_k (if set) or else the top_p nucleus of the reference distribution at its position (logits /
    temperature). Exact whatever the random draws, so it checks a sampled (or speculatively verified)
    output without replaying its noise. slack: margin in logits and probability mass for float error."""
    logits = full_logits(params, cfg, list(prompt) + list(output))[len(prompt) - 1: len(prompt) - 1 + len(output)]
    bad = []
    for i, (row, tok) in enumerate(zip(logits.astype(np.float64) / max(sp.temperature, 1e-6), output)):
        if sp.top_k > 0:
            outside = row[tok] < np.sort(row)[-min(sp.top_k, len(row))] - slack
        else:
            probs = np.exp(row - row.max())
            probs /= probs.sum()
            outside = probs[row > row[tok] + slack].sum() >= sp.top_p + slack  # mass of the likelier tokens
        if outside:
            bad.append((i, tok))
    return bad


def run_staggered(eng, prompts: list[list[int]], per_step: int, params) -> list[int]:
    """Add `per_step` requests before each engine step, so new requests join running batches. params: one
    SamplingParams for all, or one per prompt."""
    params = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
    rids, pending = [], list(zip(prompts, params))
    while pending or eng.has_unfinished:
        for _ in range(per_step):
            if pending:
                rids.append(eng.add_request(*pending.pop(0)))
        eng.step()
    return rids


def run_recorded(eng, prompts: list[list[int]], params: list, per_step: int = 2):
    """run_staggered with every fed token recorded, to the end (async: the last launch applied too).
    Returns ([RequestOutput], [fed (position, token) list per request])."""
    eng.update.record_inputs = True
    rids = run_staggered(eng, prompts, per_step, params)
    eng.run_until_done()
    return [eng.output(r) for r in rids], [eng.update.fed_tokens.get(r) for r in rids]


SHIPPED = Path(__file__).resolve().parent.parent / "checkpoints" / "qwen35-tiny-arith"


@functools.lru_cache(maxsize=None)
def shipped_model(num_prompts: int = 6):
    """The shipped model (fp32) and the encoded prompts of its first test problems: a model whose MTP
    drafts are mostly accepted. Returns (params, cfg, prompts)."""
    import jax.numpy as jnp

    from jaxgdn import task
    from jaxgdn.model.checkpoint import load_checkpoint
    from jaxgdn.model.tokenizer import load_tokenizer

    cfg, params = load_checkpoint(SHIPPED, dtype=jnp.float32)
    tok = load_tokenizer(SHIPPED)
    return params, cfg, [tok.encode(p.prompt()) for p in task.take("test", num_prompts)]


def shipped_workload(num_prompts: int = 6):
    """The shipped model's first num_prompts (4..6) test prompts with mixed sampling: greedy, a stop token
    (its 10th greedy output of prompt 1), a short max_tokens, and (prompts 3, 4) seeded samplers.
    Returns (params, cfg, prompts, sampling params)."""
    from jaxgdn.engine.request import SamplingParams

    params, cfg, prompts = shipped_model()
    stop = naive_greedy(params, cfg, prompts[1], 12)[9]
    sp = [SamplingParams(temperature=0, max_tokens=40) for _ in prompts]
    sp[1] = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=(stop,))
    sp[2] = SamplingParams(temperature=0, max_tokens=7)
    sp[3] = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=30)
    sp[4] = SamplingParams(temperature=1.0, top_k=4, seed=8, max_tokens=25)
    return params, cfg, prompts[:num_prompts], sp[:num_prompts]


def assert_async_equals_sync(sync, asyn, sync_eng, async_eng, extra_fed: int):
    """An async engine's run_recorded results equal a synchronous one's: outputs, drafts accepted, fed
    tokens (up to extra_fed more: rows booked for requests that stopped), pools drained, no booking left."""
    from jaxgdn.engine.request import PLACEHOLDER_TOKEN

    (s_out, s_fed), (a_out, a_fed) = sync, asyn
    for s, a in zip(s_out, a_out):
        assert (a.token_ids, a.finish_reason, a.num_drafted, a.num_accepted_drafts) == (
            s.token_ids, s.finish_reason, s.num_drafted, s.num_accepted_drafts)
        assert PLACEHOLDER_TOKEN not in a.token_ids
    # The async engine feeds what the synchronous one does, plus the rows of launches it had booked for
    # requests that stopped in the launch before (discarded). Whether a 1-token prompt tail is padded with
    # -1 placeholder drafts depends on what else runs in its step, which differs between the two.
    for s, a in zip(s_fed, a_fed):
        s, a = [f for f in s if f[1] != -1], [f for f in a if f[1] != -1]
        assert set(s) <= set(a) and len(a) - len(s) <= extra_fed
    assert async_eng.update.spec_counters.metrics() == sync_eng.update.spec_counters.metrics()
    assert async_eng.scheduler.pages.num_free == async_eng.runner.state.layers[-1].k.shape[0] - 1
    assert async_eng.scheduler.slots.num_free == async_eng.ecfg.max_num_seqs
    for req in async_eng.requests.values():  # no booking left behind
        assert req.output_slack == 0 or req.finish_reason is not None
