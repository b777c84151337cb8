"""Probe: one timeline of host runtime events and GPU busy intervals from a jax.profiler perfetto trace.

    PYTHONPATH=. python bench/probes/timeline.py TRACE_DIR [MAX_LINES]     # e.g. bench decode --profile P: P/batch1-engine

GPU kernels closer than 4 us merge into one busy interval (a CUDA graph's launch shows as one line);
host events are the launch/update/transfer calls worth lining up against them, with their thread. Times
are microseconds from the first event. The header gives the GPU's idle time between intervals and the
largest gaps."""

import sys

from jaxgdn.bench.common import gpu_pids, load_trace

HOST_EVENTS = ("PjitFunction", "cuGraphLaunch", "command_buffer::update", "np.asarray", "DevicePutWithSharding",
               "BufferFromHostBuffer", "cuLaunchHostFunc", "copy_to_host_async", "cuStreamSynchronize",
               "cuEventSynchronize", "Thunks::Initialize", "cuGraphExecUpdate", "cuMemcpy", "Memcpy",
               "BlockHostUntilDone", "WaitForEvent", "cuStreamWaitEvent", "TransferLiteral")


def busy_intervals(kernels):
    """kernels: sorted (start, end) -> [[start, end, kernel count, summed kernel time]] merged across < 4 us gaps."""
    merged = []
    for start, end in kernels:
        if merged and start - merged[-1][1] < 4:
            last = merged[-1]
            last[1], last[2], last[3] = max(last[1], end), last[2] + 1, last[3] + end - start
        else:
            merged.append([start, end, 1, end - start])
    return merged


def main(trace_dir: str, max_lines: int = 400) -> None:
    loaded = load_trace(trace_dir)
    if loaded is None:
        raise SystemExit(f"no perfetto trace under {trace_dir}")
    events, processes, threads = loaded
    gpu = gpu_pids(processes)
    t0 = min(e["ts"] for e in events)
    busy = busy_intervals(sorted((e["ts"] - t0, e["ts"] - t0 + e.get("dur", 0)) for e in events if e["pid"] in gpu))
    host = [(e["ts"] - t0, e["ts"] - t0 + e.get("dur", 0), e["name"], threads.get((e["pid"], e["tid"]), e["tid"]))
            for e in events if e["pid"] not in gpu and any(k in e["name"] for k in HOST_EVENTS)]
    lines = [(s, f"GPU  {s:9.0f}-{t:9.0f} ({t - s:7.0f}) {n} kernels, busy {b:.0f}") for s, t, n, b in busy]
    lines += [(s, f"HOST {s:9.0f}-{t:9.0f} ({t - s:7.0f}) {name[:60]} [{str(th)[:30]}]") for s, t, name, th in host]
    gaps = sorted(((busy[i + 1][0] - busy[i][1], busy[i][1]) for i in range(len(busy) - 1)), reverse=True)
    if busy:
        print(f"GPU intervals {len(busy)}, span {busy[-1][1] - busy[0][0]:.0f} us, "
              f"idle between {sum(g for g, _ in gaps):.0f} us")
    else:
        print("no GPU events")
    print("largest GPU gaps (us, at us):", [(round(g), round(at)) for g, at in gaps[:12]])
    for _, line in sorted(lines)[:max_lines]:
        print(line)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 400)
