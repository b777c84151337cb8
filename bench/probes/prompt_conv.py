"""Probe: the GDN layer's causal conv + SiLU over one long prompt, in XLA formulations, as the engine runs it:
the pre-conv channels are the first C of the fused input projection's product [T, N] (a strided read), the
outputs the three q, k, v pieces the chunked kernels take.

    python bench/probes/prompt_conv.py OUT.json      # on the H200 (PYTHONPATH=.:tests); CPU: correctness only

Columns (device ms per call from a profiler trace; max |error| against `concat`):
  concat    the definition: [window ‖ mixed] built, then Kc shifted slices of it;
  taps      each tap concatenates its window rows and shifted mixed rows (`gdn.causal_conv_silu` before
            this probe);
  padded    taps read a zero-padded mixed; the window's contribution is a [Kc-1, C] correction added to the
            first rows (`gdn.causal_conv_silu` since);
  lax_conv  XLA's depthwise `conv_general_dilated` over the zero-padded mixed, the same correction;
  kernel_BTxBC_wW  the Pallas kernel `conv_pallas.causal_conv_prompt` (tile of BT rows x BC channels, W warps),
            written straight into q, k, v (the engine's form since r10).
"""

import json
import os
import sys

import jax
import jax.numpy as jnp

from jaxgdn.bench.common import environment, probe_row, profile_calls
from pallas_kernels.conv_pallas import causal_conv_prompt

f32 = jnp.float32
T_LONG, C, N, KC = 8192, 6144, 8224, 4
# (BT rows, BC channels, warps) of the kernel's tiles
KERNEL_TILES = ((16, 256, 4), (8, 256, 4), (16, 512, 4), (16, 256, 2), (8, 512, 4), (16, 128, 2), (8, 128, 2))
if os.environ.get("PROBE_TILES"):  # e.g. "16x256w4 32x128w4": other tiles than r10's
    KERNEL_TILES = tuple(tuple(int(n) for n in t.replace("w", "x").split("x")) for t in os.environ["PROBE_TILES"].split())


def device_ms(f, *args):
    summary = profile_calls(f, *args)
    return round(summary["busy_us"] / 1e3, 4), summary["top"][:3]


def split3(u):
    return u[..., : C // 3], u[..., C // 3 : 2 * C // 3], u[..., 2 * C // 3 :]


def window_correction(window, w, T):
    """[1, T, C] fp32: the window's taps on the first Kc-1 outputs, zeros after."""
    corr = sum(jnp.pad(window[:, j:].astype(f32), [(0, 0), (0, j), (0, 0)]) * w[:, j] for j in range(KC - 1))
    return jnp.pad(corr, [(0, 0), (0, T - (KC - 1)), (0, 0)])


def forms(weight):
    w = weight[:, 0, :].astype(f32)  # [C, Kc]

    def concat(src, window):
        mixed = src[None, :, :C]
        T = mixed.shape[1]
        full = jnp.concatenate([window, mixed], axis=1)
        acc = sum(full[:, j : j + T].astype(f32) * w[:, j] for j in range(KC))
        return split3(jax.nn.silu(acc).astype(src.dtype))

    def taps(src, window):
        mixed = src[None, :, :C]
        T = mixed.shape[1]

        def tap(j):  # full[:, j : j + T]
            back = KC - 1 - j
            return jnp.concatenate(([window[:, j:]] if back else []) + [mixed[:, : T - back]], axis=1)

        return split3(jax.nn.silu(sum(tap(j).astype(f32) * w[:, j] for j in range(KC))).astype(src.dtype))

    def padded(src, window):
        mixed = src[None, :, :C]
        T = mixed.shape[1]
        xp = jnp.pad(mixed, [(0, 0), (KC - 1, 0), (0, 0)])
        acc = sum(xp[:, j : j + T].astype(f32) * w[:, j] for j in range(KC)) + window_correction(window, w, T)
        return split3(jax.nn.silu(acc).astype(src.dtype))

    def lax_conv(src, window):
        mixed = src[None, :, :C]
        T = mixed.shape[1]
        rhs = weight.astype(mixed.dtype).transpose(2, 1, 0)  # [Kc, 1, C]: width, in/group, out
        acc = jax.lax.conv_general_dilated(mixed, rhs, (1,), [(KC - 1, 0)], dimension_numbers=("NWC", "WIO", "NWC"),
                                           feature_group_count=C, preferred_element_type=f32)
        acc = acc + window_correction(window, w, T)
        return split3(jax.nn.silu(acc).astype(src.dtype))

    def kernel(src, window, bt, bc, warps):
        return causal_conv_prompt(src[None], (C // 3,) * 3, weight, window, block_t=bt, block_c=bc, num_warps=warps)

    kernels = {f"kernel_{bt}x{bc}_w{w}": (lambda s, win, bt=bt, bc=bc, w=w: kernel(s, win, bt, bc, w))
               for bt, bc, w in KERNEL_TILES}
    return {"concat": concat, "taps": taps, "padded": padded, "lax_conv": lax_conv, **kernels}


def main(out_path=None):
    on_gpu = jax.default_backend() == "gpu"
    T = T_LONG if on_gpu else 40
    key = jax.random.PRNGKey(0)
    src = jax.random.normal(key, (T, N), jnp.bfloat16)
    window = jax.random.normal(jax.random.fold_in(key, 1), (1, KC - 1, C), jnp.bfloat16)
    weight = jax.random.normal(jax.random.fold_in(key, 2), (C, 1, KC), f32) * 0.5
    fs = forms(weight)
    ref = [x.astype(f32) for x in jax.jit(fs["concat"])(src, window)]
    gb = (T * C * 2 * 2) / 1e9  # read the C channels once, write q, k, v once (bf16)
    rows = []
    for name, f in fs.items():

        def measure(f=jax.jit(f)):
            got = f(src, window)
            row = {"error": max(float(jnp.abs(g.astype(f32) - r).max()) for g, r in zip(got, ref))}
            if on_gpu:
                row["ms"], row["top"] = device_ms(f, src, window)
                row["TB_per_s"] = round(gb / row["ms"], 2)
            return row

        rows.append(probe_row({"form": name}, measure, quiet=("top",)))
    if out_path:
        with open(out_path, "w") as f:
            json.dump({"benchmark": "prompt-conv-probe", "T": T, "C": C, "source_width": N, "rows": rows,
                       "env": environment()}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
