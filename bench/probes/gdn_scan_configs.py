"""Probe: the chunked GDN's chunk-state scan (`_scan_kernel`, the one sequential kernel) under several
launch settings and with the output's products in its loop (`fuse_output`, r35), beside fla 0.6.0's
kernels in the same process (and fla's autotuned choice for its h kernel). o is bf16 on both sides.
r20 also timed the state split in 64-row halves as fla's h kernel holds it (forms "split2",
"bv32-w4-split2", "bv32-w2-split2-s4": gdn_chunked_pallas(scan_k_split=2) in commit adb2871, removed
since: slower at every shape, bench/results/gdn-scan-configs-probe_gpu_20261202.json). r35's forms are in
bench/results/gdn-scan-fused-probe-r35*_gpu_20261203.json: the output's parts in the prep kernel (-prep,
commit-less: prep 403 against 120 µs at 1x8192), in their own kernel without (-noprefetch) and with the
per-chunk scalars prefetched (the committed default).

    python bench/probes/gdn_scan_configs.py OUT.json    # on the H200 (PYTHONPATH=.); CPU: correctness only

Rows: (shape, form) with each kernel's device µs per call and their sum, max |o - o_default|; "gated-*"
rows run the GDN layer's call (in-place gates, the gated norm: in XLA after the fused form);
then one fla row per shape, its kernels by name (torch's profiler, after every JAX profile). The JSON is
rewritten after every row, so a call cut by its time limit keeps what it measured.
"""

import functools
import json
import sys

import jax
import jax.numpy as jnp

from jaxgdn.bench.common import (
    ensure_triton_cache_dir,
    environment,
    probe_row,
    profile_calls,
    random_gdn_inputs,
    torch_kernel_us,
)
from pallas_kernels.common import on_gpu
from pallas_kernels.gdn_pallas import GateSource, OutputGate, gdn_chunked_pallas

# Each form: gdn_chunked_pallas keyword arguments. r20's forms (dv tiles 16 / 32, 2 / 4 warps, the state in
# halves) are in bench/results/gdn-scan-configs-probe_gpu_20261202.json; r35 added the output in the scan.
FORMS = {
    "default": {"fuse_output": False, "prefetch": False},
    "prefetch": {"fuse_output": False, "prefetch": True},
    "fused-prefetch": {"fuse_output": True, "prefetch": True},
}
GATED_FORMS = ("default", "prefetch", "fused-prefetch")  # the GDN layer's call: gated norm and in-place gates


def main(out_path=None):
    gpu = on_gpu()
    shapes, H, d = (((1, 4096), (1, 8192), (1, 16384), (8, 2048)), 16, 128) if gpu else (((1, 128),), 2, 64)
    rows, inputs = [], {}

    def save():
        if out_path:
            with open(out_path, "w") as f:
                json.dump({"benchmark": "gdn-scan-configs-probe", "forms": FORMS, "rows": rows, "env": environment()},
                          f, indent=1)

    def run_form(shape, form, f, x, ref):
        """One row: f(*x)'s kernels (every kernel of the call, by name) and max |o - ref[0]|."""
        def measure():
            o, _ = f(*x)
            ref.append(o) if not ref else None
            row = {"error": float(jnp.abs(o.astype(jnp.float32) - ref[0].astype(jnp.float32)).max())}
            if gpu:
                summary = profile_calls(f, *x)
                row["us"] = {name: round(us, 1) for name, us, _ in summary["top"]}
                row["sum_us"] = round(summary["busy_us"], 1)
            return row

        rows.append(probe_row({"shape": list(shape), "form": form}, measure))
        save()

    for B, T in shapes:
        inputs[B, T] = x = random_gdn_inputs(B, T, H, d)
        ref = []
        for form, kwargs in FORMS.items():
            f = jax.jit(functools.partial(gdn_chunked_pallas, out_dtype=jnp.bfloat16, **kwargs))
            run_form([B, T, H, d], form, f, x, ref)
    # The layer's call at its largest prompt: gates from the projection, the gated norm from its z columns.
    B, T = shapes[1] if gpu else shapes[0]
    q, k, v, _, _ = inputs[B, T]
    key = jax.random.PRNGKey(1)
    source = jax.random.normal(key, (B, T, 2 * H + H * d), jnp.bfloat16)  # b ‖ a ‖ z
    gates = GateSource(source, 0, jnp.log(jnp.linspace(0.5, 8.0, H)), jnp.linspace(-1.0, 1.0, H))
    gate = OutputGate(source, 1 + 0.1 * jax.random.normal(key, (d,)), 1e-6, z_offset=2 * H)
    ref = []
    for form in GATED_FORMS:
        f = jax.jit(lambda q, k, v, src, form=form: gdn_chunked_pallas(
            q, k, v, None, None, gates=gates._replace(source=src), gate=gate._replace(z=src), **FORMS[form]))
        run_form([B, T, H, d], f"gated-{form}", f, (q, k, v, source), ref)
    if gpu:
        try:
            import torch
            from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_kernel_h_blockdim64 as fla_h
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        except ImportError as e:
            print(f"fla unavailable: {e}")
        else:
            ensure_triton_cache_dir()
            for (B, T), x in inputs.items():
                q, k, v, g, beta = (torch.from_dlpack(a) for a in x)
                beta = beta.to(torch.bfloat16)

                def measure(q=q, k=k, v=v, g=g, beta=beta):
                    def call():
                        return chunk_gated_delta_rule(q, k, v, g=g, beta=beta, output_final_state=True,
                                                      use_qk_l2norm_in_kernel=True)

                    with torch.no_grad():
                        us = torch_kernel_us(call)
                    best = getattr(fla_h, "best_config", None)
                    return {"us": {name: round(t, 1) for name, t in us.items()}, "sum_us": round(sum(us.values()), 1),
                            "h_kernel_config": str(best)}

                rows.append(probe_row({"shape": [B, T, H, d], "form": "fla"}, measure))
                save()
    save()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
