"""Probe: causal GQA attention of whole prompts at the 0.8B's attention shape (8 query heads, 2 KV heads,
head_dim 256, bf16), the engine's XLA form against flash-style kernels.

    python bench/probes/prefill_attention.py OUT.json      # on the H200 (PYTHONPATH=.:tests); CPU: correctness only

Rows: (rows R, tokens per row Q) with every row a fresh prompt, so its keys are its own K/V. Columns (device
ms per call from a profiler trace, max |error| against the fp32 reference):
  xla_gathered  `gqa_attention` over the row's own keys with the validity mask: what `paged_attention`'s
                XLA path computes once the pages are gathered (it gathers MP*page_size >= Q keys);
  cudnn         `jax.nn.dot_product_attention(implementation="cudnn")`, causal with per-row lengths;
  pallas_mha    JAX's bundled Pallas (Triton) flash attention, K/V repeated to the query heads;
  mgpu[_nosb]   JAX's bundled Mosaic GPU flash attention for Hopper (`attention_mgpu`: TMA, wgmma, two
                compute warpgroups; GQA and causal masking built in, no lengths, so rows are whole; q
                pre-scaled by D^-0.5, which the engine would fold into its q kernel), with and without its
                schedule barrier. At head_dim 256 its shared memory allows 64x64 tiles 2 stages deep only.
  *_f16         the same on fp16 operands (r31: attention_mgpu refused bf16 here).
                Added at r30 for the next round: cuDNN's kernel takes 3.15 of the 26 ms 1x8192 step at ~520
                TFLOP/s (bench/results/prefill-dump-r30_gpu_20261203.json).
"""

import json
import sys

import jax
import jax.numpy as jnp

from jaxgdn.attention import gqa_attention
from jaxgdn.bench.common import environment, profile_calls

HQ, HKV, D = 8, 2, 256
SHAPES = ((1, 8192), (1, 2048), (8, 1024))


def device_ms(f, *args):
    summary = profile_calls(f, *args)
    return round(summary["busy_us"] / 1e3, 3), summary["top"][:4]


def implementations(lengths):
    def xla_gathered(q, k, v):
        R, Q = q.shape[:2]
        pos = jnp.broadcast_to(jnp.arange(Q, dtype=jnp.int32), (R, Q))
        return gqa_attention(q, k, v, pos, pos, pos < lengths[:, None])

    def cudnn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=lengths,
                                            key_value_seq_lengths=lengths, implementation="cudnn")

    def pallas_mha(q, k, v):
        from jax.experimental.pallas.ops.gpu import attention

        rep = lambda x: jnp.repeat(x, HQ // HKV, axis=2)  # noqa: E731
        sizes = attention.BlockSizes(block_q=64, block_k=64)
        return attention.mha(q, rep(k), rep(v), None, sm_scale=D**-0.5, causal=True, block_sizes=sizes,
                             num_warps=8, num_stages=2)

    def mgpu(q, k, v, schedule_barrier=True):
        from jax.experimental.pallas.ops.gpu import attention_mgpu

        config = attention_mgpu.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2, causal=True,
                                             use_schedule_barrier=schedule_barrier)
        return attention_mgpu.attention((q * D**-0.5).astype(q.dtype), k, v, config)

    return {"xla_gathered": xla_gathered, "cudnn": cudnn, "pallas_mha": pallas_mha, "mgpu": mgpu,
            "mgpu_nosb": lambda q, k, v: mgpu(q, k, v, schedule_barrier=False),
            # fp16 operands (cast before the call, outside the timing): JAX 0.11.2's attention_mgpu refuses bf16
            # at these shapes (r31: "src had type bfloat16 and dst had type float16")
            "cudnn_f16": cudnn, "mgpu_f16": mgpu, "mgpu_nosb_f16": lambda q, k, v: mgpu(q, k, v, schedule_barrier=False)}


def main(out_path=None):
    on_gpu = jax.default_backend() == "gpu"
    key = jax.random.PRNGKey(0)
    rows = []
    for R, Q in SHAPES if on_gpu else ((2, 64),):
        kq, kk, kv = jax.random.split(jax.random.fold_in(key, Q), 3)
        q = jax.random.normal(kq, (R, Q, HQ, D), jnp.bfloat16)
        k = jax.random.normal(kk, (R, Q, HKV, D), jnp.bfloat16)
        v = jax.random.normal(kv, (R, Q, HKV, D), jnp.bfloat16)
        lengths = jnp.full((R,), Q, jnp.int32).at[-1].set(Q - 5)  # one row padded at its end
        impls = implementations(lengths)
        ref = impls["xla_gathered"](q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32))
        keep = jnp.arange(Q)[None, :, None, None] < lengths[:, None, None, None]
        row = {"R": R, "Q": Q}
        for name, f in impls.items():
            if not on_gpu and name != "xla_gathered":
                continue
            args = [x.astype(jnp.float16) for x in (q, k, v)] if name.endswith("_f16") else (q, k, v)
            try:
                got = jax.jit(f)(*args)
                err = float(jnp.max(jnp.where(keep, jnp.abs(got.astype(jnp.float32) - ref), 0)))
                row[name] = {"error": round(err, 4)}
                if on_gpu:
                    row[name]["ms"], row[name]["top"] = device_ms(jax.jit(f), *args)
            except Exception as e:  # noqa: BLE001 - a form that does not lower is a result too
                row[name] = {"failed": repr(e)[:300]}
            print(R, Q, name, {a: b for a, b in row[name].items() if a != "top"}, flush=True)
        rows.append(row)
    if out_path:
        with open(out_path, "w") as f:
            json.dump({"benchmark": "prefill-attention-probe", "heads": [HQ, HKV, D], "rows": rows, "env": environment()},
                      f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
