"""RMSNorm flavours of Qwen3.5 (reference §3, §6.6). All statistics in fp32."""

import jax
import jax.numpy as jnp


def upcast(x):
    """x in fp32, or kept wider (fp64 parity runs): the dtype of all statistics and gate math."""
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def rms_norm_1p(x, weight, eps: float):
    """Zero-centred RMSNorm: x/rms(x) * (1 + w), computed in fp32, cast back to x.dtype after the multiply.

    x: [..., N]; weight: [N] stored as the offset w (effective scale 1 + w).
    """
    x32 = upcast(x)
    n = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (n * (1.0 + upcast(weight))).astype(x.dtype)


def gated_rms_norm(o, z, weight, eps: float, out_dtype):
    """GDN output norm, "norm before gate" with the plain weight w (not 1+w).

    o: [..., dv] core output; z: [..., dv] gate; weight: [dv]. HF casts the normalised value to the
    activation dtype before multiplying by w, then multiplies by silu(z) in fp32.
    """
    o32 = upcast(o)
    n = (o32 * jax.lax.rsqrt(jnp.mean(o32 * o32, axis=-1, keepdims=True) + eps)).astype(out_dtype)
    y = upcast(weight) * upcast(n)
    return (y * jax.nn.silu(upcast(z))).astype(out_dtype)


def l2_normalize(x, eps: float = 1e-6):
    """x * rsqrt(sum(x^2) + eps) over the last axis (eps inside the sqrt, as FLA and HF)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)
