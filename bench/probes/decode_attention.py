"""Probe: the attention layer of a decode step on the 0.8B widths, the one decode-attention kernel against the XLA chain.

    python bench/probes/decode_attention.py OUT.json [BATCH ...]   # on the H200 (PYTHONPATH=.); CPU: a run check only

Forms: `xla` the chain the engine ran before r23 (`fused_decode=False`: q/k norms, RoPE,
the KV write kernel, the page gather, scores, softmax, P·V, the gate); `pb<P>-w<W>` the kernel
(`pallas_kernels/decode_attention.py`) loading P pages per step of its page loop on W warps, one program per
(row, query head); `g-pb<P>-w<W>` the same with one program per (row, KV head), the group's query heads on
matrix products (`_grouped_kernel`, r24; each KV head's pages read once per group); `s<T>-pb<P>-w<W>` that
with each row's page tiles split over programs until the grid has about T (r25, flash decoding:
`SPLIT_TARGET_PROGRAMS`; the splits' states merged in XLA). Each call runs
`paged_attention` (the q/k/v product, the part between, o_proj) over LAYERS distinct pools in a chain, as a
step's layers do, on one-token rows whose pages hold CONTEXT earlier tokens (a 64-token prompt and 32 decode
steps; $PROBE_CONTEXT sets another length); input the folded norm's DeferredNorm, as the engine hands it.
Device us per layer from a profiler trace, with the top kernels.
"""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxgdn.bench.common import environment, profile_calls
from jaxgdn.cache import PagedKV
from jaxgdn.config import PRESETS
from jaxgdn.norms import DeferredNorm, inverse_rms
from jaxgdn.paged_forward import RowView, paged_attention
from jaxgdn.params import AttentionParams
from pallas_kernels import decode_attention
from pallas_kernels.common import on_gpu

LAYERS, PS = 6, 16
CONTEXT = int(os.environ.get("PROBE_CONTEXT", 96))  # keys in each row's pages
MP = CONTEXT // PS + 1  # block-table width: the context's pages and the new token's
FORMS = tuple(os.environ.get("PROBE_FORMS", "xla pb1-w4 pb2-w4 g-pb2-w4 s64-pb2-w4 s128-pb2-w4 s256-pb2-w4 "
                                            "s128-pb1-w4 s256-pb1-w4 xla").split())


def case(cfg, R, seed=0):
    bf = jnp.bfloat16
    r = np.random.default_rng(seed)
    Hq, Hkv, D, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    w = lambda *s: jnp.asarray(0.02 * r.standard_normal(s), bf)  # noqa: E731
    fused = w(2 * Hq * D + 2 * Hkv * D, H)
    p = AttentionParams(q_proj=None, k_proj=None, v_proj=None, o_proj=w(H, Hq * D), q_norm=w(D), k_norm=w(D),
                        fused=fused)
    pools = [PagedKV(k=jnp.asarray(r.standard_normal((1 + R * MP, PS, Hkv, D)), bf),
                     v=jnp.asarray(r.standard_normal((1 + R * MP, PS, Hkv, D)), bf)) for _ in range(LAYERS)]
    pages = 1 + np.arange(R * MP).reshape(R, MP)
    pos = np.full((R, 1), CONTEXT)
    i32 = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
    view = RowView(token_index=i32(np.zeros((R, 1))), positions=i32(pos),
                   kv_slots=i32(pages[:, CONTEXT // PS : CONTEXT // PS + 1] * PS + CONTEXT % PS),
                   block_tables=i32(pages), seq_lens=i32(np.full(R, CONTEXT + 1)), idx_mapping=i32(np.arange(R)),
                   fresh=jnp.zeros(R, bool), verify_path=jnp.zeros(R, bool))
    x = jnp.asarray(r.standard_normal((R, 1, H)), bf)
    return p, pools, view, DeferredNorm(x, inverse_rms(x, cfg.rms_norm_eps))


def main(out_path, batches=(1, 8, 64)):
    gpu = on_gpu()
    cfg = PRESETS["qwen3.5-0.8b"]()
    result = {"benchmark": "decode-attention-probe", "rows": [], "env": environment(),
              "shape": {"layers": LAYERS, "context": CONTEXT, "page_size": PS, "queries_per_row": 1},
              "timing": "device us per layer (profiler busy time of LAYERS chained layers / LAYERS), q/k/v product "
                        "and o_proj included"}
    for R in batches:
        p, pools, view, h = case(cfg, R)
        for form in FORMS if gpu else ("xla", "pb4-w4", "g-pb1-w4", "s64-pb1-w4"):
            if form != "xla":
                layout, _, tiling = form.rpartition("pb")
                decode_attention.GROUPED_MIN_ROWS = 1 if layout else None
                decode_attention.GROUPED_MIN_KEYS = None
                decode_attention.SPLIT_TARGET_PROGRAMS = int(layout[1:-1]) if layout.startswith("s") else 1
                decode_attention.PAGES_PER_STEP = int(tiling[: tiling.index("-")])
                decode_attention.NUM_WARPS = int(tiling.split("-w")[1])

            def chain(h, pools):
                return [paged_attention(p, cfg, h, view, kv, "pallas" if form != "xla" else "xla",
                                        fused_decode=form != "xla") for kv in pools]

            prof = profile_calls(jax.jit(chain), h, pools, iters=10 if gpu else 1, divide_by=(10 if gpu else 1) * LAYERS)
            row = {"batch": R, "form": form, "us_per_layer": round(prof["busy_us"], 2),
                   "top": [[n, round(us, 2)] for n, us, *_ in prof["top"][:8]]}
            result["rows"].append(row)
            print(f"batch {R:3d} {form:8s} {row['us_per_layer']:8.2f} us/layer  top {row['top'][:4]}", flush=True)
            with open(out_path, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    main(sys.argv[1], tuple(int(b) for b in sys.argv[2:]) or (1, 8, 64))
