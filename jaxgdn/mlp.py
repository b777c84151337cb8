"""SwiGLU MLP and the linear helper shared by every layer."""

import jax
import jax.numpy as jnp
import numpy as np

from .norms import DeferredNorm
from .params import FUSED_PROJECTIONS


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


def mlp(p, x):
    """down(silu(gate(x)) * up(x)); p: MLPParams; x: [..., H]."""
    width = p.down_proj.shape[1]
    gate, up = project(x, p, (width, width))  # gate_proj, up_proj
    return linear(jax.nn.silu(gate) * up, p.down_proj)
