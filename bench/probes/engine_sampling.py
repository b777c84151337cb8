"""Probe: the shipped model's engine with sampled requests; prints each request's tokens and the tokens
fed back to the device, for comparing backends. Usage: python bench/probes/engine_sampling.py K:steps:sync|async ...
($GDN_IMPL: EngineConfig.gdn_impl, default auto; $WRITE_KV_KERNEL=1: the KV write kernel on any backend;
$PIN_SCALED_LOGITS=0: sampling.PIN_SCALED_LOGITS off; $DUMP_VERIFY=1: print, from inside the step, the
verify inputs of every sampled row that drew the pad token 0 or saw a NaN logit (a host callback: on a
GPU set JAX_PLATFORMS=cuda,cpu); needs tests/ on PYTHONPATH for helpers.shipped_model)."""

import os
import sys

from helpers import outside_sampling_support, shipped_model

from jaxgdn.engine import LLMEngine
from jaxgdn.engine_config import EngineConfig
from jaxgdn.request import SamplingParams


def dump_verify():
    """Wrap the runner's verify_drafts: a host callback prints, for each sampled row whose window drew
    token 0 or holds a non-finite logit, per window position: NaN count and max of the logits, how many
    tokens the filter keeps (filtered_log_probs recomputed beside the sampler's), the draft and p(draft)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxgdn import runner
    from jaxgdn.sampling import filtered_log_probs

    original = runner.verify_drafts

    def report(temperature, n_draft, tokens, num_sampled, drafts, nan, top, kept, p_draft, top5):
        for r in np.flatnonzero(temperature > 0):
            used = slice(0, int(n_draft[r]) + 1)
            drew_pad = (tokens[r, : int(num_sampled[r])] == 0).any()
            if drew_pad or nan[r, used].any():
                print(f"    VERIFY row {r}: tokens {tokens[r].tolist()} n_sampled {int(num_sampled[r])} drafts "
                      f"{drafts[r].tolist()} nan {nan[r, used].tolist()} max {np.round(top[r, used], 3).tolist()} "
                      f"kept {kept[r, used].tolist()} p_draft {np.round(p_draft[r], 4).tolist()} "
                      f"top5 {np.round(top5[r, used], 3).tolist()}", flush=True)

    def wrapped(logits, drafts, n_draft, temperature, top_k, top_p, keys, stochastic=True):
        tokens, num_sampled = original(logits, drafts, n_draft, temperature, top_k, top_p, keys, stochastic)
        if stochastic:
            R, W, V = logits.shape
            logp = filtered_log_probs(logits.reshape(R * W, V), jnp.repeat(temperature, W), jnp.repeat(top_k, W),
                                      jnp.repeat(top_p, W)).reshape(R, W, V)
            d = jnp.clip(drafts, 0, V - 1)
            p_draft = jnp.exp(jnp.take_along_axis(logp[:, : W - 1], d[..., None], axis=-1)[..., 0])
            jax.debug.callback(report, temperature, n_draft, tokens, num_sampled, drafts,
                               jnp.isnan(logits).sum(-1), jnp.max(logits, -1), jnp.isfinite(logp).sum(-1), p_draft,
                               jax.lax.top_k(logits, 5)[0])
        return tokens, num_sampled

    runner.verify_drafts = wrapped


def main():
    if os.environ.get("DUMP_VERIFY") == "1":
        dump_verify()
    if os.environ.get("PIN_SCALED_LOGITS") == "0":  # the sampler as before the candidate fix
        from jaxgdn import sampling

        sampling.PIN_SCALED_LOGITS = False
    if os.environ.get("WRITE_KV_KERNEL"):  # the GPU's KV write kernel off the GPU too (interpret mode)
        from jaxgdn import paged_forward

        paged_forward.on_gpu = lambda: True
    params, cfg, prompts = shipped_model()
    prompts = prompts[:4]
    sps = [SamplingParams(temperature=0, max_tokens=30), SamplingParams(temperature=0, max_tokens=9),
           SamplingParams(temperature=0.9, top_p=0.8, seed=3, max_tokens=25),
           SamplingParams(temperature=1.1, top_k=5, seed=4, max_tokens=20)]
    for spec in sys.argv[1:]:
        K, steps, mode = spec.split(":")
        ecfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=256, kv_page_size=8,
                            dtype="float32", num_speculative_tokens=int(K), decode_steps_per_launch=int(steps),
                            async_scheduling=mode == "async",
                            gdn_impl=os.environ.get("GDN_IMPL", "auto"))
        eng = LLMEngine(params, cfg, ecfg, garbage_seed=1)
        eng.record_inputs = True
        rids = [eng.add_request(p, sp) for p, sp in zip(prompts, sps)]
        eng.run_until_done()
        print(spec, eng.spec_metrics() if int(K) else "", flush=True)
        for r, prompt, sp in zip(rids, prompts, sps):  # fed: the tokens at the positions after the prompt's
            out = eng.output(r).token_ids
            print("  out", out, "outside the sampling support:", outside_sampling_support(params, cfg, prompt, out, sp))
            print("  fed", [t for pos, t in sorted(set(eng.fed_tokens.get(r) or ())) if pos >= len(prompt)])


if __name__ == "__main__":
    main()
