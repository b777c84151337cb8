"""`bench table`: the README's performance tables, printed from the committed result JSON (never typed)."""

from __future__ import annotations

import json
from pathlib import Path

from ..engine.compile_times import startup_line
from ..results import RESULTS_DIR


def _fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def _yes(x) -> str:
    return "-" if x is None else "yes" if x else "no"


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


KERNEL_KIND = {"prefill": "ragged chunked prefill", "decode": "decode", "verify": "verify (checkpoint per position)"}


def floor_bytes_ratio(r: dict) -> float:
    """Bytes our kernel must move over those fla's must, from a kernels row's shape: verify windows, where ours
    also writes an fp32 checkpoint per position (the engine's rollback by selection), and prefill, where ours
    stores o in fp32 and fla's in bf16."""
    from .kernels import kernel_bytes

    shape = r["B"], r["T"], r["H"], r["d"]
    fla_o_bytes = 2 if r["kind"] == "prefill" else 4
    return kernel_bytes(*shape, checkpoints=r["kind"] == "verify") / kernel_bytes(*shape, o_bytes=fla_o_bytes)


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
    c, e = d["cold_process"], d["engine"]
    shared = f" behind a shared prompt of {d['prefix_len']} tokens" if "prefix_len" in d else ""
    what = f"conversations of {d['num_turns']} turns" if "num_turns" in d else "requests"
    head = (f"{d['num_prompts']} `{d['dataset']}` {what}{shared} ({_arrivals(d)}) on `{d['model']}`, max_num_seqs "
            f"{e['max_num_seqs']}, max_num_batched_tokens {e['max_num_batched_tokens']}, {e['dtype']}, "
            f"K = {e['num_speculative_tokens']}.")
    pd = "PD, " if e.get("pd") else ""
    runs = [(f"{pd}cold (first run of a new process)", c["cold"]), (f"{pd}warm", c["warm"])]
    if "warm_no_prefix_caching" in c:
        runs.append(("warm, prefix caching off", c["warm_no_prefix_caching"]))
    colocated = d.get("colocated_process")
    if colocated:
        runs += [("colocated, cold", colocated["cold"]), ("colocated, warm", colocated["warm"])]
    lines = _table(["run", "wall s", "total tok/s", "output tok/s", "prefix-cache hits", "TTFT p50 / p99 ms",
                    "TPOT p50 / p99 ms", "ITL p50 / p99 ms"], runs, lambda r: [
        r[0], f"{r[1]['wall_s']:.2f}", f"{r[1]['total_tokens_per_s']:.0f}", f"{r[1]['output_tokens_per_s']:.0f}",
        _fmt(r[1].get("prefix_cache_hit_rate"), ".0%"),
        *(f"{_fmt(r[1][k]['p50'], '.1f')} / {_fmt(r[1][k]['p99'], '.1f')}" for k in ("ttft_ms", "tpot_ms", "itl_ms"))])
    peer = d.get("transformers")
    if peer and "wall_s" in peer:
        lines.append(f"| transformers ({peer['form']}) | {peer['wall_s']:.2f} | {peer['total_tokens_per_s']:.0f} | "
                     f"{peer['output_tokens_per_s']:.0f} | - | - | - | - |")
    warm = d.get("warm_cache_startup")  # absent: the one process started on a filled cache (see its note)
    startup = (f"Start-up {c['startup_s']:.1f} s with an empty compilation cache, {warm['startup_s']:.1f} s with it filled"
               if warm else f"Start-up {c['startup_s']:.1f} s on the compilation cache as it was ({d['note']})")
    phases = (("empty cache", c), ("cache filled", warm)) if warm else (("cache filled", c),)
    if colocated:
        hs = c["warm"]["handoffs"]
        copies = "; ".join(f"{k[:-3]} {hs[k]['p50']:.3f} / {hs[k]['p99']:.3f}" for k in hs if k.endswith("_ms"))
        device = ", ".join(f"{r['prompt_len']} tokens {r['p50']:.3f} ms" for r in c.get("handoff_device_ms", []))
        lines += ["", f"PD warm over colocated warm: {d['pd_over_colocated_warm_wall']:.2f}x the wall; "
                      f"{hs['count']} handoffs, {hs['bytes']['p50'] / 1e6:.2f} MB median; host ms per handoff p50 / p99: "
                      f"{copies}; one handoff's copy on the device (synchronised): {device}. Colocated start-up "
                      f"{colocated['startup_s']:.1f} s, {colocated['compiles_after_startup']} compiled after it."]
    return [head, ""] + lines + ["", f"{startup}; `LLM(...)` to the cold "
                                     f"run's last token {c['cold']['from_process_start_s']:.1f} s; {c['programs']} step programs, "
                                     f"{c['compiles_after_startup']} compiled after start-up; the bound "
                                     f"{c['bound']['total_s']:.2f} s ({c['warm']['fraction_of_bound']:.0%} of it reached warm)."] + [
        f"Start-up phases, {name}: {startup_line(r['startup_phases'])}." for name, r in phases if "startup_phases" in r]


