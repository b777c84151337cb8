"""Probe: prefill steps with and without XLA's command buffers (CUDA graphs), in one process.

    python bench/probes/prefill_graphs.py OUT.json [BxT ...]   # on the H200 (PYTHONPATH=.); default 1x8192 8x1024 1x2048 1x512

`runner.GRAPH_MAX_TOKENS` picks, per step, the executable compiled with command buffers (steps of fewer
tokens) or without them. The probe sets it to take every step through one form or the other and times
`engine_prefill_ms` (wall of one synchronous engine step running whole prompts, its host phases, and the
step replayed back to back) for each shape in the order graphs, plain, graphs, plain: both executables
are compiled by the first two runs, and the repeat shows how far a form moves between runs. 0.8B config,
random bf16 weights on the GPU; the shipped tiny model on CPU (a check that the probe runs).
"""

import json
import sys

from jaxgdn import runner
from jaxgdn.bench.common import environment
from jaxgdn.bench.model import engine_prefill_ms, load_model
from pallas_kernels.common import on_gpu

FORMS = {"graphs": 1 << 30, "plain": 1}  # GRAPH_MAX_TOKENS for each form


def main(out_path: str, shapes: list[str]):
    gpu = on_gpu()
    params, cfg = load_model("qwen3.5-0.8b" if gpu else "checkpoints/qwen35-tiny-arith")
    result = {"benchmark": "prefill-graphs-probe", "rows": [], "env": environment(),
              "timing": "engine_prefill_ms: median wall ms of 7 synchronous engine steps (host phases: median ms "
                        "each); device_ms the step replayed back to back"}
    for shape in shapes:
        batch, length = (int(x) for x in shape.split("x"))
        for form in ("graphs", "plain", "graphs", "plain"):
            runner.GRAPH_MAX_TOKENS = FORMS[form]
            ms, split, _ = engine_prefill_ms(params, cfg, batch, length, repeats=7 if gpu else 1)
            row = {"shape": shape, "form": form, "ms": round(ms, 3), **split}
            result["rows"].append(row)
            print(f"{shape:7s} {form:6s} {ms:8.3f} ms  device {split['device_ms']:.3f}  "
                  f"phases {split['host_phase_ms']}", flush=True)
            with open(out_path, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2:] or ["1x8192", "8x1024", "1x2048", "1x512"])
