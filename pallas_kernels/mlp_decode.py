"""A decoder layer's second half for decode-sized steps as one Pallas kernel: the residual add after the
token mixer, the post-attention RMSNorm (its 1 + w folded into the gate/up weights), gate/up, SiLU * up and
down, with down's output summed into an fp32 buffer by atomic adds.

At batch 1 on the H200 that half ran five kernels a layer: the residual add with the norm's sum of squares,
the rsqrt, the gate/up GEMV, SiLU * up and the down GEMV, ~12 us for 22 MB of weights
(bench/results/decode-kernels-r30-probe_gpu_20261203.json). Here program p owns the intermediate columns
[p*BI, (p+1)*BI): it loads its gate, up and down weight tiles up front (no loop: every load in flight at once),
forms its BI columns of silu(gate) * up, multiplies them by its BI rows of down and adds the [M, H] partial
into the output. No program waits on another, so nothing needs a grid-wide barrier.

    x, h        [M, H]      the residual stream before the mixer's add and the mixer's output (activation dtype)
    w_gate_up   [2I, H]     the fused gate ‖ up weight with the norm's 1 + w folded in (`params.fold_norms`)
    w_down      [H, I]      down_proj (Hugging Face layout), or [I, H] with down_transposed
    -> acc      [M, H] fp32 the MLP's output before its rounding; the layer's output is
                            (x + h) + acc.astype(x.dtype), formed by the caller (XLA fuses it into its consumer)

Rounding follows the XLA chain it replaces (`jaxgdn.model.residual_block` with a `norms.DeferredNorm`): x + h
rounded to the activation dtype, 1/rms in fp32, gate and up rounded after the scale (post_scale: the product of
the raw row, then * 1/rms, as a one-token GEMV does; else the product of the scaled, rounded row), SiLU and the
multiply each rounded, down accumulated in fp32 (atomic adds: the order of the partial sums varies run to run).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .common import interpret_default, triton_params

f32 = jnp.float32


def _dot(a, b, contract_b: int):
    """a [Mp, K] @ b over b's axis contract_b, fp32 accumulation (a Triton dot: tensor cores)."""
    return jax.lax.dot_general(a, b, (((1,), (contract_b,)), ((), ())), preferred_element_type=f32)


