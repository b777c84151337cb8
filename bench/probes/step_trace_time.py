"""Probe: host seconds to trace and lower the engine's step programs (what a warm start still pays with
every compiled program in the persistent cache: JAX keys the cache on the lowered module).

    python bench/probes/step_trace_time.py [--model M] [--k K] [--out OUT.json]   # default 0.8B preset, K = 1
    python bench/probes/step_trace_time.py --pallas-sites N [--out OUT.json]     # N chunked GDN calls, for CUDA

Runs `bench startup`'s workload (8 prompts of 64 tokens, 16 tokens each, MTP K drafts) and, for each new
step program the engine launches, times `jit.trace` and `.lower()` of it in place of the launch's compile
(the programs are then run as usual). Prints one line per program and the totals.

--pallas-sites: one program with N `gdn_chunked_pallas` calls in a chain (0.8B heads, 8x64 tokens), traced
and lowered for CUDA (works without a GPU), once with each call traced inline and once with the calls
going through one nested jit: what every Pallas call site costs a start-up and what sharing saves.
"""

import argparse
import json
import time

import numpy as np

from jaxgdn.bench.common import environment
from jaxgdn.bench.model import load_model, make_engine
from jaxgdn.request import SamplingParams


def main(model="qwen3.5-0.8b", k=1):
    params, cfg = load_model(model, include_mtp=k > 0)
    eng = make_engine(params, cfg, batch=8, max_model_len=64 + 16 + 8, max_batched=8 * 64, K=k)
    runner = eng.runner
    seen, totals = set(), [0.0, 0.0]
    launch = runner._launch

    def timed_launch(step_input, layout, stochastic, num_steps=1, whole_prompts=False):
        key = (step_input.shape, layout, stochastic, num_steps, whole_prompts)
        if key not in seen:
            seen.add(key)
            size = step_input.shape[0]
            resident = runner._resident_inputs.get(size)
            resident = np.zeros(size + 1, np.int32) if resident is None else resident
            t0 = time.perf_counter()
            traced = runner.program(layout).trace(runner.params, runner.state, resident, step_input, layout, stochastic,
                                        num_steps, whole_prompts)
            t1 = time.perf_counter()
            traced.lower()
            t2 = time.perf_counter()
            totals[0] += t1 - t0
            totals[1] += t2 - t1
            print(f"program {len(seen)}: {size} input words, {num_steps} step(s): trace {t1 - t0:.2f} s, "
                  f"lower {t2 - t1:.2f} s", flush=True)
        return launch(step_input, layout, stochastic, num_steps, whole_prompts)

    runner._launch = timed_launch
    rng = np.random.default_rng(0)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for _ in range(8):
        eng.add_request([int(t) for t in rng.integers(0, cfg.vocab_size, 64)], sp)
    eng.run_until_done()
    print(f"total: trace {totals[0]:.2f} s, lower {totals[1]:.2f} s over {len(seen)} programs")
    return [{"model": model, "K": k, "programs": len(seen), "trace_s": totals[0], "lower_s": totals[1]}]


def pallas_sites(n: int) -> list:
    import jax
    import jax.numpy as jnp

    from pallas_kernels.gdn_pallas import gdn_chunked_pallas

    def sds(*shape, dtype=jnp.float32):
        return jax.ShapeDtypeStruct(shape, dtype)

    def chain(call):
        def program(q, k, v, g, beta, s):
            out = 0
            for _ in range(n):
                o, s = call(q, k, v, g, beta, s)
                out = out + o
            return out, s
        return program

    small = (sds(1, 64, 2, 32, dtype=jnp.bfloat16),) * 3 + (sds(1, 64, 2), sds(1, 64, 2), sds(1, 2, 32, 32))
    kernel = lambda *a: gdn_chunked_pallas(*a, interpret=False)  # noqa: E731
    jax.jit(kernel).trace(*small).lower(lowering_platforms=("cuda",))  # imports and first-use costs
    args = (sds(8, 64, 16, 128, dtype=jnp.bfloat16),) * 3 + (sds(8, 64, 16), sds(8, 64, 16), sds(8, 16, 128, 128))
    rows = []
    for name, call in (("inline", kernel), ("nested jit", jax.jit(kernel))):
        t0 = time.perf_counter()
        traced = jax.jit(chain(call)).trace(*args)
        t1 = time.perf_counter()
        traced.lower(lowering_platforms=("cuda",))
        t2 = time.perf_counter()
        print(f"{n} chunked GDN calls, {name}: trace {t1 - t0:.2f} s, lower {t2 - t1:.2f} s", flush=True)
        rows.append({"pallas_sites": n, "form": name, "trace_s": t1 - t0, "lower_s": t2 - t1})
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3.5-0.8b")
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--pallas-sites", type=int, default=None, metavar="N")
    ap.add_argument("--out", default=None, help="write the rows and the environment as JSON")
    args = ap.parse_args()
    rows = pallas_sites(args.pallas_sites) if args.pallas_sites else main(args.model, args.k)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"benchmark": "step-trace-time-probe", "rows": rows, "env": environment()}, f, indent=1)
