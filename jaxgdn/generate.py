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

from .engine_args import add_distributed_args, add_engine_args, engine_config, init_distributed

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
    e = add_engine_args(ap, max_num_seqs=16, max_num_batched_tokens=512, max_model_len=1024, dtype="float32", precompile=None,
                        num_speculative_tokens=None)
    ap.add_argument("--demo-problems", type=int, default=4,
                    help="test problems the no-argument demo runs (default 4)")
    e.add_argument("--concurrency", type=int, default=None,
                   help="requests in flight at once (sets --max-num-seqs); 1 serves them one after another")
    add_distributed_args(ap)
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
        args.precompile = bool(args.precompile)  # off unless asked for: the demo's few prompts compile what they use
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

    printer = init_distributed(args)  # every process runs the engine; process 0 prints
    from .engine.request import SamplingParams
    from .llm import LLM
    from .model.checkpoint import CheckpointError
    from .model.config import ConfigError

    try:
        config = engine_config(args, max_num_seqs=args.concurrency or args.max_num_seqs)
        llm = LLM(str(model), config)
    except (CheckpointError, ConfigError, ValueError) as e:
        print(f"jaxgdn: {e}", file=sys.stderr)
        return 2
    sp = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                        max_tokens=args.max_tokens, seed=args.seed, ignore_eos=args.ignore_eos)
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, sp)
    elapsed = time.perf_counter() - t0
    if not printer:
        return 0 if all(o.error is None for o in outputs) else 1
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
