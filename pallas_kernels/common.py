"""Settings every Pallas kernel here shares: where it runs interpreted, and its Triton compiler parameters."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def on_gpu() -> bool:
    """Whether JAX runs on a GPU, where the kernels compile (Triton lowering); elsewhere they interpret."""
    return jax.default_backend() == "gpu"


def interpret_default(interpret):
    """None -> interpret everywhere but on a GPU (CPU runs are tests); an explicit bool wins."""
    return not on_gpu() if interpret is None else interpret


def triton_params(num_warps: int, num_stages: int = 1):
    try:
        from jax.experimental.pallas import triton as plt

        return plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    except (ImportError, AttributeError):  # pragma: no cover - older/newer Pallas spellings
        return None


def call_on_product(kernel, y, row_scale, inputs: tuple, pools: tuple, out, grid, num_warps: int, interpret=None):
    """pallas_call of a kernel between a layer's two products that writes two pools in place (the GDN mixer,
    the decode attention): its arguments are the product y, the folded norm's row_scale (fp32; only when
    given), *inputs, then the two pools, aliased to the last two outputs; the outputs before them are `out`
    (a ShapeDtypeStruct, or a tuple of them). Returns (*outputs, pool, pool)."""
    from jax.experimental import pallas as pl

    outs = out if isinstance(out, tuple) else (out,)
    args = (y, *((row_scale.astype(jnp.float32),) if row_scale is not None else ()), *inputs, *pools)
    return pl.pallas_call(
        kernel, out_shape=(*outs, *(jax.ShapeDtypeStruct(p.shape, p.dtype) for p in pools)), grid=grid,
        input_output_aliases={len(args) - 2: len(outs), len(args) - 1: len(outs) + 1},
        interpret=interpret_default(interpret), compiler_params=triton_params(num_warps),
    )(*args)


def product_rows(y_ref, refs: tuple, scaled: bool, row, dtype=None):
    """In a kernel called through call_on_product: (read, refs without the row scale's). read(t, cols) is grid
    row `row`'s product at token t and columns cols in the activation dtype (default output 0's, for a kernel
    of one output), the folded norm's 1/rms applied first when scaled: what the XLA path's product holds."""
    scale_ref, refs = (refs[0], refs[1:]) if scaled else (None, refs)
    dtype = dtype or refs[-3].dtype  # output 0 of one (the outputs are the last three refs: it and the two pools)

    def read(t: int, cols):
        x = y_ref[row, jnp.int32(t), cols]
        if scale_ref is not None:
            x = x.astype(jnp.float32) * scale_ref[row, jnp.int32(t), jnp.int32(0)]
        return x.astype(dtype)

    return read, refs
