"""`bench startup`: the time from a fresh process to a finished workload, with an empty persistent
compilation cache (cold) and again with the cache the first run filled (warm).

Each run is a new Python process (`python -m jaxgdn.bench startup --child`), so nothing compiled stays in
memory between them; the only difference is `$JAXGDN_CACHE_DIR`. The workload touches the buckets a small
serving session does: prefill of `--requests` prompts, then decode (with MTP when `--k` > 0).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np


def child_run(args) -> dict:
    """One run in this process: load the model, serve the workload; seconds per phase."""
    t0 = time.perf_counter()
    from ..request import SamplingParams
    from .model import add_random_prompts, load_model, make_engine

    params, cfg = load_model(args.model, include_mtp=args.k > 0)
    eng = make_engine(params, cfg, batch=args.requests, max_model_len=args.prompt_len + args.max_tokens + 8,
                  max_batched=args.requests * args.prompt_len, K=args.k)
    t_ready = time.perf_counter()
    rng = np.random.default_rng(0)
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    add_random_prompts(eng, rng, args.requests, args.prompt_len, sp)
    eng.run_until_done()
    t_done = time.perf_counter()
    return {"load_s": t_ready - t0, "workload_s": t_done - t_ready, "total_s": t_done - t0,
            "compiled_shapes": eng.runner.num_compiles}


def bench_startup(args) -> dict:
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="jaxgdn-cache-")
    os.makedirs(cache_dir, exist_ok=True)
    if os.listdir(cache_dir):
        raise SystemExit(f"--cache-dir {cache_dir} is not empty: the cold run needs an empty cache")
    cmd = [sys.executable, "-m", "jaxgdn.bench", "startup", "--child", "--model", args.model,
           "--requests", str(args.requests), "--prompt-len", str(args.prompt_len),
           "--max-tokens", str(args.max_tokens), "--k", str(args.k)]
    env = {**os.environ, "JAXGDN_CACHE_DIR": cache_dir}
    rows = []
    for label in ("cold", "warm"):
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(f"startup {label} run failed:\n{out.stderr[-3000:]}")
        row = {"run": label, **json.loads(out.stdout.strip().splitlines()[-1])}
        rows.append(row)
        print(f"startup {label}: load {row['load_s']:.1f} s  workload {row['workload_s']:.1f} s  "
              f"total {row['total_s']:.1f} s  ({row['compiled_shapes']} compiled shapes)", flush=True)
        args.save_partial({"benchmark": "startup", "rows": rows})
    files = sum(len(f) for _, _, f in os.walk(cache_dir))
    return {"benchmark": "startup", "model": args.model, "requests": args.requests, "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens, "K": args.k, "cache_files": files, "rows": rows}
