"""The MLP's gate/up product with SiLU(gate) * up in its epilogue, as one Mosaic GPU kernel (Hopper wgmma).

At prompt sizes XLA runs the fused gate/up product ([T, 2I] in bf16, cuBLAS) and then a separate pass
reading that product and writing SiLU(gate) * up ([T, I]). Here each CTA computes the gate and the up tile
of the same output columns in two accumulators and stores only their SiLU product: the [T, 2I] product
never goes to memory and back.

    swiglu_product(x [M, K], w [2I, K]) -> [M, I]      (w: gate rows, then up rows; Hugging Face layout)

Layout of the work: a persistent grid of one CTA per SM (in clusters of two along M, which share each weight
tile by TMA multicast) walks the (M / 2tm) x (I / tn) output tiles; in each, a memory warpgroup streams
[2tm, tk] tiles of x and [tn, tk] tiles of the gate and up rows through shared memory
(`emit_pipeline_warp_specialized`), and two compute warpgroups each own tm of the rows with [tm, tn] fp32
accumulators for gate and up. The products round to x's dtype before the SiLU, as the XLA
form's bf16 product outputs do, so only the SiLU's own rounding differs from it.

Decode steps of 64 rows take `swiglu_product_small` instead (`SmallTiles`): a plain grid of one CTA per 64-row
tile and 32 output columns, no warp specialization, the tiles streamed by `emit_pipeline`'s TMA loads.

GPU only (Mosaic GPU has no CPU lowering); `supported` says when a shape fits, else callers keep the XLA form.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

f32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class SwigluTiles:
    """tm: rows per compute warpgroup (a CTA holds 2tm); tn: output columns (each of gate and up); tk: the
    reduction tile; stages: tiles in flight in shared memory (4 x 48 KB here); approx_math: Mosaic GPU's
    approximate exp and division in the SiLU; cluster: CTAs per cluster along M (2: the pair works on
    adjacent row tiles of the same columns and multicasts each weight tile to both).

    The defaults were the fastest of the tiles tried on the H200 at the 0.8B's widths."""

    tm: int = 64
    tn: int = 128
    tk: int = 64
    stages: int = 4
    approx_math: bool = True
    cluster: int = 2


DEFAULT_TILES = SwigluTiles()


@functools.cache
def kernel_available() -> bool:
    """Whether this process can run the kernel: a Hopper GPU (wgmma is sm_90a) and Mosaic GPU importable."""
    from .common import on_gpu

    if not on_gpu() or not str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9."):
        return False
    try:
        from jax.experimental.pallas import mosaic_gpu as plgpu

        return all(hasattr(plgpu, n) for n in ("kernel", "emit_pipeline_warp_specialized", "wgmma", "ACC"))
    except ImportError:
        return False


def supported(m: int, k: int, width: int, dtype, tiles: SwigluTiles = DEFAULT_TILES) -> bool:
    """Whether swiglu_product runs [m, k] x [2 width, k] in dtype with these tiles (whole tiles only)."""
    return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and m % (2 * tiles.tm * tiles.cluster) == 0 and width % tiles.tn == 0 and k % tiles.tk == 0)


def _transforms(minor_elems: int, dtype):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    swizzle = plgpu.find_swizzle(minor_elems * jnp.dtype(dtype).itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))


