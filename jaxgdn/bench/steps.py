"""`bench decode` and `bench prefill`: the engine on the Qwen3.5-0.8B configuration with random bf16
weights, against the roofline measured in the same run and against transformers (+ fla when installed).

decode:  ms per engine step (host preparation, the jitted step and the token fetch included) with every
         request decoding; roofline = bytes that must move per step (weights once, GDN states read and
         written, KV read) over the measured bandwidth.
prefill: wall time of the engine step that runs whole prompts (B x L in one step); FLOP floor = matmul
         FLOPs (weights x tokens, causal attention, the chunked GDN's own products) over the measured
         bf16 matmul rate.
"""

from __future__ import annotations

import collections
import contextlib
import os
import statistics
import time

import numpy as np

from ..engine.config import LIBRARY_GEMMS_MIN_TOKENS
from .common import measured_bandwidth_gbs, measured_matmul_tflops
from .roofline import decode_bytes, model_sizes, prefill_flops
from .transformers_peer import hf_decode_ms, hf_prefill_ms, peer_model_or_none, record_peer


def load_model(model: str, include_mtp: bool = False):
    """(params bf16, cfg): a preset name (random weights) or a checkpoint directory."""
    import jax.numpy as jnp

    from ..model.config import PRESETS
    from ..model.params import init_random_params

    if model in PRESETS:
        cfg = PRESETS[model]()
        return init_random_params(cfg, seed=0, dtype=jnp.bfloat16, include_mtp=include_mtp, on_device=True), cfg
    from ..model.checkpoint import load_checkpoint

    cfg, params = load_checkpoint(model, dtype=jnp.bfloat16, include_mtp=include_mtp)
    return params, cfg


