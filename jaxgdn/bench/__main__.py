"""`python -m jaxgdn.bench SUBCOMMAND`: benchmarks that print a table and write JSON to bench/results/.

Sub-commands:
  engine   steps/s, tokens/s and compiled-shape count of the engine on a tiny random model (CPU-friendly)
  kernels  our Pallas GDN kernels vs fla's Triton kernels and the roofline (GPU; fla optional)
  decode   engine decode steps on the 0.8B config vs the bandwidth roofline and transformers
  prefill  engine prefill steps on the 0.8B config vs the FLOP floor and transformers
  spec     MTP K=0..3: real acceptance on the shipped model; measured step cost x modeled acceptance on 0.8B
  pd       PD handoff bytes, serialisation and device-move time per request (one and two devices)
  serve    the serving benchmark: a seeded workload (random, sharegpt-like, the shipped task) all at once or
           at a request rate; start-up, cold and warm wall time, tokens/s, TTFT/TPOT/ITL, the bound, transformers
  soak     hours of mixed HTTP traffic against real server processes (or a PD pair): nothing leaks, nothing fails
  comm     the collectives of a tensor-parallel decode step, counted in its lowered program (CPU is enough)
  table    print the README's markdown tables from bench/results/*.json
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..engine_args import add_engine_flags
from ..results import environment, write_result
from .common import DEFAULT_TRITON_CACHE_DIR

DEFAULT_MODEL = Path(__file__).resolve().parent.parent.parent / "checkpoints" / "qwen35-tiny-arith"


def _shape(text: str) -> tuple[int, int]:
    """'BxT' -> (B, T)."""
    try:
        b, t = text.lower().split("x")
        return int(b), int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BxT like 8x2048, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jaxgdn.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--no-save", action="store_true", help="print only, write no JSON")
    common.add_argument("--out", default=None, help="JSON path (default bench/results/<command>_<backend>_<date>.json)")
    sub = ap.add_subparsers(dest="command", required=True)
    add = lambda name, help: sub.add_parser(name, help=help, parents=[common])  # noqa: E731
    e = add("engine", "engine steps/s and compile count on a tiny random model")
    e.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    e.add_argument("--prompt-len", type=int, default=32)
    e.add_argument("--max-tokens", type=int, default=64)
    add_engine_flags(e, ["enforce_eager"])
    k = add("kernels", "GDN prefill and decode/verify kernels vs fla and the roofline")
    k.add_argument("--heads", type=int, default=16)
    k.add_argument("--head-dim", type=int, default=128)
    k.add_argument("--prefill-shapes", type=_shape, nargs="*", default=None, help="BxT list (default 1x4096 1x16384 8x2048)")
    k.add_argument("--bandwidth-bytes", type=int, default=1 << 30, help="array size of the bandwidth probe")
    k.add_argument("--decode-shapes", type=_shape, nargs="*", default=None, help="BxT list, T = 1+K (default 1x1 64x1 64x2 64x3 64x4)")
    for name, help in (("decode", "engine decode ms/step and tok/s vs roofline and transformers"),
                       ("prefill", "engine prefill time vs the FLOP floor and transformers")):
        m = add(name, help)
        m.add_argument("--model", default="qwen3.5-0.8b", help="preset (random weights) or checkpoint directory")
        m.add_argument("--no-peer", action="store_true", help="skip transformers")
        add_engine_flags(m, ["gdn_impl", "attention_impl", "fold_norms"])
        m.add_argument("--profile", default=None, metavar="DIR",
                       help="also trace steps per shape into DIR (decode: real engine steps and replayed device "
                            "steps; prefill: replayed steps) and put their top kernels and host events in the JSON")
        if name == "decode":
            m.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64, 128])
            m.add_argument("--peer-batch", type=int, nargs="+", default=[1, 32], help="batches timed on transformers")
            m.add_argument("--prompt-len", type=int, default=64)
            m.add_argument("--steps", type=int, default=32, help="decode steps per request after the warm-up (the timed calls), "
                                                                    "rounded up to whole launches")
            m.add_argument("--peer-steps", type=int, default=16)
            m.add_argument("--bandwidth-bytes", type=int, default=1 << 30, help="array size of the bandwidth probe")
            # ms/step divides the timed calls by the tokens per row they produced
            add_engine_flags(m, ["tensor_parallel_size", "async_scheduling", "decode_steps_per_launch",
                                 "fused_decode_kernels"])
        else:
            m.add_argument("--shapes", type=_shape, nargs="+", default=[(1, 2048), (1, 8192), (8, 1024)])
            m.add_argument("--matmul-size", type=int, default=8192, help="n of the n^3 matmul-rate probe")
            add_engine_flags(m, ["library_gemms_min_tokens"])
            m.add_argument("--stream-steps", type=int, default=8, metavar="N",
                           help="also time a stream of N steps of each shape back to back with async scheduling "
                                "(a prefill worker's throughput; 0: skip)")
    sp = add("spec", "MTP speculative decoding: acceptance, tokens/s, where it pays")
    sp.add_argument("--shipped-model", default=str(DEFAULT_MODEL), help="checkpoint with an MTP head and tokenizer")
    sp.add_argument("--num-prompts", type=int, default=32)
    sp.add_argument("--max-tokens", type=int, default=48)
    sp.add_argument("--k", type=int, nargs="+", default=[0, 1, 2, 3])
    sp.add_argument("--model", default="qwen3.5-0.8b", help="preset for the modeled rows ('' to skip)")
    sp.add_argument("--batch", type=int, default=32)
    sp.add_argument("--prompt-len", type=int, default=64)
    sp.add_argument("--steps", type=int, default=16)
    sp.add_argument("--acceptance", type=float, nargs="+", default=[0.5, 0.7, 0.9])
    add_engine_flags(sp, ["decode_steps_per_launch", "async_scheduling"])  # of the modeled rows; every row's
    pd = add("pd", "PD handoff size and cost per request")
    pd.add_argument("--model", default="qwen3.5-0.8b", help="preset (random weights) or checkpoint directory")
    pd.add_argument("--lengths", type=int, nargs="+", default=[128, 1024, 4096])
    sv = add("serve", "the serving benchmark: wall time, tokens/s and latencies of a workload, cold and warm")
    sv.add_argument("--model", default="qwen3.5-0.8b", help="preset (random weights) or checkpoint directory")
    sv.add_argument("--dataset", choices=["random", "sharegpt-like", "task", "prefix", "multiturn"], default="random",
                    help="random: uniform lengths in --input-len / --output-len; sharegpt-like: lognormal lengths "
                         "with ShareGPT's means; task: the shipped task's test prompts (outputs of --output-len's max); "
                         "prefix: a shared system prompt of --prefix-len tokens, then random prompts of --input-len; "
                         "multiturn: --num-prompts conversations of --num-turns turns, each turn the conversation so "
                         "far and a new message of --input-len (prefix and multiturn are served warm with prefix "
                         "caching on and off)")
    sv.add_argument("--prefix-len", type=int, default=1024, help="--dataset prefix: the shared prompt's tokens")
    sv.add_argument("--num-turns", type=int, default=6, help="--dataset multiturn: turns per conversation")
    sv.add_argument("--compare-prefix-caching", action="store_true",
                    help="also serve the warm run with prefix caching off (always for prefix and multiturn)")
    sv.add_argument("--num-prompts", type=int, default=1000)
    sv.add_argument("--input-len", type=int, nargs=2, default=[256, 1024], metavar=("MIN", "MAX"))
    sv.add_argument("--output-len", type=int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"))
    sv.add_argument("--request-rate", type=float, default=0.0,
                    help="requests a second, Poisson arrivals (0: every request at once, the offline mode)")
    sv.add_argument("--max-concurrency", type=int, default=None,
                    help="at most this many requests in flight (a request's latency counts from its admission)")
    sv.add_argument("--seed", type=int, default=0)
    sv.add_argument("--logprobs", type=int, default=None,
                    help="every request asks for the logprobs of its tokens and the top N (the cost of logprobs)")
    sv.add_argument("--json-schema", action="store_true",
                    help="every request's output follows a JSON schema (the cost of structured output; its array "
                         "never closes before max_tokens, so every request runs as long as without it)")
    sv.add_argument("--http", metavar="URL", default=None,
                    help="drive a running OpenAI-compatible server at URL (e.g. http://127.0.0.1:8000) instead of "
                         "an in-process engine; --model names the checkpoint it serves (its vocabulary, tokenizer)")
    sv.add_argument("--http-repeat", type=int, choices=[0, 1], default=1,
                    help="with --http: send the workload a second time (default 1: first and second run)")
    add_engine_flags(sv, ["enable_prefix_caching", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "dtype",
                          "num_speculative_tokens", "gpu_memory_utilization", "decode_steps_per_launch",
                          "library_gemms_min_tokens", "tensor_parallel_size", "pd"])
    sv.add_argument("--matmul-size", type=int, default=8192, help="n of the n^3 matmul-rate probe (the bound)")
    sv.add_argument("--bandwidth-bytes", type=int, default=1 << 30, help="array size of the bandwidth probe")
    sv.add_argument("--no-peer", action="store_true", help="skip transformers")
    sv.add_argument("--child", choices=["workload", "startup"], default=None, help=argparse.SUPPRESS)
    sv.add_argument("--cache-dir", default=None, metavar="DIR",
                    help="run one process on the compilation cache DIR that an earlier run filled (e.g. a server's "
                         "$JAXGDN_CACHE_DIR), instead of an empty one and then a start-up on it")
    so = add("soak", "mixed HTTP traffic for --minutes against `python -m jaxgdn.serve` (or a PD pair): errors, "
                     "leaks, memory growth, identical greedy probes; JSON and a PNG plot")
    so.add_argument("--minutes", type=float, default=30.0, help="minutes of Poisson traffic (default %(default)s)")
    so.add_argument("--model", default=None, help="checkpoint directory (default: the shipped one)")
    so.add_argument("--pd", action="store_true", help="a prefill server and a decode server (--role prefill/decode)")
    so.add_argument("--server-args", default="--max-num-seqs 32 --max-num-batched-tokens 512 --num-kv-pages 1200",
                    help="more `python -m jaxgdn.serve` flags for every server (default: %(default)r, a KV pool the "
                         "prefix cache outgrows; add --num-speculative-tokens 1 for MTP)")
    so.add_argument("--load", type=float, default=0.7, help="arrival rate as a share of the measured capacity")
    so.add_argument("--rate", type=float, default=None,
                    help="requests a second instead of --load times the measured capacity (no capacity probe)")
    so.add_argument("--probe-seconds", type=float, default=60.0,
                    help="length of the closed-loop probe that measures capacity (default %(default)s)")
    so.add_argument("--concurrency", type=int, default=None,
                    help="clients of the capacity probe (default: the servers' --max-num-seqs)")
    so.add_argument("--sample-interval", type=float, default=5.0, help="seconds between /metrics and RSS samples")
    so.add_argument("--request-timeout", type=float, default=600.0, help="the client's timeout per request, s")
    so.add_argument("--start-timeout", type=float, default=1800.0, help="seconds the servers get to start")
    so.add_argument("--seed", type=int, default=0)
    so.add_argument("--no-plot", action="store_true", help="write no PNG beside the JSON")
    c = add("comm", "collectives of a tensor-parallel decode step, from its lowered program (CPU: set "
                    "XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    c.add_argument("--model", nargs="+", default=["qwen3.5-9b", "qwen3.5-27b"], help="presets")
    c.add_argument("--tp", "-tp", type=int, nargs="+", default=[2], help="tensor_parallel_size values")
    c.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    add_engine_flags(c, ["num_speculative_tokens"])
    t = sub.add_parser("table", help="markdown tables from result JSON files")
    t.add_argument("files", nargs="*", help="result files (default: every file in bench/results with a table)")
    t.add_argument("--notes", action="store_true", help="also print each file's note")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "table":
        from .tables import print_tables

        return print_tables(args.files, args.notes)
    if args.command == "serve" and args.child:
        import json

        from .serve import child_run

        print(json.dumps(child_run(args)))
        return 0
    # JAX takes 75% of GPU memory up front by default; torch peers (transformers, fla) run in the same
    # process and need room. Set before JAX initialises its backend; an explicit setting wins.
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")
    os.environ.setdefault("TRITON_CACHE_DIR", DEFAULT_TRITON_CACHE_DIR)  # fla's autotuner needs one
    if args.command == "engine":
        from .engine import bench_engine as run
    elif args.command == "kernels":
        from .kernels import bench_kernels as run
    elif args.command == "decode":
        from .steps import bench_decode as run
    elif args.command == "prefill":
        from .steps import bench_prefill as run
    elif args.command == "spec":
        from .spec_pd import bench_spec as run
    elif args.command == "pd":
        from .spec_pd import bench_pd as run
    elif args.command == "comm":
        from .comm import bench_comm as run
    elif args.command == "serve" and args.http:
        from .serve_http import bench_serve_http as run
    elif args.command == "serve":
        from .serve import bench_serve as run
    elif args.command == "soak":
        from .soak import bench_soak as run
    env = environment(os.environ.get("XLA_FLAGS", ""))
    out = Path(args.out) if args.out else None
    name = "serve-http" if getattr(args, "http", None) else args.command
    if args.command == "soak":
        name = "soak-pd" if args.pd else "soak"

    def save_partial(payload: dict) -> None:
        """Benchmarks call this after every row, so an interrupted run keeps the rows it measured."""
        if not args.no_save:
            write_result(name, {**payload, "complete": False, "env": env}, out)

    args.save_partial = save_partial
    payload = run(args)
    payload["env"] = env
    if not args.no_save:
        path = write_result(name, {**payload, 'complete': True}, out)
        print(f"wrote {path}")
        if args.command == "soak" and not args.no_plot:
            from .soak_plot import plot_soak

            print(f"wrote {plot_soak(payload, path.with_suffix('.png'))}")
    if args.command == "soak" and not payload["passed"]:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
