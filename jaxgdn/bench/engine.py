"""`bench engine`: steps/s, tokens/s and compiled-shape count of the engine on a tiny random model."""

from __future__ import annotations

import time


def bench_engine(args) -> dict:
    import numpy as np

    from ..engine.config import EngineConfig
    from ..engine.llm_engine import LLMEngine
    from ..engine.request import SamplingParams
    from ..model.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig
    from ..model.params import init_random_params

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
            "compiled_shapes": eng.runner.num_compiles,
        })
        print(f"concurrency {concurrency:4d}: {steps / dt:8.1f} steps/s  {concurrency * args.max_tokens / dt:9.1f} tok/s  "
              f"compiled shapes {eng.runner.num_compiles}  cold run {first:.2f}s")
    return {"benchmark": "engine", "model": "tiny random (hidden 64, 4 layers L,L,L,F)",
            "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "enforce_eager": args.enforce_eager,
            "rows": rows}
