"""SwiGLU MLP and the linear helper shared by every layer."""

import jax
import jax.numpy as jnp


def linear(x, w):
    """x: [..., in], w: [out, in] (Hugging Face layout) -> [..., out]."""
    return jnp.einsum("...i,oi->...o", x, w)


def mlp(p, x):
    """down(silu(gate(x)) * up(x)); p: MLPParams; x: [..., H]."""
    return linear(jax.nn.silu(linear(x, p.gate_proj)) * linear(x, p.up_proj), p.down_proj)
