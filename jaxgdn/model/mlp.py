"""SwiGLU MLP and the linear helper shared by every layer."""

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import swiglu_mosaic

from .norms import DeferredNorm
from .params import FUSED_PROJECTIONS
from .policy import DEFAULT_POLICY, KernelPolicy


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


def swiglu_kernel_for(p, x, policy: KernelPolicy):
    """The fused kernel `gated_product(p, x)` runs, or None for the XLA form. Needs fused gate/up weights in
    x's dtype and a Hopper GPU; then the large form from policy.swiglu_min_tokens tokens in whole tiles (it saves
    the pass over the [T, 2I] product where its GEMM's rate, below cuBLAS's, allows), the small form
    (policy.swiglu_small) at the decode sizes it takes."""
    if p.fused is None or p.fused.dtype != x.dtype or not swiglu_mosaic.kernel_available():
        return None
    tokens, k, width = int(np.prod(x.shape[:-1])), x.shape[-1], p.down_proj.shape[1]
    min_tokens = policy.swiglu_min_tokens
    if min_tokens is not None and tokens >= min_tokens and swiglu_mosaic.supported(tokens, k, width, x.dtype):
        return swiglu_mosaic.swiglu_product
    if policy.swiglu_small and swiglu_mosaic.supported_small(tokens, k, width, x.dtype):
        return swiglu_mosaic.swiglu_product_small
    return None


def gated_product(p, x, policy: KernelPolicy = DEFAULT_POLICY):
    """silu(gate(x)) * up(x) [..., I]; p: MLPParams; x: [..., H] (or a DeferredNorm standing for it)."""
    width = p.down_proj.shape[1]
    kernel = swiglu_kernel_for(p, x, policy)
    if kernel is not None:
        rows = x.rows() if isinstance(x, DeferredNorm) else x
        y = kernel(rows.reshape(-1, rows.shape[-1]), p.fused)
        return y.reshape(*rows.shape[:-1], width)
    gate, up = project(x, p, (width, width))  # gate_proj, up_proj
    return jax.nn.silu(gate) * up


def mlp(p, x, policy: KernelPolicy = DEFAULT_POLICY):
    """down(silu(gate(x)) * up(x)); p: MLPParams; x: [..., H]."""
    return linear(gated_product(p, x, policy), p.down_proj)
