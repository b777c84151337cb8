"""Logits of jaxgdn == transformers' Qwen3_5ForCausalLM (fp32, eager attention, torch paths), random weights.

For scale: HF's own fp32 logits differ from the same model run in fp64 by up to ~5e-5 on these configs,
so 1e-4 is about twice the rounding floor; any real porting bug moves logits by far more.
"""

import json
import os

import jax
import numpy as np
import pytest
from helpers import F, L, hf_causal_lm, hf_logits, random_ids, real_width_config, small_config

from jaxgdn.model.forward import forward
from jaxgdn.model.params import init_random_params

LENGTHS = (1, 2, 3, 63, 64, 65, 130)
TOL_FP32 = 1e-4

CONFIGS = {
    "untied_hv2hk": small_config(),
    "tied_hv2hk_FLLLLF": small_config(tie_word_embeddings=True, layer_types=(F, L, L, L, L, F), num_hidden_layers=6),
    "real_widths": real_width_config(),
}


RECORDED: dict[str, dict[int, float]] = {}


@pytest.fixture(scope="module", autouse=True)
def record_parity():
    """JAXGDN_RECORD_PARITY=path writes every measured max-abs diff to a JSON file (README figures)."""
    yield
    path = os.environ.get("JAXGDN_RECORD_PARITY")
    if path and RECORDED:
        from jaxgdn.bench import environment

        payload = {"benchmark": "parity_vs_transformers_fp32", "tolerance": TOL_FP32, "batch": 2,
                   "max_abs_logit_diff": RECORDED, "env": environment()}
        with open(path, "w") as f:
            json.dump(payload, f, indent=2)


@pytest.fixture(scope="module", params=list(CONFIGS))
def model_pair(request):
    cfg = CONFIGS[request.param]
    params = init_random_params(cfg, seed=list(CONFIGS).index(request.param))
    return request.param, cfg, params, hf_causal_lm(cfg, params), jax.jit(forward, static_argnums=1)


@pytest.mark.parametrize("length", LENGTHS)
def test_logits_match_transformers_fp32(model_pair, length):
    name, cfg, params, hf_model, fwd = model_pair
    ids = random_ids(cfg, 2, length, seed=length)
    ours, _, _ = fwd(params, cfg, ids)
    ref = hf_logits(hf_model, ids)
    diff = float(np.max(np.abs(np.asarray(ours) - ref)))
    RECORDED.setdefault(name, {})[length] = diff
    print(f"fp32 {name} T={length}: max-abs logit diff {diff:.2e} (|logits| max {np.abs(ref).max():.1f})")
    assert np.abs(ref).max() > 1.0, "logits too small for the comparison to mean anything"
    assert diff <= TOL_FP32
