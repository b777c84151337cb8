"""Probe: the sampling and draft-verification programs on the GPU against the same programs on the CPU.

Same keys give the same noise on both backends (threefry), so tokens must match. Usage (JAX_PLATFORMS=cuda,cpu):
  python bench/probes/sampling_backends.py [OUT.json]
"""

import datetime
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxgdn.engine.sampling import position_keys, sample_tokens
from jaxgdn.engine.spec_decode import verify_drafts


def case(V: int, R: int, W: int, peak: float, seed: int, draft: int = 3):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(R, W, V)).astype(np.float32)
    logits[..., 3] += peak  # one confident token, as the shipped model's
    drafts = np.full((R, W - 1), draft, np.int32)  # 3: the confident token; else rejected, residual drawn
    n_draft = np.full(R, W - 1, np.int32)
    temperature = np.array([0.9, 1.1, 0.0, 0.7][:R], np.float32)
    top_k = np.array([0, 5, 0, 0][:R], np.int32)
    top_p = np.array([0.8, 1.0, 1.0, 0.95][:R], np.float32)
    seeds = np.arange(R, dtype=np.uint32) + 3
    rid = np.arange(R, dtype=np.uint32)
    pos = (np.arange(R * W) + 10).astype(np.int32)
    return logits, drafts, n_draft, temperature, top_k, top_p, seeds, rid, pos


def run(device, args, in_program_dot: bool = False):
    """in_program_dot: the logits come from a weight product inside the jitted program (as in the engine's
    step, where XLA may fuse the product's consumers into it), of hidden [R, W, V] and an identity."""
    logits, drafts, n_draft, t, k, p, seeds, rid, pos = [jax.device_put(a, device) for a in args]
    R, W, V = logits.shape
    eye = jax.device_put(np.eye(V, dtype=np.float32), device)

    @jax.jit
    def f(logits, drafts, n_draft, t, k, p, seeds, rid, pos):
        if in_program_dot:
            logits = jnp.einsum("rwh,hv->rwv", logits, eye, precision="highest")
        keys = position_keys(jnp.repeat(seeds, W), jnp.repeat(rid, W), pos).reshape(R, W)
        tokens, n = verify_drafts(logits, drafts, n_draft, t, k, p, keys, True)
        plain = sample_tokens(logits[:, 0], t, k, p, keys[:, 0])
        return tokens, n, plain

    return [np.asarray(x) for x in f(logits, drafts, n_draft, t, k, p, seeds, rid, pos)]


def main():
    gpu, cpu = jax.devices()[0], jax.devices("cpu")[0]
    rows = []
    for V in (99, 128, 4096):
        for peak, draft in ((0.0, 3), (8.0, 3), (8.0, 5)):
            for seed in range(4):
                for dot in (False, True):
                    args = case(V, 4, 3, peak, seed, draft)
                    g, c = run(gpu, args, dot), run(cpu, args, dot)
                    same = all(np.array_equal(a, b) for a, b in zip(g, c))
                    rows.append({"V": V, "peak": peak, "draft": draft, "seed": seed, "in_program_dot": dot,
                                 "same": same, "gpu": [a.tolist() for a in g], "cpu": [a.tolist() for a in c]})
                    print(V, peak, draft, seed, dot, "same" if same else f"DIFF gpu={g[2].tolist()} {g[0].tolist()} "
                          f"cpu={c[2].tolist()} {c[0].tolist()}", flush=True)
    out = {"probe": "sampling-backends", "rows": rows,
           "env": {"device": gpu.device_kind, "jax": jax.__version__,
                   "date": datetime.datetime.now(datetime.timezone.utc).isoformat()}}
    if len(sys.argv) > 1:
        json.dump(out, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
