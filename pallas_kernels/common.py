"""Settings every Pallas kernel here shares: where it runs interpreted, and its Triton compiler parameters."""

from __future__ import annotations

import math

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


def call_on_product(kernel, y, row_scale, inputs: tuple, pools: tuple, out, grid, num_warps: int, interpret=None,
                    prefetch: tuple = (), prefetch_programs: int = 0):
    """pallas_call of a kernel between a layer's two products that writes two pools in place (the GDN mixer,
    the decode attention): its arguments are the product y, the folded norm's row_scale (fp32; only when
    given), *inputs, then the two pools, aliased to the last two outputs; the outputs before them are `out`
    (a ShapeDtypeStruct, or a tuple of them). Returns (*outputs, pool, pool).

    prefetch (weights) with prefetch_programs > 0: the grid gets enough more rows along its first axis for at
    least that many programs, which read those weights into L2 (`with_l2_prefetch`) while the kernel's own
    programs run (compiled runs only)."""
    from jax.experimental import pallas as pl

    outs = out if isinstance(out, tuple) else (out,)
    head = (y, *((row_scale.astype(jnp.float32),) if row_scale is not None else ()), *inputs)
    interpret = interpret_default(interpret)
    # Interpreted (CPU) runs leave the prefetch out: it only moves data, and Pallas' interpreter has no
    # program ids inside the branch that separates the two kinds of program.
    weights = prefetch_tiles(prefetch) if prefetch_programs > 0 and not interpret else ()
    extra_out = ()
    if weights:
        extra_rows = -(-prefetch_programs // math.prod(grid[1:]))
        kernel, grid, extra_out = with_l2_prefetch(kernel, grid, len(head), len(weights), extra_rows)
    args = (*head, *weights, *pools)
    results = pl.pallas_call(
        kernel, out_shape=(*outs, *(jax.ShapeDtypeStruct(p.shape, p.dtype) for p in pools), *extra_out),
        grid=grid, input_output_aliases={len(args) - 2: len(outs), len(args) - 1: len(outs) + 1},
        interpret=interpret, compiler_params=triton_params(num_warps),
    )(*args)
    return results[: len(results) - len(extra_out)]


# L2 prefetch. At decode sizes the kernels between a layer's products run on a few SMs (the GDN mixer at
# batch 1: 16 programs of ~6 us) and move little, while the weight products that follow are bound by how
# fast one short kernel can stream its weights from DRAM. Extra programs of such a kernel read the next
# products' weights with an evict-last hint, so those products find them in the H200's 50 MB L2.
PREFETCH_TILE = (16, 1024)  # rows x columns one prefetch load reads (32 KB of bf16)


def prefetch_tiles(weights: tuple) -> tuple:
    """The weights as [rows, PREFETCH_TILE[1]] (a free reshape of a contiguous array); those whose size it
    does not divide are left out."""
    width = PREFETCH_TILE[1]
    return tuple(w.reshape(-1, width) for w in weights if w.size % width == 0)


def with_l2_prefetch(kernel, grid: tuple, num_head: int, num_weights: int, extra_rows: int):
    """(kernel', grid', (dummy output,)): kernel' runs `kernel` on the programs of `grid` and, on extra_rows
    more rows of its first axis, reads an equal share of each weight (refs num_head .. num_head+num_weights
    of kernel', which `kernel` does not see) and stores the sum of what it read in the dummy output [P], so
    the loads stay live. kernel' takes kernel's refs with the weights after the first num_head and the
    dummy output last."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    main_rows = grid[0]
    count = extra_rows * math.prod(grid[1:])
    block_rows, width = PREFETCH_TILE

    def prefetch(weight_refs, dummy_ref):
        program = pl.program_id(0) - main_rows
        for axis, size in enumerate(grid[1:], start=1):
            program = program * size + pl.program_id(axis)
        total = jnp.zeros((), jnp.float32)
        for w in weight_refs:
            rows = w.shape[0]
            share = -(-rows // (count * block_rows)) * block_rows  # rows per program, whole tiles
            first = program * share

            def load(i, acc, w=w, rows=rows, first=first):
                r0 = first + i * block_rows
                inside = (r0 + jnp.arange(block_rows) < rows)[:, None]
                tile = plt.load(w.at[pl.ds(r0, block_rows), :], mask=jnp.broadcast_to(inside, (block_rows, width)),
                                other=0.0, eviction_policy="evict_last")
                return acc + jnp.sum(tile.astype(jnp.float32), axis=0)

            total += jnp.sum(jax.lax.fori_loop(0, share // block_rows, load, jnp.zeros(width, jnp.float32)))
        dummy_ref[program] = total

    def wrapped(*refs):
        head, weight_refs, rest = refs[:num_head], refs[num_head:num_head + num_weights], refs[num_head + num_weights:]

        @pl.when(pl.program_id(0) < main_rows)
        def _():
            kernel(*head, *rest[:-1])

        @pl.when(pl.program_id(0) >= main_rows)
        def _():
            prefetch(weight_refs, rest[-1])

    return wrapped, (main_rows + extra_rows, *grid[1:]), (jax.ShapeDtypeStruct((count,), jnp.float32),)


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
