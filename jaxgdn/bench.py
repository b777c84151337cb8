"""`python -m jaxgdn.bench SUBCOMMAND`: benchmarks that print a table and write JSON to bench/results/.

Sub-commands:
  engine   steps/s, tokens/s and compiled-shape count of the engine on a tiny random model (CPU-friendly),
           so later changes can see regressions in step overhead and bucketing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent.parent / "bench" / "results"


def environment() -> dict:
    """Device, versions and date for every result file."""
    import jax
    import jaxlib

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(jax.devices()[0].device_kind),
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    for name in ("torch", "transformers", "triton", "fla"):
        try:
            env[name] = __import__(name).__version__
        except Exception:
            env[name] = None
    return env


def write_result(name: str, payload: dict, path: Path | None = None) -> Path:
    """Write payload as JSON to path, default bench/results/<name>_<backend>_<date>.json."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d")
    path = path or RESULTS_DIR / f"{name}_{payload['env']['backend']}_{stamp}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def bench_engine(args) -> dict:
    import numpy as np

    from .config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig
    from .engine import LLMEngine
    from .engine_config import EngineConfig
    from .params import init_random_params
    from .request import SamplingParams

    L, F = LINEAR_ATTENTION, FULL_ATTENTION
    cfg = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                      linear_key_head_dim=16, linear_value_head_dim=24, linear_conv_kernel_dim=4,
                      layer_types=(L, L, L, F), eos_token_ids=())
    params = init_random_params(cfg, seed=0)
    rows = []
    for concurrency in args.concurrency:
        ecfg = EngineConfig(max_num_seqs=concurrency, max_num_batched_tokens=256, max_model_len=256,
                            kv_page_size=16, dtype="float32", enforce_eager=args.enforce_eager)
        eng = LLMEngine(params, cfg, ecfg)
        rng = np.random.default_rng(0)
        sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        prompts = [[int(t) for t in rng.integers(0, 256, args.prompt_len)] for _ in range(concurrency)]

        def workload():
            for p in prompts:
                eng.add_request(p, sp)
            t0, steps = time.perf_counter(), 0
            while eng.has_unfinished:
                eng.step()
                steps += 1
            return steps, time.perf_counter() - t0

        _, first = workload()  # compiles every bucket the workload touches
        steps, dt = workload()  # the measured run
        rows.append({
            "concurrency": concurrency, "steps": steps, "steps_per_s": steps / dt,
            "generated_tokens_per_s": concurrency * args.max_tokens / dt, "cold_run_s_incl_compile": first, "warm_run_s": dt,
            "compiled_shapes": eng.runner.num_compiled_shapes,
        })
        print(f"concurrency {concurrency:4d}: {steps / dt:8.1f} steps/s  {concurrency * args.max_tokens / dt:9.1f} tok/s  "
              f"compiled shapes {eng.runner.num_compiled_shapes}  cold run {first:.2f}s")
    return {"benchmark": "engine", "model": "tiny random (hidden 64, 4 layers L,L,L,F)",
            "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "enforce_eager": args.enforce_eager,
            "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxgdn.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    e = sub.add_parser("engine", help="engine steps/s and compile count on a tiny random model")
    e.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    e.add_argument("--prompt-len", type=int, default=32)
    e.add_argument("--max-tokens", type=int, default=64)
    e.add_argument("--enforce-eager", action="store_true")
    e.add_argument("--no-save", action="store_true", help="print only, write no JSON")
    args = ap.parse_args(argv)
    payload = {"benchmark": args.command}
    if args.command == "engine":
        payload = bench_engine(args)
    payload["env"] = environment()
    if not args.no_save:
        print(f"wrote {write_result(args.command, payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