def _mlp_kernel(x_ref, h_ref, wgu_ref, wd_ref, _acc_in, acc_ref, *, M, Mp, I, BI, eps, post_scale, down_transposed,
                form, combine):
    from jax.experimental.pallas import triton as plt  # atomic adds (also in interpret mode)

    p = pl.program_id(0)
    dtype = x_ref.dtype
    H = x_ref.shape[1]
    # Every weight load first, so the program's whole share of the 3 matrices is in flight at once.
    w_gate = wgu_ref[pl.ds(p * BI, BI), :]  # [BI, H]
    w_up = wgu_ref[pl.ds(I + p * BI, BI), :]
    w_down = wd_ref[pl.ds(p * BI, BI), :] if down_transposed else wd_ref[:, pl.ds(p * BI, BI)]  # [BI, H] / [H, BI]
    if form == "dot":
        # The M rows as an [Mp, H] tile (rows past M zero) for the tensor-core products.
        row_id = jax.lax.broadcasted_iota(jnp.int32, (Mp, H), 0)
        rows = jnp.zeros((Mp, H), f32)
        for m in range(M):
            row = (x_ref[m, :].astype(f32) + h_ref[m, :].astype(f32)).astype(dtype).astype(f32)
            rows = jnp.where(row_id == m, row[None, :], rows)
        inv_rms = jax.lax.rsqrt(jnp.sum(rows * rows, axis=1, keepdims=True) / H + eps)  # [Mp, 1]
        a = rows.astype(dtype) if post_scale else (rows * inv_rms).astype(dtype)
        gate, up = _dot(a, w_gate, 1), _dot(a, w_up, 1)  # [Mp, BI]
        if post_scale:
            gate, up = gate * inv_rms, up * inv_rms
        gate = gate.astype(dtype).astype(f32)
        up = up.astype(dtype).astype(f32)
        silu = (gate / (1.0 + jnp.exp(-gate))).astype(dtype).astype(f32)
        act = (silu * up).astype(dtype)  # [Mp, BI]
        part = _dot(act, w_down, 0 if down_transposed else 1)  # [Mp, H]
        for m in range(M):  # row m of the tile (a sum over its rows: Triton has no row indexing)
            part_m = jnp.sum(jnp.where(row_id == m, part, 0.0), axis=0)  # [H]
            if combine == "atomic":
                plt.atomic_add(acc_ref, (jnp.int32(m), pl.ds(0, H)), part_m)
            else:
                acc_ref[p, m, :] = part_m
        return
    for m in range(M):
        row = (x_ref[m, :].astype(f32) + h_ref[m, :].astype(f32)).astype(dtype).astype(f32)  # [H]
        inv_rms = jax.lax.rsqrt(jnp.sum(row * row) / H + eps)
        if post_scale:
            gate = jnp.sum(w_gate.astype(f32) * row[None, :], axis=1) * inv_rms  # [BI]
            up = jnp.sum(w_up.astype(f32) * row[None, :], axis=1) * inv_rms
        else:
            scaled = (row * inv_rms).astype(dtype).astype(f32)
            gate = jnp.sum(w_gate.astype(f32) * scaled[None, :], axis=1)
            up = jnp.sum(w_up.astype(f32) * scaled[None, :], axis=1)
        gate = gate.astype(dtype).astype(f32)
        up = up.astype(dtype).astype(f32)
        silu = (gate / (1.0 + jnp.exp(-gate))).astype(dtype).astype(f32)
        act = (silu * up).astype(dtype).astype(f32)  # [BI]
        if down_transposed:
            part = jnp.sum(w_down.astype(f32) * act[:, None], axis=0)  # [H]
        else:
            part = jnp.sum(w_down.astype(f32) * act[None, :], axis=1)
        if combine == "atomic":
            plt.atomic_add(acc_ref, (jnp.int32(m), pl.ds(0, H)), part)
        else:
            acc_ref[p, m, :] = part


def supported(tokens: int, hidden: int, intermediate: int, block: int = 16) -> bool:
    """Shapes the kernel takes: a power-of-two hidden width (one Triton block a row) and whole column blocks."""
    return tokens >= 1 and hidden >= 16 and hidden & (hidden - 1) == 0 and intermediate % block == 0


def mlp_decode(x, h, w_gate_up, w_down, eps: float, *, post_scale: bool, down_transposed: bool = False,
               block: int = 16, num_warps: int = 8, form: str = "reduce", combine: str = "atomic", interpret=None):
    """The MLP half of a decoder layer over M = x.shape[0] tokens; shapes and rounding in the module docstring.
    form: "reduce" (each row's products as elementwise multiplies and sums) or "dot" (the rows padded to a
    16-row tile for tensor-core products; bf16); combine: "atomic" (programs add into one buffer) or "partials"
    (each program writes its own, summed by XLA after). Returns acc [M, H] fp32 (the MLP's output; the layer's
    is (x + h) + acc.astype(x.dtype))."""
    M, H = x.shape
    I = w_gate_up.shape[0] // 2
    assert h.shape == x.shape and w_gate_up.shape == (2 * I, H), (x.shape, h.shape, w_gate_up.shape)
    assert w_down.shape == ((I, H) if down_transposed else (H, I)), w_down.shape
    assert supported(M, H, I, block) and form in ("reduce", "dot") and combine in ("atomic", "partials")
    Mp = max(16, 1 << (M - 1).bit_length()) if form == "dot" else M
    programs = I // block
    kernel = functools.partial(_mlp_kernel, M=M, Mp=Mp, I=I, BI=block, eps=float(eps), post_scale=post_scale,
                               down_transposed=down_transposed, form=form, combine=combine)
    shape = (M, H) if combine == "atomic" else (programs, M, H)
    out = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(shape, f32), grid=(programs,), input_output_aliases={4: 0},
        interpret=interpret_default(interpret), compiler_params=triton_params(num_warps),
    )(x, h, w_gate_up, w_down, jnp.zeros(shape, f32))
    return out if combine == "atomic" else out.sum(0)