def _kernel(x_gmem, w_gmem, out_gmem, *, tiles: SwigluTiles, width: int):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    tm, tn, tk = tiles.tm, tiles.tn, tiles.tk
    m, k = x_gmem.shape
    dtype = x_gmem.dtype
    m_tiles, n_tiles = m // (2 * tm * tiles.cluster), width // tn  # m_tiles: row tiles of a cluster
    in_transforms = _transforms(tk, dtype)
    shared = ("cluster",) if tiles.cluster > 1 else ()

    def pipeline(body, compute_context):
        spec = lambda rows, axes=(): plgpu.BlockSpec((rows, tk), lambda kk: (0, kk),  # noqa: E731
                                                     transforms=in_transforms, memory_space=plgpu.SMEM,
                                                     collective_axes=axes)
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k // tk,), memory_registers=40, in_specs=[spec(2 * tm), spec(tn, shared), spec(tn, shared)],
            wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=tiles.stages, compute_context=compute_context)

    def rows_of(i):  # the CTA's x rows for output tile row i
        return pl.ds(i * 2 * tm, 2 * tm)

    ignore = lambda *_, **__: None  # noqa: E731  (allocations do not depend on the bodies)
    allocs = pipeline(ignore, ignore).get_allocations(x_gmem.at[rows_of(0)], w_gmem.at[pl.ds(0, tn)],
                                                      w_gmem.at[pl.ds(width, tn)])

    @functools.partial(pl.run_scoped, pipeline_allocs=allocs,
                       out_smem=plgpu.SMEM((2, tm, tn), out_gmem.dtype, transforms=_transforms(tn, out_gmem.dtype)),
                       collective_axes="wg")
    def _scope(pipeline_allocs, out_smem):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes="sm")
        def _tile(loop_info):
            (lin,) = loop_info.index
            mi, ni = lin // n_tiles, lin % n_tiles  # row block by row block (column block first: no faster, r34e)
            if tiles.cluster > 1:
                mi = mi * tiles.cluster + lax.axis_index("cluster")

            def compute_context(eval_pipeline):
                @functools.partial(pl.run_scoped, acc_gate=plgpu.ACC((tm, tn), f32), acc_up=plgpu.ACC((tm, tn), f32))
                def _accs(acc_gate, acc_up):
                    eval_pipeline((acc_gate, acc_up))
                    gate = acc_gate[...].astype(dtype).astype(f32)
                    up = acc_up[...].astype(dtype).astype(f32)
                    y = gate / (1.0 + jnp.exp(-gate)) * up
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's store has read out_smem
                    out_smem[wg] = y.astype(out_gmem.dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(out_smem.at[wg],
                                            out_gmem.at[pl.ds(mi * 2 * tm + wg * tm, tm), pl.ds(ni * tn, tn)])

            def mma(_, x_smem, gate_smem, up_smem, accs):
                acc_gate, acc_up = accs
                x_rows = x_smem.at[pl.ds(wg * tm, tm)]
                plgpu.wgmma(acc_gate, x_rows, plgpu.transpose_ref(gate_smem, (1, 0)))
                plgpu.wgmma(acc_up, x_rows, plgpu.transpose_ref(up_smem, (1, 0)))
                plgpu.wgmma_wait(0)
                return accs

            pipeline(mma, compute_context)(x_gmem.at[rows_of(mi)], w_gmem.at[pl.ds(ni * tn, tn)],
                                           w_gmem.at[pl.ds(width + ni * tn, tn)], allocations=pipeline_allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


@dataclasses.dataclass(frozen=True)
class SmallTiles:
    """The decode-sized form (M a multiple of 64, at most max_rows): tn output columns (of gate and of up) a
    CTA, tk the reduction tile, stages TMA loads in flight. tn = 32 gives the 0.8B's 3584 columns 112 CTAs.
    max_rows 64: at 128 rows the two row tiles each stream the weights and the form loses to XLA's product
    and pass."""

    tn: int = 32
    tk: int = 128
    stages: int = 4
    max_rows: int = 64
    approx_math: bool = True


SMALL_TILES = SmallTiles()


def supported_small(m: int, k: int, width: int, dtype, tiles: SmallTiles = SMALL_TILES) -> bool:
    """Whether swiglu_product_small runs [m, k] x [2 width, k] in dtype (m in whole 64-row tiles)."""
    return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and m % 64 == 0 and 0 < m <= tiles.max_rows and width % tiles.tn == 0 and k % tiles.tk == 0)


def _small_kernel(x_gmem, w_gmem, out_gmem, *, tiles: SmallTiles, width: int):
    """One CTA per (64-row tile, tn columns): the x rows and the gate and up rows of its columns stream through
    shared memory; two [64, tn] fp32 accumulators; SiLU(gate) * up stored. Each row tile streams all the weights
    (why max_rows is one tile: at two, the second's reads did not come cheap from L2)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    mi, ni = lax.axis_index("m"), lax.axis_index("n")
    k = x_gmem.shape[1]
    tn, tk, dtype = tiles.tn, tiles.tk, x_gmem.dtype
    spec = lambda rows: plgpu.BlockSpec((rows, tk), lambda kk: (0, kk), transforms=_transforms(tk, dtype))  # noqa: E731

    @functools.partial(pl.run_scoped, acc_gate=plgpu.ACC((64, tn), f32), acc_up=plgpu.ACC((64, tn), f32),
                       out_smem=plgpu.SMEM((64, tn), out_gmem.dtype))
    def _scope(acc_gate, acc_up, out_smem):
        def step(_, x_smem, gate_smem, up_smem):
            plgpu.wgmma(acc_gate, x_smem, plgpu.transpose_ref(gate_smem, (1, 0)))
            plgpu.wgmma(acc_up, x_smem, plgpu.transpose_ref(up_smem, (1, 0)))
            plgpu.wgmma_wait(0)  # the tiles' slot is released when the step returns

        plgpu.emit_pipeline(step, grid=(k // tk,), in_specs=[spec(64), spec(tn), spec(tn)],
                            max_concurrent_steps=tiles.stages)(
            x_gmem.at[pl.ds(mi * 64, 64)], w_gmem.at[pl.ds(ni * tn, tn)], w_gmem.at[pl.ds(width + ni * tn, tn)])
        gate = acc_gate[...].astype(dtype).astype(f32)  # rounded as the XLA form's bf16 products are
        up = acc_up[...].astype(dtype).astype(f32)
        out_smem[...] = (gate / (1.0 + jnp.exp(-gate)) * up).astype(out_gmem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[pl.ds(mi * 64, 64), pl.ds(ni * tn, tn)])
        plgpu.wait_smem_to_gmem(0)


def swiglu_product_small(x, w, tiles: SmallTiles = SMALL_TILES):
    """`swiglu_product` for decode-sized x [M, K] (M a multiple of 64, at most tiles.max_rows) -> [M, I]."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    m, k = x.shape
    width = w.shape[0] // 2
    if w.shape != (2 * width, k) or w.dtype != x.dtype or not supported_small(m, k, width, x.dtype, tiles):
        raise ValueError(f"swiglu_product_small: x {x.shape} {x.dtype}, w {w.shape} {w.dtype} not whole {tiles}")
    call = plgpu.kernel(
        functools.partial(_small_kernel, tiles=tiles, width=width),
        out_type=jax.ShapeDtypeStruct((m, width), x.dtype), grid=(m // 64, width // tiles.tn), grid_names=("m", "n"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
                                             approx_math=tiles.approx_math))
    return call(x, w)


def swiglu_product(x, w, tiles: SwigluTiles = DEFAULT_TILES, num_sms: int | None = None):
    """silu(x @ w[:I].T) * (x @ w[I:].T) for x [M, K], w [2I, K] (same dtype) -> [M, I] in x.dtype."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    m, k = x.shape
    width = w.shape[0] // 2
    if w.shape != (2 * width, k) or w.dtype != x.dtype or not supported(m, k, width, x.dtype, tiles):
        raise ValueError(f"swiglu_product: x {x.shape} {x.dtype}, w {w.shape} {w.dtype} not whole {tiles}")
    num_sms = num_sms or jax.devices()[0].core_count
    clusters = dict(cluster=(tiles.cluster,), cluster_names=("cluster",)) if tiles.cluster > 1 else {}
    call = plgpu.kernel(
        functools.partial(_kernel, tiles=tiles, width=width),
        out_type=jax.ShapeDtypeStruct((m, width), x.dtype), grid=(num_sms // tiles.cluster,), grid_names=("sm",),
        num_threads=3, thread_name="wg", **clusters,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
                                             approx_math=tiles.approx_math))
    return call(x, w)
