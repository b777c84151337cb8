"""`python -m jaxgdn.eval`: GSM8K-style strict-match accuracy of a checkpoint served by the jaxgdn engine.

Problems come from the arithmetic task's test split (`--split`, `--limit`) or from a GSM8K-format jsonl
(`--data`, with `--num-shots` solved examples prepended, for real weights). Greedy decoding; a problem is
right when the number after the first `####` of the completion equals the reference answer.

`--configs` runs a sweep over serving configurations and prints a table (and writes JSON): baseline
(no PD, no MTP), MTP only, PD only, PD + MTP at concurrency 1, 8 and 64, each with the #47466 fix and
with `reproduce_pd_mtp_bug=True`. Columns: accuracy, the fraction of completions token-identical to the
baseline's, mean acceptance length (tokens per verify step) and tokens/s (wall clock, compiles included).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import time
from pathlib import Path

from . import task

DEFAULT_NUM_PROBLEMS = 200  # the evaluation set: the first 200 problems of the split's stream


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """One row of the sweep."""

    name: str
    pd: bool = False
    num_speculative_tokens: int = 0
    concurrency: int = 64
    reproduce_pd_mtp_bug: bool = False

    @property
    def label(self) -> str:
        return f"{self.name}{' [bug]' if self.reproduce_pd_mtp_bug else ''}"


def sweep_configs(k: int, which: str = "all", wide: int = 64) -> list[ServeConfig]:
    """baseline, MTP, PD, PD+MTP @ 1/8/wide, each fixed; which="all" adds each with the pre-fix
    behaviour, "bug" runs the baseline then the bug rows of MTP, PD and PD+MTP."""
    fixed = [
        ServeConfig("baseline", concurrency=wide),
        ServeConfig(f"mtp K={k}", num_speculative_tokens=k, concurrency=wide),
        ServeConfig("pd", pd=True, concurrency=wide),
    ] + [ServeConfig(f"pd+mtp K={k} @{c}", pd=True, num_speculative_tokens=k, concurrency=c) for c in (1, 8, wide)]
    bug_rows = [dataclasses.replace(c, reproduce_pd_mtp_bug=True) for c in fixed]
    return {"fixed": fixed, "all": fixed + bug_rows, "bug": fixed[:1] + bug_rows[1:]}[which]


@dataclasses.dataclass
class ConfigResult:
    config: ServeConfig
    accuracy: float
    identical_to_baseline: float | None
    mean_acceptance_length: float | None
    acceptance_rate: float | None
    tokens_per_s: float
    num_generated_tokens: int
    handoff_bytes: int  # PD state moved prefill -> decode (0 without PD)
    wall_s: float
    num_errors: int
    completions: list[str]
    token_ids: list[list[int]]

    def row(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("completions"), d.pop("token_ids")
        # a digest of every completion's tokens: runs (and machines) can be compared without the tokens
        d["token_ids_sha256"] = hashlib.sha256(json.dumps(self.token_ids).encode()).hexdigest()
        return d


def is_correct(completion: str | None, answer: int) -> bool:
    got = task.extract_answer(completion or "")
    if got is None:
        return False
    try:
        return float(got) == float(answer)
    except ValueError:
        return False


def choice_loglikelihoods(llm, problems: list[task.Problem]) -> list[list[float]]:
    """Each problem's four choices (`task.multiple_choice`) scored as lm-evaluation-harness's loglikelihood does,
    from the engine's prompt logprobs: a choice's continuation " " + choice is the rest of the whole text's tokens
    after the context's; its score, the sum of their logprobs."""
    from .engine.request import SamplingParams

    encode = llm.tokenizer.encode
    prompts, spans = [], []
    for p in problems:
        context = len(encode(p.prompt()))
        for choice in task.multiple_choice(p)[0]:
            prompts.append(encode(p.prompt() + " " + choice))
            spans.append(context)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    scores = [sum(e[t].logprob for t, e in zip(o.prompt_token_ids[n:], o.prompt_logprobs[n:]))
              for o, n in zip(outs, spans)]
    return [scores[4 * i : 4 * i + 4] for i in range(len(problems))]


def multiple_choice_accuracy(llm, problems: list[task.Problem]) -> float:
    """The share of problems whose right choice scores highest (lm-eval's `acc`)."""
    scores = choice_loglikelihoods(llm, problems)
    labels = [task.multiple_choice(p)[1] for p in problems]
    return sum(s.index(max(s)) == label for s, label in zip(scores, labels)) / len(problems)


