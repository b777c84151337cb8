"""Probe: which of a prefill step's CUDA graphs (XLA command buffers) are re-recorded between steps, and which
buffers change address, at 1x2048 and 8x1024 on the 0.8B config.

    TF_CPP_VMODULE=command_buffer_thunk=3 python bench/probes/graph_updates.py 2> vlog.txt   # on the H200
    python bench/probes/graph_updates.py --summarize vlog.txt     # the update lines per step

XLA records each command buffer once and re-records it ("Updated command buffer in N μs; num_commands=M") when
an allocation one of its commands uses has moved since (command_buffer_thunk.cc). The bench's profiles put
command_buffer::update at 1.67 ms a step at 1x2048 and 3.3 ms at 1x8192, but 0.21 ms at 8x1024. This prints,
per step, the address of every state leaf, the resident input and the flat result buffer, as "STEP" lines on
stdout and markers on stderr between the VLOG lines.
"""

import sys

import jax
import numpy as np

from jaxgdn.bench.steps import load_model, make_engine
from jaxgdn.engine.request import SamplingParams


def summarize(path: str) -> None:
    """Print, per marked step, the command-buffer records XLA logged (µs, commands)."""
    import re

    for line in open(path):
        if "MARK" in line:
            print(line.split("MARK ")[1].rstrip())
        m = re.search(r"(Updated|Initialized) command buffer.* in (\d+) .*num_commands=(\d+)", line)
        if m:
            print(f"   {m.group(1).lower()} {m.group(2)} us, {m.group(3)} commands")


def main():
    params, cfg = load_model("qwen3.5-0.8b")
    for batch, length in ((1, 2048), (8, 1024)):
        eng = make_engine(params, cfg, batch=batch, max_model_len=length + 8, max_batched=batch * length,
                          async_scheduling=False)
        runner = eng.runner
        launched = []
        launch = runner._launch

        def spy(*a, **k):
            flat = launch(*a, **k)
            launched[:] = [flat]  # hold only the newest, as the engine does
            return flat

        runner._launch = spy
        rng = np.random.default_rng(0)
        sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        previous = None
        for step in range(6):
            for _ in range(batch):
                eng.add_request([int(t) for t in rng.integers(0, cfg.vocab_size, length)], sp)
            print(f"=== MARK {batch}x{length} step {step} begin", file=sys.stderr, flush=True)
            while eng.has_unfinished:
                eng.step()
            print(f"=== MARK {batch}x{length} step {step} end", file=sys.stderr, flush=True)
            leaves = jax.tree_util.tree_leaves(runner.state)
            now = {f"state[{i}]{tuple(x.shape)}": x.unsafe_buffer_pointer() for i, x in enumerate(leaves)}
            now.update({f"resident[{n}]": x.unsafe_buffer_pointer() for n, x in runner._resident_inputs.items()})
            now["flat"] = launched[-1].unsafe_buffer_pointer()
            moved = [k for k in now if previous and previous.get(k) != now[k]]
            print(f"STEP {batch}x{length} {step}: {len(now)} buffers, moved since last step: {moved}", flush=True)
            previous = now


if __name__ == "__main__":
    summarize(sys.argv[2]) if sys.argv[1:2] == ["--summarize"] else main()