def _arrivals(d: dict) -> str:
    rate = "all at once" if not d["request_rate"] else f"{d['request_rate']} requests/s"
    return rate + (f", at most {d['max_concurrency']} in flight" if d.get("max_concurrency") else "")


def serve_http_table(d: dict) -> list[str]:
    """`bench serve --http`: the workload sent twice to a running server."""
    head = f"{d['num_prompts']} `{d['dataset']}` requests ({_arrivals(d)}) over HTTP to {d['url']} (`{d['model']}`)."
    runs = [(name, d[name]) for name in ("first", "second") if name in d]
    return [head, ""] + _table(["run", "wall s", "total tok/s", "output tok/s", "TTFT p50 / p99 ms",
                                "TPOT p50 / p99 ms", "ITL p50 / p99 ms", "errors", "compiles after start-up"], runs,
                               lambda r: [r[0], f"{r[1]['wall_s']:.2f}", f"{r[1]['total_tokens_per_s']:.0f}",
                                          f"{r[1]['output_tokens_per_s']:.0f}",
                                          *(f"{r[1][k]['p50']:.1f} / {r[1][k]['p99']:.1f}"
                                            for k in ("ttft_ms", "tpot_ms", "itl_ms")),
                                          str(r[1]["errors"]), _fmt(r[1]["compiles_after_startup"], ".0f")])


def soak_table(d: dict) -> list[str]:
    """`bench soak`: minutes of mixed HTTP traffic against real servers, and what was left once it stopped."""
    c, r, rss = d["config"], d["requests"], d["rss"]
    mode = "a PD pair" if c["pd"] else "one server"
    load = (f"at {c['load']:.0%} of the measured capacity ({d['capacity_requests_per_s']:.2f} requests/s)"
            if c.get("load") else f"at {d['rate_requests_per_s']:g} requests/s")
    head = f"{c['minutes']:g} minutes of the mix {load} against {mode}, `{c['server_args']}`; PNG beside the JSON."
    growth = "n/a" if rss["growth"] is None else f"{rss['growth']:+.1%} ({rss['base_mb']:.0f} -> {rss['end_mb']:.0f} MB)"
    held = "; ".join(f"{role}: {sum(v.values()):.0f}" for role, v in d["end_state"]["held_by_requests"].items())
    return [head, ""] + _table(
        ["requests", "ok / hung up by the client / errors", "output tok/s", "latency p50 / p99 s",
         "held by requests at the end", "RSS growth after minute 5", "probes identical", "passed"], [d],
        lambda d: [str(r["sent"]), f"{r['ok']} / {r['hung_up']} / {r['errors'] + r['server_errors']}",
                   f"{d['output_tokens_per_s']:.1f}", f"{d['latency_s']['p50']:.2f} / {d['latency_s']['p99']:.2f}",
                   held, growth, _yes(d["verdict"]["probes_identical"]), _yes(d["passed"])])


