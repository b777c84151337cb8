"""Probe: forms of the 0.8B decode step's code, one process each, timed the same way.

    python bench/probes/decode_forms.py FORM OUT.json [BATCH ...]   # on the H200 (PYTHONPATH=.); default 1 8

One form per process: the layer's jit keeps its first trace, so a form patched in later would not run.
FORM is one of
    default    the engine as committed
    unfolded   EngineConfig.fold_norms=False (the plain RMSNorm: sum of squares, then scale and cast)
    no-barrier the folded norm's product without r22's `lax.optimization_barrier` on x: in the r21 compiled
               step (bench/results/decode-kernels-fold-probe_gpu_20261202.json.hlo-b1.txt.gz, fused_reduce.207)
               XLA fuses the residual adds that produce x into each GEMV's reduction, and the GEMVs ran
               0.3-1 us slower than with the plain norm in front
    bf16-out   the folded norm's product in x's dtype (no fp32 output), then scaled
    unfused-mixer  the GDN layer's pool-kernel rows on the unfused chain (gates, conv kernel, pool kernel, gated
               norm; `paged_forward.use_mixer_kernel` patched to say no) instead of r22's one mixer kernel
    xla-attention  the attention layers' decode rows on the XLA chain (q/k norms, RoPE, KV write kernel, page
               gather, softmax, gate; `paged_forward.use_decode_attention_kernel` patched to say no) instead of
               r23's one kernel (EngineConfig.fused_decode_kernels=False turns off both)
    head-attention the decode attention kernel's per-query-head form for every step (r23-r24's rule) instead of
               r25's grouped, split form for steps of >= 16 rows or block tables of >= 256 keys
Run on 2026-12-02 (r22, as bench/probes/fold_forms.py) before the barrier was the default, as "barrier" (then
the default), "folded" (now "no-barrier") and "bf16-out" without the barrier: fold-forms-*-probe_gpu_20261202.json.
Each form times the engine's decode step (`engine_decode_ms`, 0.8B config, random bf16 weights; the shipped
tiny model on CPU, as a check that the forms run) and writes one JSON row per batch.
"""

import json
import sys

import jax
import jax.numpy as jnp

from jaxgdn import norms, paged_forward
from jaxgdn.bench.common import environment
from jaxgdn.bench.model import engine_decode_ms, load_model
from pallas_kernels import decode_attention
from pallas_kernels.common import on_gpu

FORMS = ("default", "unfolded", "no-barrier", "bf16-out", "unfused-mixer", "xla-attention", "head-attention")


def _product_form(form: str):
    """A replacement for DeferredNorm.product, or None for the engine's own."""
    plain = norms.DeferredNorm.product

    def product(self, w):
        if self.x.size // self.x.shape[-1] > norms.POST_SCALE_MAX_TOKENS:
            return plain(self, w)
        x = self.x if form == "no-barrier" else jax.lax.optimization_barrier(self.x)
        if form == "no-barrier":
            y = jnp.einsum("...i,oi->...o", x, w, preferred_element_type=jnp.float32)
        else:  # bf16-out
            y = norms.upcast(jnp.einsum("...i,oi->...o", x, w))
        return (y * self.inv_rms).astype(self.x.dtype)

    return product if form in ("no-barrier", "bf16-out") else None


def main(form: str, out_path: str | None, batches=(1, 8)):
    if form not in FORMS:
        raise SystemExit(f"FORM must be one of {', '.join(FORMS)}")
    patched = _product_form(form)
    if patched is not None:
        norms.DeferredNorm.product = patched
    # One of the two one-kernel forms off (EngineConfig.fused_decode_kernels switches both): the layers look
    # these up at trace time, and this process traces each program once.
    if form == "unfused-mixer":
        paged_forward.use_mixer_kernel = lambda *args, **kwargs: False
    if form == "xla-attention":
        paged_forward.use_decode_attention_kernel = lambda *args, **kwargs: False
    if form == "head-attention":
        decode_attention.GROUPED_MIN_ROWS = decode_attention.GROUPED_MIN_KEYS = None
    gpu = on_gpu()
    params, cfg = load_model("qwen3.5-0.8b" if gpu else "checkpoints/qwen35-tiny-arith")
    result = {"benchmark": "decode-forms-probe", "form": form, "rows": [], "env": environment(),
              "timing": "engine_decode_ms: wall ms per decode step in steady state; device_ms_per_step the "
                        "launch replayed without the host"}
    for batch in batches:
        r = engine_decode_ms(params, cfg, batch, 64, 32 if gpu else 4, fold_norms=form != "unfolded")
        result["rows"].append({"batch": batch, "ms_per_step": r["ms_per_step"],
                               "device_ms_per_step": r["device_ms_per_step"], "tokens_digest": r["tokens_digest"]})
        print(f"{form:13s} batch {batch:3d}: {r['ms_per_step']:.3f} ms/step (device {r['device_ms_per_step']:.3f}) "
              f"tokens {r['tokens_digest']}",
              flush=True)
        if out_path:
            with open(out_path, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None, tuple(int(b) for b in sys.argv[3:]) or (1, 8))
