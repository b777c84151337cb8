"""`python -m jaxgdn.generate`: generate completions with the jaxgdn engine.

With no arguments it runs the checkpoint shipped in checkpoints/ (the tiny arithmetic model) on a few
test problems with PD disaggregation and MTP speculative decoding on, prints its worked answers against
the reference answers, and the acceptance statistics.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .engine.config import ASYNC_SCHEDULING_CHOICES, LIBRARY_GEMMS_MIN_TOKENS, min_tokens_arg

CHECKPOINTS_DIR = Path(__file__).resolve().parent.parent / "checkpoints"


def default_checkpoint() -> Path | None:
    """The first checkpoint directory shipped in checkpoints/ (one with a config.json), if any."""
    found = sorted(p.parent for p in CHECKPOINTS_DIR.glob("*/config.json"))
    return found[0] if found else None


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m jaxgdn.generate",
        description="Generate completions with jaxgdn (Qwen3.5: Gated DeltaNet + gated attention).",
    )
    ap.add_argument("--model", help="checkpoint directory or preset (qwen3.5-0.8b = random weights); "
                                    "default: the checkpoint shipped in checkpoints/")
    g = ap.add_argument_group("prompts")
    g.add_argument("--prompt", action="append", default=[], help="a text prompt (repeatable)")
    g.add_argument("--prompt-ids", action="append", default=[], help="a token-id prompt, comma-separated (repeatable)")
    g.add_argument("--prompts-file", help="a file with one text prompt per line")
    s = ap.add_argument_group("sampling")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0, help="0 = off")
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens tokens")
    e = ap.add_argument_group("engine")
    e.add_argument("--max-num-seqs", type=int, default=16)
    e.add_argument("--max-num-batched-tokens", type=int, default=512)
    e.add_argument("--max-model-len", type=int, default=1024)
    e.add_argument("--kv-page-size", type=int, default=16)
    e.add_argument("--num-kv-pages", type=int, default=None)
    e.add_argument("--enforce-eager", action="store_true", help="exact shapes, no bucket padding")
    e.add_argument("--precompile", choices=["on", "off"], default=None,
                   help="compile every step program before serving (default on; off for the no-argument demo, "
                        "whose few requests need only some of them)")
    e.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32")
    e.add_argument("--input-impl", choices=["xla", "pallas", "triton"], default="xla",
                   help="input-assembly kernel (triton needs a GPU with jax-triton)")
    e.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="MTP drafts per step, 0..3 (default 0; 1 in the no-argument demo)")
    e.add_argument("--async-scheduling", choices=list(ASYNC_SCHEDULING_CHOICES), default="auto",
                   help="launch each step before the previous step's tokens are back (host work overlaps the "
                        "device; same outputs; with MTP drafts the next verify step starts where the device's count "
                        "of accepted drafts says). auto (default): on unless --pd; on: refused with --pd")
    e.add_argument("--decode-steps-per-launch", type=int, default=None, metavar="N",
                   help="run N model steps per device launch when every request is decoding: decode steps "
                        "(async scheduling) or MTP verify steps (not --pd); same outputs, the host's per-step "
                        "cost is paid once per launch. Default: 4 on a GPU, 1 elsewhere")
    e.add_argument("--no-fold-norms", action="store_true",
                   help="serve the loaded weights' values exactly: keep each layer's RMSNorm weight apart instead "
                        "of folding it into the projections that read it (the default; same math, rounding at "
                        "the weight dtype's precision; one kernel fewer per norm in a single-token step)")
    e.add_argument("--no-fused-decode-kernels", action="store_true",
                   help="run decode and verify rows on the layers' kernel chains instead of the one-kernel GDN "
                        "mixer and decode attention (same math; e.g. to rule those kernels out when chasing a "
                        "problem). They run on a GPU, or off it with the Pallas paths asked for")
    e.add_argument("--library-gemms-min-tokens", type=min_tokens_arg, default=LIBRARY_GEMMS_MIN_TOKENS,
                   metavar="N|off",
                   help="steps of at least N tokens (prompts) compile their matrix products for cuBLAS instead of "
                        "XLA's Triton GEMMs, which lets XLA add the residual stream inside the products; GPU "
                        f"only (default {LIBRARY_GEMMS_MIN_TOKENS}; off: never)")
    e.add_argument("--pd", action="store_true",
                   help="prefill/decode disaggregation with explicit state handoff (on in the no-argument demo)")
    ap.add_argument("--demo-problems", type=int, default=4,
                    help="test problems the no-argument demo runs (default 4)")
    e.add_argument("--concurrency", type=int, default=None,
                   help="requests in flight at once (sets --max-num-seqs); 1 serves them one after another")
    e.add_argument("--reproduce-pd-mtp-bug", action="store_true",
                   help="restore vLLM's pre-#47466 behaviour (wrong outputs under PD + MTP, concurrency > 1)")
    return ap.parse_args(argv)


def collect_prompts(args) -> list:
    prompts: list = list(args.prompt)
    for p in args.prompt_ids:
        prompts.append([int(t) for t in p.split(",") if t.strip()])
    if args.prompts_file:
        prompts += [line.rstrip("\n") for line in Path(args.prompts_file).read_text().splitlines() if line.strip()]
    return prompts


def demo_problems(n: int) -> list:
    """The first n test-split problems of the arithmetic task (the shipped model's task)."""
    from .task import take

    return take("test", n)


def main(argv=None) -> int:
    args = parse_args(argv)
    model = args.model or default_checkpoint()
    demo = []
    if args.model is None and not (args.prompt or args.prompt_ids or args.prompts_file) and model is not None:
        # The no-argument run: the shipped model on test problems, PD + MTP on.
        demo = demo_problems(args.demo_problems)
        args.prompt = [p.prompt() for p in demo]
        args.pd = True
        args.max_tokens = max(args.max_tokens, 256)
        if args.num_speculative_tokens is None:
            args.num_speculative_tokens = 1
        args.precompile = args.precompile or "off"
        print(f"jaxgdn demo: {model.name} on {len(demo)} test problems, PD + MTP K={args.num_speculative_tokens}")
    args.num_speculative_tokens = args.num_speculative_tokens or 0
    if model is None:
        print(
            "jaxgdn: no default checkpoint in checkpoints/ (a clone without checkpoints/qwen35-tiny-arith?).\n"
            "Run with --model DIR (a Qwen3.5 checkpoint) or --model qwen3.5-0.8b (random weights) and a prompt.",
            file=sys.stderr,
        )
        return 2
    try:
        prompts = collect_prompts(args)
    except (ValueError, OSError) as e:
        print(f"jaxgdn: bad prompts: {e}", file=sys.stderr)
        return 2
    if not prompts:
        print("jaxgdn: give --prompt, --prompt-ids or --prompts-file", file=sys.stderr)
        return 2

    from .engine.config import EngineConfig
    from .engine.request import SamplingParams
    from .llm import LLM
    from .model.checkpoint import CheckpointError
    from .model.config import ConfigError

    try:
        config = EngineConfig(
            max_num_seqs=args.concurrency or args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len, kv_page_size=args.kv_page_size, num_kv_pages=args.num_kv_pages,
            enforce_eager=args.enforce_eager, dtype=args.dtype, num_speculative_tokens=args.num_speculative_tokens,
            pd=args.pd, reproduce_pd_mtp_bug=args.reproduce_pd_mtp_bug,
            async_scheduling=ASYNC_SCHEDULING_CHOICES[args.async_scheduling],
            decode_steps_per_launch=args.decode_steps_per_launch, fold_norms=not args.no_fold_norms,
            fused_decode_kernels=not args.no_fused_decode_kernels,
            library_gemms_min_tokens=args.library_gemms_min_tokens, precompile=args.precompile != "off",
        )
        llm = LLM(str(model), config, input_impl=args.input_impl)
    except (CheckpointError, ConfigError, ValueError) as e:
        print(f"jaxgdn: {e}", file=sys.stderr)
        return 2
    sp = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                        max_tokens=args.max_tokens, seed=args.seed, ignore_eos=args.ignore_eos)
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, sp)
    elapsed = time.perf_counter() - t0
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        shown = prompt if isinstance(prompt, str) else f"ids {list(prompt)}"
        print(f"=== {shown}")
        if out.error:
            print(f"[error] {out.error}")
        else:
            print(out.text if out.text is not None else f"ids {out.token_ids}")
            print(f"[{len(out.token_ids)} tokens, finish: {out.finish_reason}]")
            if demo:
                from .task import extract_answer

                got = extract_answer(out.text or "")
                verdict = "correct" if got is not None and float(got) == demo[i].answer else "WRONG"
                print(f"[reference answer {demo[i].answer}: {verdict}]")
    n_tokens = sum(len(o.token_ids) for o in outputs)
    ttfts = [o.ttft for o in outputs if o.ttft is not None]
    mean_ttft = sum(ttfts) / len(ttfts) if ttfts else float("nan")
    print(f"--- {len(outputs)} requests, {n_tokens} tokens in {elapsed:.2f}s: {n_tokens / elapsed:.1f} tok/s "
          f"(incl. compile), mean TTFT {mean_ttft * 1000:.0f} ms, {llm.engine.num_steps} steps")
    m = llm.metrics()
    if args.num_speculative_tokens:
        rates = ", ".join(f"{r:.2f}" if r is not None else "-" for r in m["acceptance_rate_per_position"])
        print(f"--- MTP K={args.num_speculative_tokens}: {m['num_accepted']}/{m['num_drafted']} drafts accepted, "
              f"per position [{rates}], mean acceptance length {m['mean_acceptance_length'] or 0:.2f}")
    if args.pd:
        print(f"--- PD: {m['handoff_bytes'] / 1e6:.2f} MB of handoff state imported by the decode worker")
    return 0 if all(o.error is None for o in outputs) else 1


if __name__ == "__main__":
    sys.exit(main())