def bench_engine_config(*, batch: int, max_model_len: int, max_batched: int, K: int = 0, gdn_impl: str = "auto",
                        attention_impl: str = "auto", async_scheduling: bool | None = None,
                        decode_steps_per_launch: int | None = None, fold_norms: bool = True,
                        fused_decode_kernels: bool = True, library_gemms_min_tokens: int | None = LIBRARY_GEMMS_MIN_TOKENS,
                        tensor_parallel_size: int = 1):
    """The EngineConfig of a benchmark engine: `batch` slots, KV pages for each at max_model_len (not a
    memory fraction), bf16, K MTP drafts."""
    from ..engine.config import EngineConfig

    ps = 16
    pages = batch * -(-max_model_len // ps) + 1
    return EngineConfig(max_num_seqs=batch, max_num_batched_tokens=max_batched, max_model_len=max_model_len,
                        kv_page_size=ps, num_kv_pages=pages, dtype="bfloat16", num_speculative_tokens=K,
                        gdn_impl=gdn_impl, attention_impl=attention_impl, async_scheduling=async_scheduling,
                        decode_steps_per_launch=decode_steps_per_launch, fold_norms=fold_norms,
                        fused_decode_kernels=fused_decode_kernels, library_gemms_min_tokens=library_gemms_min_tokens,
                        tensor_parallel_size=tensor_parallel_size)


def make_engine(params, cfg, **config):
    """An engine sized for a benchmark (bench_engine_config's keywords)."""
    from ..engine.llm_engine import LLMEngine

    return LLMEngine(params, cfg, bench_engine_config(**config))


def add_random_prompts(eng, rng, count: int, length: int, sp) -> None:
    """Queue `count` prompts of `length` random token ids (rng: a numpy Generator) with sampling params sp."""
    for _ in range(count):
        eng.add_request([int(t) for t in rng.integers(0, eng.cfg.vocab_size, length)], sp)


def engine_decode_ms(params, cfg, batch: int, prompt_len: int, steps: int, K: int = 0, gdn_impl: str = "auto",
                     profile_dir: str | None = None, attention_impl: str = "auto",
                     async_scheduling: bool | None = None, decode_steps_per_launch: int | None = None,
                     fold_norms: bool = True, fused_decode_kernels: bool = True, tensor_parallel_size: int = 1) -> dict:
    """Wall time per decode step of the engine in steady state: the engine.step() calls after the prompt
    call and `warm` compile/warm-up launches (and 2 calls after any later compile), summed, over the tokens
    per row whose results they brought back. `steps` is rounded up to whole launches (a launch may run
    several decode steps: decode_steps_per_launch), so no timed launch runs masked steps past max_tokens. profile_dir: also
    trace 5 more engine.step() calls after the timed ones (host work included) into profile_dir + "-engine"
    and 5 replayed device launches into profile_dir, and summarise their kernels and host runtime events.
    Traced calls stay out of the timed window: the profiler (CUPTI) slows dispatch several-fold.

    Why results brought back and not tokens launched: with async scheduling the launch dispatched by the
    last untimed call is on the device when the timed window opens, so the window holds its device time;
    its tokens come back inside the window. Counting launched tokens would charge that launch's time to the
    later launches."""
    import jax

    from ..engine.request import PLACEHOLDER_TOKEN, SamplingParams

    warm = 5  # launches: the first runs op by op, the second records the CUDA graph; then steady state
    # The window opens `warm_after_compile` calls after the last call that compiled a new program (only without
    # a start-up compile); a compile inside the window reopens it, at most `max_reopens` times.
    warm_after_compile, max_reopens = 2, 2
    config = dict(batch=batch, max_batched=max(256, batch * prompt_len), K=K, gdn_impl=gdn_impl,
                  attention_impl=attention_impl, async_scheduling=async_scheduling,
                  decode_steps_per_launch=decode_steps_per_launch, fold_norms=fold_norms,
                  fused_decode_kernels=fused_decode_kernels, tensor_parallel_size=tensor_parallel_size)
    per_launch = bench_engine_config(max_model_len=prompt_len + 1, **config).resolved_decode_steps(
        jax.default_backend())
    traced_launches = 5 if profile_dir else 0
    timed_launches = -(-steps // per_launch)
    after_open = per_launch * (timed_launches + traced_launches)  # model steps per row, timed and traced
    # With MTP a verify step emits 1..1+K tokens: max_tokens leaves room for every step with every draft
    # accepted, and max_model_len for that plus a launch of verify windows (Scheduler.launch_steps).
    max_tokens = 1 + (per_launch * (warm + (1 + max_reopens) * (warm_after_compile + timed_launches))
                      + traced_launches * per_launch) * (1 + K)
    room = per_launch * (1 + K) + K if K else 0
    eng = make_engine(params, cfg, max_model_len=prompt_len + max_tokens + room + 8, **config)
    rng = np.random.default_rng(batch)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    add_random_prompts(eng, rng, batch, prompt_len, sp)

    def tokens_back():  # output tokens whose values reached the host, over all requests
        return sum(sum(t != PLACEHOLDER_TOKEN for t in r.output_token_ids) for r in eng.requests.values())

    def steps_back():  # model steps per row whose results reached the host
        # A verify step emits 1..1+K tokens a row: count the verify rows applied, not the tokens.
        return eng.update.spec_counters.num_verify_rows / batch if K else tokens_back() / batch

    times, t_first, before, after = [], time.perf_counter(), None, None
    first_timed = target = None  # the window's first call; steps_back() that ends it
    last_compile, reopens, traced = 0, 0, 0  # calls up to the last one that compiled
    with contextlib.ExitStack() as tracing:
        # Stop after the steps planned, every row still running, so no launch of fewer rows (a new bucket)
        # falls in the window.
        while eng.has_unfinished and (target is None or steps_back() < target):
            # the prompt call and the warm-up calls (they compile and warm the decode program) are not timed
            if first_timed is None and len(times) >= max(1 + warm, last_compile + warm_after_compile):
                before, steps_before, first_timed = dict(eng.timings), steps_back(), len(times)
                target = steps_before + after_open
            # the timed window closes where the traced calls (real steps, host preparation included) begin
            if traced_launches and first_timed is not None and after is None \
                    and steps_back() >= target - traced_launches * per_launch:
                after = dict(eng.timings), steps_back(), len(times)
                tracing.enter_context(jax.profiler.trace(profile_dir + "-engine", create_perfetto_trace=True))
            traced += after is not None
            compiled = eng.runner.num_compiles
            t0 = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t0)
            if eng.runner.num_compiles > compiled and after is None:
                last_compile = len(times)
                if first_timed is not None:
                    if reopens == max_reopens:
                        raise RuntimeError(f"a new program compiled inside the timed window {reopens + 1} times")
                    reopens, first_timed, target = reopens + 1, None, None
    timings_after, steps_after, last_timed = after or (dict(eng.timings), steps_back(), len(times))
    if first_timed is None or steps_after <= steps_before:
        raise ValueError(f"--steps {steps}: no decode step left to time after {warm} warm-up calls")
    decode = times[first_timed:last_timed]
    decode_steps = steps_after - steps_before  # model steps whose results came back
    phases = {k: (v - before.get(k, 0.0)) / decode_steps * 1e3 for k, v in timings_after.items()}
    generated = tokens_back()
    out = {"async_scheduling": eng.async_scheduling, "decode_steps_per_launch": per_launch,
           "ms_per_step": sum(decode) / decode_steps * 1e3, "ms_per_call_median": statistics.median(decode) * 1e3,
           "timed_steps": decode_steps, "window_reopened_after_compile": reopens,
           "device_ms_per_step": eng.runner.time_device_step(),
           # the same replays on one device copy of the input: the whole graph at fixed addresses
           "device_ms_per_step_fixed_input": eng.runner.time_device_step(fresh_input=False),
           "host_phase_ms_per_step": phases,
           "steps": eng.num_steps, "launches": eng.num_launches, "generated": generated,
           "compiled_shapes": eng.runner.num_compiles, "total_s_incl_compile": time.perf_counter() - t_first,
           "spec": eng.update.spec_counters.metrics() if K else None,
           # greedy tokens are a function of the program's arithmetic: equal digests across processes that
           # compiled the step differently (XLA flags, kernel forms) mean they computed the same tokens
           "tokens_digest": tokens_digest(eng, first=16)}
    if profile_dir:
        from .common import profile_summary

        out["profile_engine_steps"] = profile_summary(profile_dir + "-engine", divide_by=max(traced, 1))
        out["profile_per_step"] = profile_replayed_steps(eng, profile_dir)
    return out


def tokens_digest(eng, first: int) -> str:
    """sha256 (16 hex digits) of each request's first `first` output tokens, in request order."""
    import hashlib

    tokens = [r.output_token_ids[:first] for _, r in sorted(eng.requests.items())]
    return hashlib.sha256(repr(tokens).encode()).hexdigest()[:16]


def profile_replayed_steps(eng, profile_dir: str, iters: int = 5) -> dict:
    """Trace `iters` replays of the engine's last device step into profile_dir; the kernels per step."""
    import jax

    from .common import profile_summary

    with jax.profiler.trace(profile_dir, create_perfetto_trace=True):
        eng.runner.time_device_step(iters=iters)
    return profile_summary(profile_dir, divide_by=iters + 2)  # time_device_step replays twice to warm up


def engine_prefill_ms(params, cfg, batch: int, length: int, repeats: int = 7, gdn_impl: str = "auto",
                      attention_impl: str = "auto", profile_dir: str | None = None,
                      fold_norms: bool = True, library_gemms_min_tokens: int | None = LIBRARY_GEMMS_MIN_TOKENS
                      ) -> tuple[float, dict, dict | None]:
    """Median wall time of one engine step that runs `batch` whole prompts of `length` tokens; the split of
    that time (host phases: median ms of each over the timed steps; `device_ms`: the step's program
    replayed back to back, no host work, and `device_ms_fixed_input` with its input at one address); with
    profile_dir the kernels of that step replayed (None without). Seven timed steps: a few move by
    milliseconds with the host."""
    from ..engine.request import SamplingParams

    # synchronous: the timed step is the prompts' whole forward with its tokens back on the host
    eng = make_engine(params, cfg, batch=batch, max_model_len=length + 8, max_batched=batch * length,
                      gdn_impl=gdn_impl, attention_impl=attention_impl, async_scheduling=False, fold_norms=fold_norms,
                      library_gemms_min_tokens=library_gemms_min_tokens)
    rng = np.random.default_rng(length)
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    runs, phases = [], collections.defaultdict(list)
    for i in range(repeats + 1):  # the first run compiles
        add_random_prompts(eng, rng, batch, length, sp)
        eng.timings.clear()
        eng.runner.timings.clear()
        t0 = time.perf_counter()
        steps = 0
        while eng.has_unfinished:
            eng.step()
            steps += 1
        assert steps == 1, f"prefill of {batch}x{length} took {steps} steps"
        if i:
            runs.append(time.perf_counter() - t0)
            for name, seconds in {**eng.timings, **eng.runner.timings}.items():
                phases[name].append(seconds)
    split = {"host_phase_ms": {name: round(statistics.median(v) * 1e3, 3) for name, v in phases.items()},
             "device_ms": eng.runner.time_device_step(iters=5),
             # the same with one input buffer for every call: no graph node changes address between calls
             "device_ms_fixed_input": eng.runner.time_device_step(iters=5, fresh_input=False)}
    profile = profile_replayed_steps(eng, profile_dir, iters=2) if profile_dir else None
    return statistics.median(runs) * 1e3, split, profile


def engine_prefill_stream_ms(params, cfg, batch: int, length: int, steps: int = 8, gdn_impl: str = "auto",
                             attention_impl: str = "auto", fold_norms: bool = True,
                             library_gemms_min_tokens: int | None = LIBRARY_GEMMS_MIN_TOKENS) -> float:
    """ms per step of a stream of prefill steps: steps x batch prompts of `length` tokens queued at once,
    one step of `batch` whole prompts each, run back to back with async scheduling (the engine builds and
    launches step n+1 before step n's tokens come back, so the host's part of a step hides behind the
    device's part of the one before), timed from the first step to the last tokens back, after one
    untimed round (compile, warm-up). A prefill worker's throughput, where engine_prefill_ms is one step's
    latency."""
    from ..engine.request import SamplingParams

    # two steps' worth of slots and pages: the next step's prompts are admitted while the last is in flight
    eng = make_engine(params, cfg, batch=2 * batch, max_model_len=length + 8, max_batched=batch * length,
                      gdn_impl=gdn_impl, attention_impl=attention_impl, async_scheduling=True, fold_norms=fold_norms,
                      library_gemms_min_tokens=library_gemms_min_tokens)
    rng = np.random.default_rng(length + 1)
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for _ in range(2):  # the first round compiles
        add_random_prompts(eng, rng, steps * batch, length, sp)
        launches = eng.num_launches
        t0 = time.perf_counter()
        while eng.has_unfinished:
            eng.step()
        seconds = time.perf_counter() - t0
        launches = eng.num_launches - launches
        if launches != steps:
            raise RuntimeError(f"a stream of {steps} prefill steps of {batch}x{length} took {launches} launches")
    return seconds / steps * 1e3


def _setup(args):
    """(params, cfg, sizes, transformers model or None) for the decode and prefill benchmarks."""
    params, cfg = load_model(args.model)
    return params, cfg, model_sizes(params, cfg), peer_model_or_none(cfg, not args.no_peer)


def bench_decode(args) -> dict:
    params, cfg, sizes, hf = _setup(args)
    bw = measured_bandwidth_gbs(args.bandwidth_bytes)
    rows = []
    for batch in args.batch:
        profile = os.path.join(args.profile, f"batch{batch}") if args.profile else None
        r = engine_decode_ms(params, cfg, batch, args.prompt_len, args.steps, gdn_impl=args.gdn_impl,
                             profile_dir=profile, attention_impl=args.attention_impl,
                             async_scheduling=args.async_scheduling,
                             decode_steps_per_launch=args.decode_steps_per_launch,
                             fold_norms=args.fold_norms, fused_decode_kernels=args.fused_decode_kernels,
                             tensor_parallel_size=args.tensor_parallel_size)
        context = args.prompt_len + args.steps
        nbytes = decode_bytes(cfg, sizes, batch, context) / args.tensor_parallel_size  # what each device reads
        row = {"batch": batch, "prompt_len": args.prompt_len, **r, "tokens_per_s": batch / r["ms_per_step"] * 1e3,
               "roofline_bytes": nbytes, "roofline_ms": nbytes / (bw * 1e9) * 1e3}
        rows.append(row)
        measure = None if hf is None or batch not in args.peer_batch else \
            (lambda: hf_decode_ms(hf, cfg.vocab_size, batch, args.prompt_len, args.peer_steps))
        peer = record_peer(row, "transformers_ms_per_step", row["ms_per_step"], measure,
                     lambda: args.save_partial(_decode_payload(args, sizes, bw, rows)))
        split = " ".join(f"{k} {v:.2f}" for k, v in row["host_phase_ms_per_step"].items())
        print(f"decode batch {batch:4d}: {row['ms_per_step']:.3f} ms/step (device {row['device_ms_per_step']:.3f}; {split})  "
              f"{row['tokens_per_s']:10.0f} tok/s  "
              f"roofline {row['roofline_ms']:.3f} ms{peer}", flush=True)
    return _decode_payload(args, sizes, bw, rows)


DECODE_TIMING = ("wall time per decode step, all rows decoding, steady state: the timed engine.step() calls "
                 "(host prep + launch + token fetch) summed, over the tokens per row whose results came back in "
                 "them, timed launches whole (a launch runs several decode steps with decode_steps_per_launch > "
                 "1)")
PREFILL_TIMING = ("median wall time of one engine step running whole prompts (host prep, step, token fetch); "
                  "stream_*: a stream of such steps back to back with async scheduling, per step")


def _payload(name: str, args, sizes: dict, rows: list, **extra) -> dict:
    return {"benchmark": name, "model": _model_label(args.model), "gdn_impl": args.gdn_impl,
            "attention_impl": args.attention_impl, "fold_norms": args.fold_norms, **sizes, **extra,
            "rows": rows}


def _decode_payload(args, sizes, bw, rows) -> dict:
    return _payload("decode", args, sizes, rows, bandwidth_gbs=bw, timing=DECODE_TIMING,
                    async_scheduling=args.async_scheduling, decode_steps_per_launch=args.decode_steps_per_launch,
                    fused_decode_kernels=args.fused_decode_kernels, tensor_parallel_size=args.tensor_parallel_size)


def bench_prefill(args) -> dict:
    params, cfg, sizes, hf = _setup(args)
    tflops = measured_matmul_tflops(args.matmul_size)
    rows = []
    for batch, length in args.shapes:
        profile = os.path.join(args.profile, f"{batch}x{length}") if args.profile else None
        ms, split, kernels = engine_prefill_ms(params, cfg, batch, length, gdn_impl=args.gdn_impl,
                                               attention_impl=args.attention_impl, profile_dir=profile,
                                               fold_norms=args.fold_norms,
                                               library_gemms_min_tokens=args.library_gemms_min_tokens)
        flops = prefill_flops(cfg, sizes, batch, length)
        row = {"batch": batch, "length": length, "ms": ms, "tokens_per_s": batch * length / ms * 1e3,
               "flops": flops, "flop_floor_ms": flops / (tflops * 1e12) * 1e3, **split}
        if kernels:
            row["profile_per_step"] = kernels
        row["over_floor"] = ms / row["flop_floor_ms"]
        if args.stream_steps:
            stream = engine_prefill_stream_ms(params, cfg, batch, length, args.stream_steps, gdn_impl=args.gdn_impl,
                                              attention_impl=args.attention_impl, fold_norms=args.fold_norms,
                                              library_gemms_min_tokens=args.library_gemms_min_tokens)
            row.update(stream_steps=args.stream_steps, stream_ms_per_step=stream,
                       stream_tokens_per_s=batch * length / stream * 1e3,
                       stream_over_floor=stream / row["flop_floor_ms"])
        rows.append(row)
        measure = None if hf is None else (lambda: hf_prefill_ms(hf, cfg.vocab_size, batch, length))
        peer = record_peer(row, "transformers_ms", ms, measure,
                     lambda: args.save_partial(_prefill_payload(args, sizes, tflops, rows)))
        stream = (f"  stream {row['stream_ms_per_step']:.2f} ms/step ({row['stream_over_floor']:.2f}x)"
                  if args.stream_steps else "")
        print(f"prefill {batch}x{length}: {ms:.2f} ms (device {row['device_ms']:.2f})  "
              f"{row['tokens_per_s']:10.0f} tok/s  FLOP floor "
              f"{row['flop_floor_ms']:.2f} ms ({row['over_floor']:.1f}x){stream}{peer}", flush=True)
    return _prefill_payload(args, sizes, tflops, rows)


def _prefill_payload(args, sizes, tflops, rows) -> dict:
    return _payload("prefill", args, sizes, rows, matmul_tflops=tflops, timing=PREFILL_TIMING,
                    library_gemms_min_tokens=args.library_gemms_min_tokens)


def _model_label(model: str) -> str:
    from ..model.config import PRESETS

    return f"{model} config, random bf16 weights" if model in PRESETS else f"{model} (bf16)"
