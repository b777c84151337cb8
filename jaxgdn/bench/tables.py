"""`bench table`: the README's performance tables, printed from the committed result JSON (never typed)."""

from __future__ import annotations

import json
from pathlib import Path

from ..results import RESULTS_DIR


def _fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def _times(x):
    """A ratio as "2.05x" ("-" when absent)."""
    return "-" if x is None else f"{x:.2f}x"


def _source(d: dict, path: Path) -> str:
    e = d["env"]
    versions = ", ".join(f"{k} {e[k]}" for k in ("jax", "triton", "torch", "fla", "transformers") if e.get(k))
    partial = "" if d.get("complete", True) else ", incomplete run"
    return f"{e['device']} ({versions}), {e['date'][:10]}, `{path.relative_to(path.parents[2])}`{partial}"


def _table(headers: list[str], rows: list[dict], cells) -> list[str]:
    """Markdown lines: one header row, then cells(row) -> list of strings for each row."""
    return ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)] + [
        "| " + " | ".join(cells(r)) + " |" for r in rows]


KERNEL_KIND = {"prefill": "chunked prefill", "decode": "decode", "verify": "verify (checkpoint per position)"}


def floor_bytes_ratio(r: dict) -> float:
    """Bytes our kernel must move over those fla's must, from a kernels row's shape: 1 but for verify
    windows, where ours also writes an fp32 checkpoint per position (the engine's rollback by selection)."""
    from .kernels import kernel_bytes

    shape = r["B"], r["T"], r["H"], r["d"]
    return kernel_bytes(*shape, checkpoints=r["kind"] == "verify") / kernel_bytes(*shape)


def kernels_table(d: dict) -> list[str]:
    headers = ["kernel", "B", "T", "ours ms", "fla ms", "ours / fla", "roofline ms", "floor bytes ours / fla",
               "rel. err vs fla"]
    # rows with device kernel times (no launch path) get their columns: ours / fla of the kernels
    device = any("ours_device_us" in r for r in d["rows"])
    if device:
        headers[6:6] = ["ours kernels µs", "fla kernels µs", "kernels ours / fla"]

    def cells(r):
        out = [KERNEL_KIND[r["kind"]], str(r["B"]), str(r["T"]), _fmt(r["ours_ms"]), _fmt(r.get("fla_ms")),
               _fmt(r.get("ratio_ours_over_fla"), ".2f"), _fmt(r["roofline_ms"]), _fmt(floor_bytes_ratio(r), ".2f"),
               _fmt(r.get("ours_vs_fla_rel_err"), ".1e")]
        if device:
            out[6:6] = [_fmt(r.get("ours_device_us"), ".1f"), _fmt(r.get("fla_device_us"), ".1f"),
                        _fmt(r.get("device_ratio_ours_over_fla"), ".2f")]
        return out

    return _table(headers, d["rows"], cells)


def decode_table(d: dict) -> list[str]:
    return _table(["batch", "scheduling", "steps/launch", "ms/step", "device ms/step", "tokens/s", "roofline ms",
                   "transformers ms/step", "speed-up"],
                  d["rows"],
                  lambda r: [str(r["batch"]), {True: "async", False: "sync"}.get(r.get("async_scheduling"), "sync"),
                             str(r.get("decode_steps_per_launch", 1)),
                             _fmt(r["ms_per_step"]), _fmt(r.get("device_ms_per_step")),
                             f"{r['tokens_per_s']:.0f}", _fmt(r["roofline_ms"]),
                             _fmt(r.get("transformers_ms_per_step"), ".2f"), _fmt(r.get("speedup_vs_transformers"), ".1f")])


def prefill_table(d: dict) -> list[str]:
    columns = ["shape", "ms", "device ms", "tokens/s", "FLOP floor ms", "over floor", "stream ms/step",
               "stream over floor", "transformers ms", "speed-up"]
    return _table(columns, d["rows"],
                  lambda r: [f"{r['batch']}x{r['length']}", f"{r['ms']:.2f}", _fmt(r.get("device_ms"), ".2f"),
                             f"{r['tokens_per_s']:.0f}",
                             f"{r['flop_floor_ms']:.2f}", f"{r['over_floor']:.1f}x",
                             _fmt(r.get("stream_ms_per_step"), ".2f"), _times(r.get("stream_over_floor")),
                             _fmt(r.get("transformers_ms"), ".1f"), _fmt(r.get("speedup_vs_transformers"), ".1f")])


