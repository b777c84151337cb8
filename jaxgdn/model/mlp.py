"""SwiGLU MLP and the linear helper shared by every layer."""

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import swiglu_mosaic

from ..engine.config import env_switch, min_tokens_arg
from .norms import DeferredNorm
from .params import FUSED_PROJECTIONS

# An MLP over at least this many tokens with fused gate/up weights runs SiLU(gate) * up inside the gate/up
# product's kernel on a Hopper GPU (`pallas_kernels/swiglu_mosaic.py`), saving the pass over the [T, 2I]
# product. 0.8B widths on the H200, kernel against cuBLAS + the multiply in us: 8192 tokens 171.6 vs 189.7,
# 4096 87.7 vs 99.1 (bench/results/swiglu-mosaic-probe-r34d_gpu_20261203.json); 2048 51.2 vs 51.0 without
# the cluster (-r34c): its GEMM runs at ~87% of cuBLAS's rate, so the saved pass pays from 4096.
# `$JAXGDN_SWIGLU_MIN_TOKENS` (a token count, or 'off') sets it for the process: the escape hatch should
# Mosaic GPU fail to compile somewhere, and the A/B switch of `bench/h200.sh swiglu-ab`. It is read once, at
# import, so it holds for the whole process (the jitted layers are cached by shape, not by this value).
SWIGLU_KERNEL_MIN_TOKENS_DEFAULT = 4096


def _swiglu_min_tokens_from_env() -> int | None:
    text = os.environ.get("JAXGDN_SWIGLU_MIN_TOKENS", "").strip()
    try:
        return min_tokens_arg(text) if text else SWIGLU_KERNEL_MIN_TOKENS_DEFAULT
    except argparse.ArgumentTypeError as e:  # name the variable the bad value came from
        raise ValueError(f"$JAXGDN_SWIGLU_MIN_TOKENS: {e}") from None


SWIGLU_KERNEL_MIN_TOKENS = _swiglu_min_tokens_from_env()  # None: never


# Decode-sized steps of 64 rows (batch 64) run the kernel's small form (`swiglu_mosaic.swiglu_product_small`:
# no persistent grid, one 64-row tile a CTA): 6.7 us for the 0.8B's gate/up product and SiLU * up at 64 rows
# against 9.3 for XLA's product + pass, cold (bench/results/swiglu-small-probe_gpu_20261204.json); the batch-64
# decode step 1.716 against 1.777 ms, then on / off / on 1.740 / 1.782 / 1.743 (device 1.799 / 1.834 / 1.797;
# decode-swiglu-small-{on,off}_gpu_20261204.json, then -on-b1, -off-b, -on-b2). `$JAXGDN_SWIGLU_SMALL`
# ('on', the default, or 'off'; read once at import) switches it.
SWIGLU_SMALL_KERNEL = env_switch("JAXGDN_SWIGLU_SMALL")


def linear(x, w):
    """x: [..., in] (or a DeferredNorm standing for it), w: [out, in] (Hugging Face layout) -> [..., out]."""
    if isinstance(x, DeferredNorm):
        return x.product(w)
    return jnp.einsum("...i,oi->...o", x, w)


def linear_parts(x, w):
    """`linear(x, w)` as (y, row_scale): for a post-scaled DeferredNorm y fp32 and its 1/rms [..., 1], whose
    product in x's dtype is the consumer's to form (`DeferredNorm.product_parts`); else (linear(x, w), None)."""
    if isinstance(x, DeferredNorm):
        return x.product_parts(w)
    return linear(x, w), None


def project(x, p, sizes: tuple[int, ...]):
    """The layer's same-input projections (`params.FUSED_PROJECTIONS[type(p)]`, in that order) of x, as a
    tuple. With p.fused (those weights concatenated along their output axis, `params.fuse_projections`)
    one product split at `sizes`, each projection's output width."""
    names = FUSED_PROJECTIONS[type(p)]
    if p.fused is None:
        return tuple(linear(x, getattr(p, n)) for n in names)
    return split_outputs(linear(x, p.fused), sizes)


def split_outputs(y, sizes: tuple[int, ...]):
    """The fused product y [..., sum(sizes)] split along its last axis into the projections' outputs."""
    return tuple(jnp.split(y, np.cumsum(sizes)[:-1].tolist(), axis=-1))


def swiglu_kernel_for(p, x):
    """The fused kernel `gated_product(p, x)` runs, or None for the XLA form. Needs fused gate/up weights in
    x's dtype and a Hopper GPU; then the large form from SWIGLU_KERNEL_MIN_TOKENS tokens (None: never) in whole
    tiles, the small form (SWIGLU_SMALL_KERNEL) at the decode sizes it takes."""
    if p.fused is None or p.fused.dtype != x.dtype or not swiglu_mosaic.kernel_available():
        return None
    tokens, k, width = int(np.prod(x.shape[:-1])), x.shape[-1], p.down_proj.shape[1]
    min_tokens = SWIGLU_KERNEL_MIN_TOKENS
    if min_tokens is not None and tokens >= min_tokens and swiglu_mosaic.supported(tokens, k, width, x.dtype):
        return swiglu_mosaic.swiglu_product
    if SWIGLU_SMALL_KERNEL and swiglu_mosaic.supported_small(tokens, k, width, x.dtype):
        return swiglu_mosaic.swiglu_product_small
    return None


def gated_product(p, x):
    """silu(gate(x)) * up(x) [..., I]; p: MLPParams; x: [..., H] (or a DeferredNorm standing for it)."""
    width = p.down_proj.shape[1]
    kernel = swiglu_kernel_for(p, x)
    if kernel is not None:
        rows = x.rows() if isinstance(x, DeferredNorm) else x
        y = kernel(rows.reshape(-1, rows.shape[-1]), p.fused)
        return y.reshape(*rows.shape[:-1], width)
    gate, up = project(x, p, (width, width))  # gate_proj, up_proj
    return jax.nn.silu(gate) * up


def mlp(p, x):
    """down(silu(gate(x)) * up(x)); p: MLPParams; x: [..., H]."""
    return linear(gated_product(p, x), p.down_proj)