def engine_config(sc: ServeConfig, args):
    """The EngineConfig of one configuration: pages for every request at full length, lazy compiles (greedy
    requests known up front compile only the programs they use)."""
    from .engine.config import EngineConfig

    pages_per_seq = -(-args.max_model_len // 16)
    return EngineConfig(max_num_seqs=sc.concurrency, max_num_batched_tokens=args.max_num_batched_tokens,
                        max_model_len=args.max_model_len, kv_page_size=16, num_kv_pages=1 + sc.concurrency * pages_per_seq,
                        dtype=args.dtype, pd=sc.pd, num_speculative_tokens=sc.num_speculative_tokens,
                        reproduce_pd_mtp_bug=sc.reproduce_pd_mtp_bug, precompile=False,
                        tensor_parallel_size=args.tensor_parallel_size)


def run_config(model: str, prompts: list[str], answers: list[int], sc: ServeConfig, args,
               baseline: ConfigResult | None) -> ConfigResult:
    """Serve every prompt under one configuration; score against answers and the baseline's tokens."""
    from .engine.request import SamplingParams
    from .llm import LLM

    ecfg = engine_config(sc, args)
    llm = LLM(model, ecfg)
    if llm.tokenizer is None:
        raise SystemExit(f"jaxgdn.eval: {model} has no tokenizer; text prompts need one")
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=not args.quiet)
    wall = time.perf_counter() - t0
    texts = [o.text or "" for o in outs]
    ids = [list(o.token_ids) for o in outs]
    n_tokens = sum(len(t) for t in ids)
    m = llm.metrics()
    return ConfigResult(
        config=sc,
        accuracy=sum(is_correct(t, a) for t, a in zip(texts, answers)) / len(answers),
        identical_to_baseline=None if baseline is None else
        sum(a == b for a, b in zip(ids, baseline.token_ids)) / len(ids),
        mean_acceptance_length=m["mean_acceptance_length"],
        acceptance_rate=m["acceptance_rate"],
        tokens_per_s=n_tokens / wall,
        num_generated_tokens=n_tokens,
        handoff_bytes=int(m["handoff_bytes"]),
        wall_s=wall,
        num_errors=sum(o.error is not None for o in outs),
        completions=texts,
        token_ids=ids,
    )


def format_table(results: list[ConfigResult]) -> str:
    fmt = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    lines = [f"{'configuration':<26} {'conc':>4} {'accuracy':>8} {'identical':>9} {'accept len':>10} "
             f"{'accept rate':>11} {'tok/s':>8}"]
    for r in results:
        c = r.config
        lines.append(f"{c.label:<26} {c.concurrency:>4} {r.accuracy:>8.3f} {fmt(r.identical_to_baseline, '9.3f'):>9} "
                     f"{fmt(r.mean_acceptance_length, '10.2f'):>10} {fmt(r.acceptance_rate, '11.3f'):>11} "
                     f"{r.tokens_per_s:>8.1f}")
    return "\n".join(lines)


def load_problems(args) -> list[task.Problem]:
    if args.data:
        probs = task.load_jsonl(args.data)
        return probs[: args.limit] if args.limit else probs
    return task.take(args.split, args.limit or DEFAULT_NUM_PROBLEMS)


def write_results(args, model: str, num_problems: int, results: list[ConfigResult]) -> Path:
    from .results import environment, write_result

    payload = {
        "benchmark": "eval",
        "env": environment(os.environ.get("XLA_FLAGS", "")),
        "model": model,
        "data": args.data or f"task:{args.split}",
        "num_problems": num_problems,
        "num_shots": args.num_shots,
        "dtype": args.dtype,
        "max_tokens": args.max_tokens,
        "note": "greedy; tokens/s is wall clock including compiles; identical = token-identical to baseline",
        "results": [r.row() for r in results],
    }
    return write_result("eval", payload, Path(args.out) if args.out else None)


