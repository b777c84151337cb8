"""RMSNorm flavours of Qwen3.5 (docs/qwen35-architecture.md §3, §6.6). All statistics in fp32."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct


def upcast(x):
    """x in fp32, or kept wider (fp64 parity runs): the dtype of all statistics and gate math."""
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def inverse_rms(x, eps: float):
    """x: [..., N] -> 1/sqrt(mean(x^2) + eps) [..., 1], in fp32 (or wider)."""
    x32 = upcast(x)
    return jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


def rms_norm_1p(x, weight, eps: float):
    """Zero-centred RMSNorm: x/rms(x) * (1 + w), computed in fp32, cast back to x.dtype after the multiply.

    x: [..., N]; weight: [N] stored as the offset w (effective scale 1 + w).
    """
    return (upcast(x) * inverse_rms(x, eps) * (1.0 + upcast(weight))).astype(x.dtype)


def pre_norm(x, weight, eps: float, post_scale_max_tokens: int = 1):
    """A decoder layer's input or post-attention norm: rms_norm_1p(x, weight), or with weight None (its
    1 + w folded into the products that read it, `params.fold_norms`) a DeferredNorm of x, post-scaled
    when x has at most post_scale_max_tokens tokens (`KernelPolicy.post_scale_max_tokens`)."""
    if weight is not None:
        return rms_norm_1p(x, weight, eps)
    return DeferredNorm(x, inverse_rms(x, eps), x.size // x.shape[-1] <= post_scale_max_tokens)


@struct.dataclass
class DeferredNorm:
    """The activation x / rms(x) kept as its two factors, for products whose weights hold the norm's 1 + w
    (`params.fold_norms`): at decode sizes an RMSNorm was two kernels in front of every GEMV (a sum of squares,
    then a scale and cast that XLA does not fuse into the GEMV, whose reduction would recompute it per
    output). post_scale: products scale their output rows by 1/rms, so the scale joins the GEMV's kernel or
    its consumer's; else they scale the input rows first, as a plain RMSNorm does (the folded weight still
    saves the multiply by 1 + w): at batch sizes where the products are GEMMs and at prefill, where a
    product's output is wider than its input.

    Shape-wise it stands for x: `shape`, `dtype` and `reshape` are x's; jax.tree.map indexes both factors.
    """

    x: Any  # [..., H] the residual stream (activation dtype)
    inv_rms: Any  # [..., 1] fp32
    post_scale: bool = struct.field(pytree_node=False, default=False)

    @property
    def shape(self):
        return self.x.shape

    @property
    def dtype(self):
        return self.x.dtype

    def reshape(self, *shape):
        return DeferredNorm(self.x.reshape(*shape), self.inv_rms.reshape(*shape[:-1], 1), self.post_scale)

    def product_parts(self, w):
        """(x / rms(x)) @ w.T for w [out, H] as (y, row_scale): post-scaled, y [..., out] fp32 and row_scale
        the 1/rms [..., 1] (the product is (y * row_scale) in x.dtype: a kernel reading y may apply the scale
        itself); else y in x.dtype, the product of the scaled rows, and None."""
        if self.post_scale:
            wide = jnp.promote_types(self.x.dtype, jnp.float32)
            # The barrier makes the GEMV read x as stored: without it XLA fuses the residual add(s) that
            # produce x into each GEMV's reduction, which recomputes them per output.
            x = jax.lax.optimization_barrier(self.x)
            return jnp.einsum("...i,oi->...o", x, w, preferred_element_type=wide), self.inv_rms
        return jnp.einsum("...i,oi->...o", self.rows(), w), None

    def rows(self):
        """x / rms(x) in x's dtype [..., H]: the input rows a product that does not post-scale reads."""
        return (upcast(self.x) * self.inv_rms).astype(self.x.dtype)

    def product(self, w):
        """(x / rms(x)) @ w.T for w [out, H] (Hugging Face layout) -> [..., out] in x.dtype."""
        y, row_scale = self.product_parts(w)
        return y if row_scale is None else (y * row_scale).astype(self.x.dtype)


def gated_rms_norm(o, z, weight, eps: float, out_dtype):
    """GDN output norm, "norm before gate" with the plain weight w (not 1+w).

    o: [..., dv] core output; z: [..., dv] gate; weight: [dv]. HF casts the normalised value to the
    activation dtype before multiplying by w, then multiplies by silu(z) in fp32.
    """
    o32 = upcast(o)
    n = (o32 * jax.lax.rsqrt(jnp.mean(o32 * o32, axis=-1, keepdims=True) + eps)).astype(out_dtype)
    y = upcast(weight) * upcast(n)
    return (y * jax.nn.silu(upcast(z))).astype(out_dtype)