def eval_table(d: dict) -> list[str]:
    """`python -m jaxgdn.eval --configs ...`: accuracy per serving configuration, with and without the bug."""
    return _table(["configuration", "concurrency", "#47466", "accuracy", "identical to baseline",
                   "mean acceptance length", "acceptance rate", "tokens/s (incl. compile)"], d["results"],
                  lambda r: [r["config"]["name"], str(r["config"]["concurrency"]),
                             "bug" if r["config"]["reproduce_pd_mtp_bug"] else "fixed", f"{r['accuracy']:.3f}",
                             _fmt(r["identical_to_baseline"]), _fmt(r["mean_acceptance_length"], ".2f"),
                             _fmt(r["acceptance_rate"]), f"{r['tokens_per_s']:.0f}"])


def eval_mc_table(d: dict) -> list[str]:
    """`python -m jaxgdn.eval --multiple-choice`: the task's multiple-choice form scored by loglikelihood."""
    return _table(["data", "problems", "dtype", "accuracy (chance 0.25)"], [d],
                  lambda r: [r["data"], str(r["num_problems"]), r["dtype"], f"{r['accuracy']:.3f}"])


def comm_table(d: dict) -> list[str]:
    """`bench comm`: the collectives of one tensor-parallel decode step, from its lowered program."""
    return _table(["preset", "TP", "batch", "sampling", "all-reduces", "all-reduce MB", "all-gathers", "all-gather MB"],
                  d["rows"], lambda r: [r["model"], str(r["tp"]), str(r["batch"]), "sampled" if r["sampled"] else "greedy",
                                        str(r.get("all_reduce_count", 0)), f"{r.get('all_reduce_bytes', 0) / 1e6:.3f}",
                                        str(r.get("all_gather_count", 0)), f"{r.get('all_gather_bytes', 0) / 1e6:.3f}"])


def startup_table(d: dict) -> list[str]:
    """A start-up on an empty compilation cache (its log line) and one on the cache it filled."""
    return [d["note"] + ".", "", f"Empty cache: {d['empty_cache_log']}.", "",
            f"Cache filled: {startup_line(d['cache_filled']['startup_phases'])}."]


TABLES = {"serve": serve_table, "startup": startup_table, "serve-http": serve_http_table, "decode": decode_table, "prefill": prefill_table, "spec": spec_table,
          "kernels": kernels_table, "pd": pd_table, "eval": eval_table, "eval-mc": eval_mc_table,
          "comm": comm_table, "soak": soak_table}


def benchmark_of(d: dict, path: Path) -> str:
    return d.get("benchmark") or path.name.split("_")[0]


def result_files(directory: Path = RESULTS_DIR) -> list[Path]:
    """Every result file with a table, grouped by benchmark in TABLES' order."""
    kind = lambda p: benchmark_of(json.loads(p.read_text()), p)  # noqa: E731
    paths = [p for p in sorted(directory.glob("*.json")) if kind(p) in TABLES]
    return sorted(paths, key=lambda p: list(TABLES).index(kind(p)))


def print_tables(files, notes: bool = False) -> int:
    """Print a markdown table per file (default: every result file in bench/results); notes: each file's note."""
    paths = [Path(f) for f in files] or result_files()
    if not paths:
        print("no result files in bench/results")
        return 1
    if not files:  # the whole set: docs/performance.md
        print("# Performance tables\n\nEvery result file in `bench/results/`, printed by "
              "`python -m jaxgdn.bench table > docs/performance.md`.\n")
    for path in paths:
        d = json.loads(path.read_text())
        print(f"**{benchmark_of(d, path)}** — {_source(d, path.resolve())}\n")
        if notes and d.get("note"):
            print(f"Note (from the JSON): {d['note']}\n")
        print("\n".join(TABLES[benchmark_of(d, path)](d)) + "\n")
    return 0