def parse_args(argv=None):
    from .engine_args import add_engine_flags

    ap = argparse.ArgumentParser(prog="python -m jaxgdn.eval", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory (default: the checkpoint shipped in checkpoints/)")
    ap.add_argument("--data", help="GSM8K-format jsonl ({question, answer with '#### N'}) instead of the task")
    ap.add_argument("--split", default="test", choices=sorted(task.SPLITS), help="task split (default test)")
    ap.add_argument("--limit", type=int, default=None, help=f"first N problems (default: the split's first {DEFAULT_NUM_PROBLEMS}, all of --data)")
    ap.add_argument("--num-shots", type=int, default=0,
                    help="solved examples prepended to each prompt (from the task's train split; "
                         "use e.g. 5 with real weights on GSM8K)")
    ap.add_argument("--configs", nargs="?", const="all", choices=["all", "fixed", "bug"],
                    help="sweep serving configurations (all: fixed and bug rows; fixed: the fixed rows; "
                         "bug: the baseline and the bug rows)")
    ap.add_argument("--wide-concurrency", type=int, default=64, help="the sweep's high concurrency (default 64)")
    ap.add_argument("--concurrency", type=int, default=64, help="single run: requests in flight (default 64)")
    ap.add_argument("--max-tokens", type=int, default=256)
    e = ap.add_argument_group("engine", "EngineConfig's fields (pd and reproduce_pd_mtp_bug: the single run's; "
                                        "num_speculative_tokens: the single run's K, auto 0, or the sweep's MTP rows', "
                                        "auto 1)")
    add_engine_flags(e, ["max_model_len", "max_num_batched_tokens", "dtype", "tensor_parallel_size", "pd",
                         "reproduce_pd_mtp_bug", "num_speculative_tokens"], max_model_len=1024,
                     max_num_batched_tokens=1024, num_speculative_tokens=None)
    ap.add_argument("--out", help="JSON path for the results (default with --configs: bench/results/eval_<backend>_<date>.json)")
    ap.add_argument("--multiple-choice", action="store_true",
                    help="the task's multiple-choice form scored by loglikelihood (lm-eval's jaxgdn_arith_mc) instead; "
                         "writes bench/results/eval-mc_<backend>_<date>.json")
    ap.add_argument("--show", type=int, default=0, help="print the first N completions of each configuration")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from .generate import default_checkpoint

    model = args.model or default_checkpoint()
    if model is None:
        print("jaxgdn.eval: no checkpoint given and none shipped in checkpoints/", file=sys.stderr)
        return 2
    try:
        problems = load_problems(args)
    except (OSError, ValueError) as e:
        print(f"jaxgdn.eval: {e}", file=sys.stderr)
        return 2
    if not problems:
        print("jaxgdn.eval: no problems to evaluate", file=sys.stderr)
        return 2
    if args.multiple_choice:
        return _multiple_choice_main(args, str(model), problems)
    shots = tuple((p.question, p.solution) for p in task.take("train", args.num_shots)) if args.num_shots else ()
    prompts = [task.format_prompt(p.question, shots) for p in problems]
    answers = [p.answer for p in problems]

    if args.configs:
        k = 1 if args.num_speculative_tokens is None else args.num_speculative_tokens
        configs = sweep_configs(k, args.configs, wide=args.wide_concurrency)
    else:
        configs = [ServeConfig("single", pd=args.pd, num_speculative_tokens=args.num_speculative_tokens or 0,
                               concurrency=args.concurrency,
                               reproduce_pd_mtp_bug=args.reproduce_pd_mtp_bug)]
    print(f"jaxgdn.eval: {len(problems)} problems from {args.data or args.split + ' split'}, model {model}, "
          f"{len(configs)} configuration(s)")
    results: list[ConfigResult] = []
    baseline = None
    for sc in configs:
        r = run_config(str(model), prompts, answers, sc, args, baseline)
        if baseline is None and args.configs:
            baseline = r
            r.identical_to_baseline = 1.0
        results.append(r)
        print(f"  {sc.label}: accuracy {r.accuracy:.3f}"
              + (f", identical {r.identical_to_baseline:.3f}" if r.identical_to_baseline is not None else ""),
              flush=True)
        for text in r.completions[: args.show]:
            print("    | " + text.replace("\n", "\n    | "))
        if args.configs or args.out:  # after every row, so an interrupted sweep keeps what it measured
            path = write_results(args, str(model), len(problems), results)
    print(format_table(results))
    if args.configs or args.out:
        print(f"wrote {path}")
    return 0


def _multiple_choice_main(args, model: str, problems: list[task.Problem]) -> int:
    from .llm import LLM
    from .results import environment, write_result

    with LLM(model, engine_config(ServeConfig("multiple-choice"), args)) as llm:
        accuracy = multiple_choice_accuracy(llm, problems)
    print(f"jaxgdn.eval: multiple-choice accuracy {accuracy:.3f} on {len(problems)} problems (chance 0.25)")
    payload = {"benchmark": "eval-mc", "env": environment(os.environ.get("XLA_FLAGS", "")), "model": model,
               "data": args.data or f"task:{args.split}", "num_problems": len(problems), "dtype": args.dtype,
               "note": "task.multiple_choice scored by prompt logprobs as lm-eval's loglikelihood (acc)",
               "accuracy": accuracy}
    print(f"wrote {write_result('eval-mc', payload, Path(args.out) if args.out else None)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
