"""Probe: is an MTP verify step one CUDA graph? Counts the while/conditional ops left in the compiled step
(XLA runs those outside its command buffers, from the host) and times the device replay, for the shipped
model at K = 0, 1, 3 and 1 or 4 steps per launch.

    python bench/probes/verify_program.py OUT.json
"""

import json
import re
import sys
import time

import jax
import jax.numpy as jnp

from jaxgdn.bench.common import environment
from jaxgdn.bench.serving import task_prompts
from jaxgdn.bench.steps import load_model, make_engine
from jaxgdn.engine.request import SamplingParams

MODEL = "checkpoints/qwen35-tiny-arith"


def main(out_path: str) -> None:
    params, cfg = load_model(MODEL, include_mtp=True)
    prompts = task_prompts(MODEL, 32)
    rows = []
    for K, steps in ((0, 4), (1, 1), (1, 4), (3, 4)):
        eng = make_engine(params, cfg, batch=32, max_model_len=400, max_batched=4096, K=K,
                          decode_steps_per_launch=steps)
        for p in prompts:
            eng.add_request(p, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        for _ in range(6):
            eng.step()
        r = eng.runner
        host_buf, layout, stochastic, num_steps, whole = r.last_device_args
        t0 = time.perf_counter()
        lowered = r.program(layout).lower(r.params, r.state, jnp.zeros(host_buf.shape[0] + 1, jnp.int32), host_buf,
                                          layout, stochastic, num_steps, whole)
        hlo = lowered.compile().as_text()
        row = {"K": K, "steps_per_launch": num_steps, "while": len(re.findall(r"\bwhile\(", hlo)),
               "conditional": len(re.findall(r"\bconditional\(", hlo)),
               "while_ops": sorted({m for m in re.findall(r'op_name="([^"]*while[^"]*)"', hlo)})[:8],
               "compile_s": time.perf_counter() - t0, "device_ms_per_step": r.time_device_step()}
        rows.append(row)
        print(row, flush=True)
    json.dump({"probe": "verify_program", "model": MODEL, "rows": rows, "env": environment()}, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
