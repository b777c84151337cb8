"""SwiGLU MLP and the linear helper shared by every layer."""

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import mlp_decode, swiglu_mosaic

from .engine_config import min_tokens_arg
from .norms import POST_SCALE_MAX_TOKENS, DeferredNorm
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
def _swiglu_small_from_env() -> bool:
    text = os.environ.get("JAXGDN_SWIGLU_SMALL", "on").strip().lower()
    if text not in ("on", "off"):
        raise ValueError(f"$JAXGDN_SWIGLU_SMALL: expected 'on' or 'off', got {text!r}")
    return text == "on"


SWIGLU_SMALL_KERNEL = _swiglu_small_from_env()


# A decode-sized step of at most this many tokens runs a decoder layer's MLP half (the residual add, the folded
# post-attention norm, gate/up, SiLU * up, down) as one kernel (`pallas_kernels/mlp_decode.py`).
# `$JAXGDN_MLP_KERNEL_MAX_TOKENS` (a token count, or 'off') sets it for the process; read once, at import.
MLP_KERNEL_MAX_TOKENS_DEFAULT = 8


def _mlp_kernel_max_tokens_from_env() -> int:
    text = os.environ.get("JAXGDN_MLP_KERNEL_MAX_TOKENS", "").strip().lower()
    if not text:
        return MLP_KERNEL_MAX_TOKENS_DEFAULT
    if text == "off":
        return 0
    if not text.isdigit():
        raise ValueError(f"$JAXGDN_MLP_KERNEL_MAX_TOKENS: expected a token count or 'off', got {text!r}")
    return int(text)


MLP_KERNEL_MAX_TOKENS = _mlp_kernel_max_tokens_from_env()


def _mlp_kernel_form_from_env() -> dict:
    """`$JAXGDN_MLP_KERNEL_FORM` 'form,combine,block,warps' (`mlp_decode.mlp_decode`'s arguments), read once."""
    text = os.environ.get("JAXGDN_MLP_KERNEL_FORM", "reduce,atomic,16,8")
    try:
        form, combine, block, warps = (part.strip() for part in text.split(","))
        return dict(form=form, combine=combine, block=int(block), num_warps=int(warps))
    except ValueError:
        raise ValueError(f"$JAXGDN_MLP_KERNEL_FORM: expected 'form,combine,block,warps', got {text!r}") from None


MLP_KERNEL_FORM = _mlp_kernel_form_from_env()


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


def use_mlp_kernel(layer, x, allowed: bool) -> bool:
    """Whether the layer's MLP half over x [..., H] runs as the one kernel (`residual_mlp_kernel`): allowed
    (the engine's fused decode kernels, on a GPU or asked for with the Pallas impl), at most
    MLP_KERNEL_MAX_TOKENS tokens, the post-attention norm folded into fused gate/up weights of x's dtype."""
    p = layer.mlp
    tokens = int(np.prod(x.shape[:-1]))
    return (allowed and tokens <= MLP_KERNEL_MAX_TOKENS and layer.post_attention_layernorm is None
            and p.fused is not None and p.fused.dtype == x.dtype and p.down_proj.dtype == x.dtype
            and mlp_decode.supported(tokens, x.shape[-1], p.down_proj.shape[1], MLP_KERNEL_FORM["block"]))


def residual_mlp_kernel(layer, x, h, eps: float):
    """(x + h) + mlp(norm(x + h)) [..., H] through `pallas_kernels/mlp_decode.py` (see `use_mlp_kernel`); the
    final add is left to XLA, which fuses it into the next layer's first kernel."""
    rows, width = x.reshape(-1, x.shape[-1]), x.shape[-1]
    acc = mlp_decode.mlp_decode(rows, h.reshape(-1, width), layer.mlp.fused, layer.mlp.down_proj, eps,
                                post_scale=rows.shape[0] <= POST_SCALE_MAX_TOKENS, **MLP_KERNEL_FORM)
    return (x + h) + acc.reshape(x.shape).astype(x.dtype)
