"""Probe: does Pallas' Mosaic GPU backend (JAX's successor to the Triton lowering) compile and run here, and
how fast is a bandwidth-bound kernel through it against the Triton lowering and XLA, on one H200.

    python bench/probes/mosaic_gpu.py OUT.json     # on the H200; on CPU only the XLA and interpreted rows

The kernel is y = 2x + 1 over x [16384, 4096] fp32 (256 MB read, 256 MB written), tiled in blocks: the
same pallas_call body under Triton's and Mosaic GPU's compiler params, and the `plgpu.kernel` form
(`mosaic_kernel_affine`). Device µs per call from the profiler; TB/s = bytes moved / time. A form that
does not compile gets its error as the row's "failed" (and its traceback). H200 result:
bench/results/mosaic-gpu-probe_gpu_20261202.json.
"""

import importlib
import inspect
import json
import sys
import traceback

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxgdn.bench.common import environment, probe_row, profile_calls

ROWS, COLS, BLOCK_ROWS = 16384, 4096, 64


def _affine_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0 + 1.0


def pallas_affine(x, compiler_params, interpret=False, block_rows=BLOCK_ROWS, block_cols=None):
    block_cols = block_cols or x.shape[1]
    spec = pl.BlockSpec((block_rows, block_cols), lambda i, j: (i, j))
    return pl.pallas_call(_affine_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          grid=(x.shape[0] // block_rows, x.shape[1] // block_cols), in_specs=[spec],
                          out_specs=spec, compiler_params=compiler_params, interpret=interpret)(x)


def mosaic_kernel_affine(x, block_rows=64, block_cols=128, stages=2):
    """The same y = 2x + 1 through `plgpu.kernel` (jax 0.11's Mosaic GPU entry point; pl.pallas_call has no
    Mosaic GPU rule there): one CTA per row block, pipelining its column blocks through shared memory."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    spec = lambda i: plgpu.BlockSpec((block_rows, block_cols), lambda j: (i, j))  # noqa: E731

    def body(x_gmem, o_gmem):
        i = jax.lax.axis_index("rows")

        def step(_, x_smem, o_smem):
            o_smem[...] = x_smem[...] * 2.0 + 1.0

        plgpu.emit_pipeline(step, grid=(x.shape[1] // block_cols,), in_specs=[spec(i)], out_specs=[spec(i)],
                            max_concurrent_steps=stages)(x_gmem, o_gmem)

    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    grid = dict(grid=(x.shape[0] // block_rows,), grid_names=("rows",))
    try:  # jax 0.11.2 names the output out_type; 0.10.2 out_shape
        call = plgpu.kernel(body, out_type=out, **grid)
    except TypeError:
        call = plgpu.kernel(body, out_shape=out, **grid)
    return call(x)


def main(out_path=None):
    gpu = jax.default_backend() == "gpu"
    x = jax.random.normal(jax.random.PRNGKey(0), (ROWS, COLS) if gpu else (256, 128), jnp.float32)
    want = x * 2.0 + 1.0
    nbytes = 2 * x.size * 4
    forms = {"xla": lambda: jax.jit(lambda a: a * 2.0 + 1.0)}
    if gpu:
        from jax.experimental.pallas import mosaic_gpu as plgpu
        from jax.experimental.pallas import triton as plt

        try:  # does importing the registration give pl.pallas_call a Mosaic GPU rule? (0.11.2: no)
            importlib.import_module("jax._src.pallas.mosaic_gpu.pallas_call_registration")
            registration = "imported"
        except Exception as e:  # noqa: BLE001
            registration = repr(e)[:500]
        print("mosaic_gpu pallas_call_registration:", registration, flush=True)
        print("plgpu.kernel", inspect.signature(plgpu.kernel), flush=True)  # its keywords move between versions

        forms["pallas_triton_8x1024_w8"] = lambda: jax.jit(
            lambda a: pallas_affine(a, plt.CompilerParams(num_warps=8), block_rows=8, block_cols=1024))
        forms["pallas_triton_16x1024_w4"] = lambda: jax.jit(
            lambda a: pallas_affine(a, plt.CompilerParams(num_warps=4), block_rows=16, block_cols=1024))
        # pl.pallas_call under Mosaic GPU's params at a few block shapes (on jax 0.11.2 none lowers: no rule)
        for br, bc in ((32, 256), (16, 512), (64, 128), (64, 512)):
            forms[f"pallas_mosaic_gpu_{br}x{bc}"] = lambda br=br, bc=bc: jax.jit(
                lambda a: pallas_affine(a, plgpu.CompilerParams(), block_rows=br, block_cols=bc))
        for br, bc in ((64, 128), (32, 256)):
            forms[f"plgpu_kernel_{br}x{bc}"] = lambda br=br, bc=bc: jax.jit(
                lambda a: mosaic_kernel_affine(a, block_rows=br, block_cols=bc))
    else:
        forms["pallas_interpret"] = lambda: jax.jit(lambda a: pallas_affine(a, None, interpret=True, block_rows=64))
    rows = [{"form": "mosaic_gpu registration import", "result": registration}] if gpu else []
    for name, make in forms.items():
        def measure(make=make):
            f = make()
            err = float(jnp.abs(f(x) - want).max())
            row = {"max_err": err}
            if gpu:
                us = profile_calls(f, x)["busy_us"]
                row.update(us=round(us, 1), tb_per_s=round(nbytes / us / 1e6, 2))
            return row

        row = probe_row({"form": name}, measure)
        if "failed" in row:
            try:
                make()(x)
            except Exception:  # noqa: BLE001
                row["traceback"] = traceback.format_exc()[-1500:]
                print(row["traceback"], flush=True)
        rows.append(row)
    if out_path:
        with open(out_path, "w") as f:
            json.dump({"benchmark": "mosaic-gpu-probe", "shape": list(x.shape), "bytes": nbytes, "rows": rows,
                       "env": environment()}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
