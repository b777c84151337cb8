"""HF's published golden argmax for Qwen/Qwen3.5-0.8B. Runs only with JAXGDN_QWEN35_08B=/path/to/Qwen3.5-0.8B."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

from jaxgdn.model.checkpoint import load_checkpoint
from jaxgdn.model.forward import forward

WEIGHTS = os.environ.get("JAXGDN_QWEN35_08B")


@pytest.mark.skipif(not WEIGHTS, reason="set JAXGDN_QWEN35_08B to a local Qwen3.5-0.8B checkpoint")
def test_golden_argmax_of_real_checkpoint():
    cfg, params = load_checkpoint(WEIGHTS, dtype=jnp.float32)
    ids = np.array([[1, 306, 4658, 278, 6593, 310, 2834, 338]], np.int32)
    logits, _, _ = forward(params, cfg, ids)
    assert np.asarray(logits).argmax(-1)[0].tolist() == [198, 74, 9230, 198, 1, 264, 1, 198]
    assert params.mtp is not None, "the release ships an MTP head (mtp.*)"