def spec_table(d: dict) -> list[str]:
    lines = _table(["K", "tokens/s (shipped model)", "mean acceptance length"], d["rows_shipped"],
                   lambda r: [str(r["K"]), f"{r['tokens_per_s']:.0f}", _fmt(r.get("mean_acceptance_length"), ".2f")])
    modeled = d.get("rows_modeled") or []
    if not modeled:
        return lines
    rates = d.get("modeled_acceptance", [])
    columns = ["K", "batch", "scheduling", "steps/launch", "ms/step", "device ms/step"] + [
        f"speed-up at p={p}" for p in rates]
    scheduling = {True: "async", False: "sync", None: "-"}
    return lines + [""] + _table(columns, modeled, lambda r: [
        str(r["K"]), str(r["batch"]), scheduling[r.get("async_scheduling")], _fmt(r.get("steps_per_launch"), "d"),
        f"{r['ms_per_step']:.3f}",
        _fmt(r.get("device_ms_per_step"), ".3f")] + [_fmt(r.get(f"speedup_vs_no_mtp_at_p{p}"), ".2f") for p in rates])


def pd_table(d: dict) -> list[str]:
    return _table(["prompt", "placement", "handoff MB", "to_bytes ms", "from_bytes ms", "device move ms"], d["rows"],
                  lambda r: [str(r["prompt_len"]), r["placement"], f"{r['handoff_bytes'] / 1e6:.2f}",
                             f"{r['to_bytes_ms']:.2f}", f"{r['from_bytes_ms']:.2f}", f"{r['device_move_ms']:.3f}"])


def serve_table(d: dict) -> list[str]:
    c = d["cold_process"]
    runs = [("cold", c["cold"]), ("warm", c["warm"])]
    lines = _table(["run", "wall s", "total tok/s", "output tok/s", "TTFT p50 / p99 ms", "TPOT p50 / p99 ms",
                    "ITL p50 / p99 ms"], runs, lambda r: [
        r[0], f"{r[1]['wall_s']:.2f}", f"{r[1]['total_tokens_per_s']:.0f}", f"{r[1]['output_tokens_per_s']:.0f}",
        *(f"{r[1][k]['p50']:.1f} / {r[1][k]['p99']:.1f}" for k in ("ttft_ms", "tpot_ms", "itl_ms"))])
    return lines + ["", f"Start-up {c['startup_s']:.1f} s with an empty compilation cache, "
                        f"{d['warm_cache_startup']['startup_s']:.1f} s with it filled; {c['programs']} step programs; "
                        f"{c['compiles_after_startup']} compiled after start-up; the bound {c['bound']['total_s']:.2f} s "
                        f"({c['warm']['fraction_of_bound']:.0%} of it reached warm)."]


TABLES = {"kernels": kernels_table, "decode": decode_table, "prefill": prefill_table, "spec": spec_table, "pd": pd_table,
          "serve": serve_table}


def newest_results(directory: Path = RESULTS_DIR) -> list[Path]:
    """The newest GPU result file of each benchmark with a table."""
    newest: dict[str, Path] = {}
    for path in sorted(directory.glob("*_gpu_*.json")):
        name = path.name.split("_gpu_")[0]
        if name in TABLES:
            newest[name] = path  # sorted by date stamp: later wins
    return [newest[n] for n in TABLES if n in newest]


def print_tables(files) -> int:
    paths = [Path(f) for f in files] or newest_results()
    if not paths:
        print("no GPU result files in bench/results")
        return 1
    for path in paths:
        d = json.loads(path.read_text())
        print(f"**{d['benchmark']}** — {_source(d, path.resolve())}\n")
        if d.get("note"):
            print(f"Note (from the JSON): {d['note']}\n")
        print("\n".join(TABLES[d["benchmark"]](d)) + "\n")
    return 0
