"""Probe: where a 0.8B decode step's device time goes, kernel by kernel, each kernel named by the model code
that made it. The decode target at batch 1 (0.6 ms a step against ~0.9) needs fewer kernels per layer;
this is the inventory to plan that from.

    python bench/probes/decode_kernels.py OUT.json [BATCH ...]   # on the H200 (PYTHONPATH=.); default 1 64
    python bench/probes/decode_kernels.py --rejoin OUT.json      # annotate again from the saved compiled steps

For each batch: the engine on the 0.8B config (random bf16 weights, 64-token prompts) runs until its
launches are plain decode launches (4 steps each on a GPU), the last launch is replayed under the profiler,
and each kernel of the trace is joined with the instruction of the compiled step (optimized HLO) it ran:
its JAX op name and source line. Rows: kernel, µs and launches per model step, op name, source, the
innermost frames of its call stack; then the same time summed by source line. On CPU it runs the shipped
tiny model, as a check that the join works.
"""

import collections
import gzip
import json
import re
import shutil
import sys
import tempfile

import jax
import jax.numpy as jnp

from jaxgdn.bench.common import environment, load_trace
from jaxgdn.bench.steps import load_model, make_engine
from jaxgdn.engine.request import SamplingParams
from pallas_kernels.common import on_gpu

# name = ... metadata={op_name="..." source_file="..." source_line=N ...}: one instruction of the HLO text
INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{([^}]*)\}', re.M)
FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')


def _kernel_name(name: str) -> str:
    """An HLO instruction name as XLA names its kernel ('.' and '-' as '_')."""
    return re.sub(r"[.\-]", "_", name)


def _table(hlo_text: str, title: str) -> dict[int, str]:
    """id -> rest of line of one of the module's trailing tables (FileNames, StackFrames, ...)."""
    m = re.search(rf"^{title}\n((?:\d+ .*\n)*)", hlo_text, re.M)
    return {int(line.split(" ", 1)[0]): line.split(" ", 1)[1] for line in m.group(1).splitlines()} if m else {}


