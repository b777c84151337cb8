"""SwiGLU MLP and the linear helper shared by every layer."""

import jax
import jax.numpy as jnp
import numpy as np


def linear(x, w):
    """x: [..., in], w: [out, in] (Hugging Face layout) -> [..., out]."""
    return jnp.einsum("...i,oi->...o", x, w)


def project(x, p, names: tuple[str, ...], sizes: tuple[int, ...]):
    """linear(x, p.<name>) for each name, as a tuple. With p.fused (those weights concatenated along their
    output axis, `params.fuse_projections`) one product split at `sizes`, each name's output width."""
    if p.fused is None:
        return tuple(linear(x, getattr(p, n)) for n in names)
    return tuple(jnp.split(linear(x, p.fused), np.cumsum(sizes)[:-1].tolist(), axis=-1))


def mlp(p, x):
    """down(silu(gate(x)) * up(x)); p: MLPParams; x: [..., H]."""
    width = p.down_proj.shape[1]
    gate, up = project(x, p, ("gate_proj", "up_proj"), (width, width))
    return linear(jax.nn.silu(gate) * up, p.down_proj)