def _frames(hlo_text: str):
    """stack_frame_id -> the call stack, innermost first, as 'file.py:line function' strings."""
    files = {i: v.strip('"').rsplit("/", 1)[-1] for i, v in _table(hlo_text, "FileNames").items()}
    funcs = {i: v.strip('"') for i, v in _table(hlo_text, "FunctionNames").items()}
    ints = lambda text: {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", text)}  # noqa: E731
    locs = {i: ints(v) for i, v in _table(hlo_text, "FileLocations").items()}
    frames = {i: ints(v) for i, v in _table(hlo_text, "StackFrames").items()}

    def stack(frame_id: int) -> list[str]:
        out = []
        while frame_id in frames and len(out) < 8:
            loc = locs.get(frames[frame_id]["file_location_id"], {})
            out.append(f"{files.get(loc.get('file_name_id'), '?')}:{loc.get('line', '?')} "
                       f"{funcs.get(loc.get('function_name_id'), '?')}")
            parent = frames[frame_id].get("parent_frame_id", frame_id)
            frame_id = parent if parent != frame_id else -1
        return out

    return stack


COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
CALLS = re.compile(r"(?:calls|to_apply)=%?([\w.\-]+)")


def hlo_sources(hlo_text: str) -> dict[str, dict]:
    """Kernel-style name ('.' and '-' as '_') -> {op_name, source, stack} of each instruction: its own
    metadata, or for a fusion without any (XLA's GPU fusions) that of its fused computation's root (else
    its last instruction that has some). source: the innermost frame of the stack, or source_file:line."""
    stack_of = _frames(hlo_text)

    def describe(meta: str) -> dict:
        fields = {k: v.strip('"') for k, v in FIELD.findall(meta)}
        stack = stack_of(int(fields["stack_frame_id"])) if "stack_frame_id" in fields else []
        source = stack[0] if stack else f"{fields.get('source_file', '?').rsplit('/', 1)[-1]}:{fields.get('source_line', '?')}"
        return {"op_name": fields.get("op_name", ""), "source": source, "stack": stack[:4]}

    own, calls, comp_meta, comp_root = {}, {}, {}, {}
    current = None
    for line in hlo_text.splitlines():
        head = COMPUTATION.match(line)
        if head and "=" not in line.split("(", 1)[0]:
            current = head.group(1)
            continue
        m = INSTRUCTION.match(line)
        name = re.match(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=", line)
        if not name:
            continue
        callee = CALLS.search(line)
        if callee:
            calls[name.group(1)] = callee.group(1)
        if m:
            own[name.group(1)] = m.group(2)
            if current is not None:
                comp_meta[current] = m.group(2)  # the last one with metadata
                if line.lstrip().startswith("ROOT"):
                    comp_root[current] = m.group(2)
    out = {}
    for name in set(own) | set(calls):
        meta = own.get(name) or comp_root.get(calls.get(name)) or comp_meta.get(calls.get(name))
        if meta:
            out[_kernel_name(name)] = describe(meta)
    return out


def kernel_table(trace_dir: str, per: int, sources: dict) -> tuple[list, list]:
    """(rows by kernel, rows by source line) of a trace: µs and launches per `per` (model steps)."""
    events, names, _ = load_trace(trace_dir)
    gpu = {pid for pid, n in names.items() if "GPU" in n or "/device:" in n} or set(names)
    us, count, hlo = collections.Counter(), collections.Counter(), {}
    for e in events:
        if e.get("pid") in gpu and not e["name"].startswith("$"):  # "$file:line fn": Python frames (CPU runs)
            us[e["name"]] += e.get("dur", 0)
            count[e["name"]] += 1
            op = (e.get("args") or {}).get("hlo_op")
            if op:
                hlo[e["name"]] = _kernel_name(op)
    rows = [[name, round(total / per, 2), round(count[name] / per, 2)] for name, total in us.most_common()]
    return annotate(rows, sources, hlo)


def annotate(rows: list, sources: dict, hlo_ops: dict | None = None) -> tuple[list, list]:
    """Rows [kernel, µs, launches, ...] with op name, source and stack appended: looked up by the trace's
    hlo_op of the kernel (where it names an instruction: under CUDA graphs it can name the graph's thunk)
    and else by the kernel's own name (XLA names a fusion's kernel after it, '.' as '_'; identical fusions
    share one kernel, named after the first). Also the time summed by source line."""
    out, by_source = [], collections.Counter()
    for name, us, launches, *_ in rows:
        keys = [k for k in ((hlo_ops or {}).get(name), _kernel_name(name)) if k]
        src = next((sources[k] for k in keys if k in sources), {})
        out.append([name, us, launches, src.get("op_name", ""), src.get("source", ""), src.get("stack", [])])
        by_source[src.get("source", "?")] += us
    return out, [[s, round(t, 2)] for s, t in by_source.most_common()]


def rejoin(out_path: str) -> None:
    """Annotate a result file's kernels again from the compiled steps saved beside it (OUT.json.hlo-bN.txt.gz)."""
    with open(out_path) as f:
        result = json.load(f)
    for batch, row in result["rows"].items():
        with gzip.open(f"{out_path}.hlo-b{batch}.txt.gz", "rt") as f:
            sources = hlo_sources(f.read())
        row["kernels"], by_source = annotate(row["kernels"], sources)
        row["by_source"] = by_source[:60]
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


def main(out_path=None, batches=(1, 64)):
    gpu = on_gpu()
    params, cfg = load_model("qwen3.5-0.8b" if gpu else "checkpoints/qwen35-tiny-arith")
    result = {"benchmark": "decode-kernels-probe", "rows": {}, "env": environment()}
    for batch in batches:
        eng = make_engine(params, cfg, batch=batch, max_model_len=160, max_batched=max(256, batch * 64))
        for i in range(batch):
            eng.add_request([(7 * i + j) % cfg.vocab_size for j in range(64)],
                            SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
        for _ in range(6):  # prompts, then decode launches
            eng.step()
        runner = eng.runner
        host_buf, layout, stochastic, num_steps, whole = runner.last_device_args
        compiled = runner.program(layout).lower(runner.params, runner.state,
                                                jnp.zeros(host_buf.shape[0] + 1, jnp.int32), host_buf, layout,
                                                stochastic, num_steps, whole).compile()
        hlo_text = compiled.as_text()
        sources = hlo_sources(hlo_text)
        if out_path:  # the compiled step itself, to join other traces against later
            with gzip.open(f"{out_path}.hlo-b{batch}.txt.gz", "wt") as f:
                f.write(hlo_text)
        trace_dir = tempfile.mkdtemp()
        iters = 5
        try:
            with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
                runner.time_device_step(iters=iters)  # + 2 warm-up launches, traced too
            kernels, by_source = kernel_table(trace_dir, (iters + 2) * num_steps, sources)
        finally:
            shutil.rmtree(trace_dir, ignore_errors=True)
        result["rows"][str(batch)] = {"steps_per_launch": num_steps, "kernels_per_step": round(
            sum(k[2] for k in kernels), 1), "busy_us_per_step": round(sum(k[1] for k in kernels), 1),
            "kernels": kernels[:120], "by_source": by_source[:60]}
        print(f"batch {batch}: {result['rows'][str(batch)]['kernels_per_step']} kernels, "
              f"{result['rows'][str(batch)]['busy_us_per_step']} us busy per step", flush=True)
        for row in kernels[:25]:
            print("  ", row[:5], flush=True)
        if out_path:
            with open(out_path, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rejoin"]:
        rejoin(sys.argv[2])
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else None, tuple(int(b) for b in sys.argv[2:]) or (1, 64))
