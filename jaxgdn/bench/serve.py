"""`bench serve`: the serving benchmark, like vLLM's benchmark_throughput / benchmark_serving.

A seeded workload (`random`: uniform prompt and output lengths; `sharegpt-like`: lognormal lengths with
ShareGPT's means, synthesised; `task`: the shipped task's test prompts; `prefix`: one shared system prompt of
--prefix-len tokens in front of random prompts; `multiturn`: conversations, bench/multiturn.py) is served by
`LLM` in a fresh process
with an empty compilation cache: start-up (weights, memory plan, every step program compiled), the workload
(cold: the first run, all requests at once or Poisson arrivals at --request-rate), and the same workload
again in that process (warm). A second fresh process on the filled cache measures start-up with the
persistent cache. Each run starts on an empty prefix cache (the warm run re-sends the same prompts); with
--dataset prefix the warm run is also served with prefix caching off ("warm_no_prefix_caching"). Reported: wall
times, total and output tokens/s, prefix-cache hit rate, TTFT / TPOT / ITL at p50 and p99, programs
compiled after start-up (must be 0), peak device memory, and the bound for the same requests (prompt FLOPs
over the measured matmul rate, plus the decode steps at the batch reached over the bandwidth roofline).
Peer: transformers' continuous batching (`generate_batch`) on the same requests, or `generate` at batch 32
with left padding where that fails (the error is recorded).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from .common import percentiles

SHAREGPT_MEAN_INPUT, SHAREGPT_MEAN_OUTPUT, SHAREGPT_SIGMA = 220, 170, 1.0  # means of ShareGPT's conversations


def make_requests(args, vocab: int, tokenizer=None) -> list[tuple[list[int], int]]:
    """[(prompt ids, max_tokens)] of the workload, from args.seed."""
    rng = np.random.default_rng(args.seed)
    n = args.num_prompts
    if args.dataset == "multiturn":  # the turns' lengths (the bound, a peer); bench/multiturn.py serves them
        from .multiturn import conversation_requests, make_conversations

        return conversation_requests(make_conversations(args, vocab), args.max_model_len)
    if args.dataset in ("random", "prefix"):
        lengths = rng.integers(args.input_len[0], args.input_len[1] + 1, n)
        outputs = rng.integers(args.output_len[0], args.output_len[1] + 1, n)
        if args.dataset == "prefix":  # the shared system prompt first, then each request's own tokens
            system = [int(t) for t in rng.integers(0, vocab, args.prefix_len)]
            return [(system + [int(t) for t in rng.integers(0, vocab, int(m))], int(o)) for m, o in zip(lengths, outputs)]
    elif args.dataset == "sharegpt-like":
        lognormal = lambda mean: rng.lognormal(np.log(mean) - SHAREGPT_SIGMA**2 / 2, SHAREGPT_SIGMA, n)  # noqa: E731
        room = args.max_model_len - 1
        lengths = np.clip(lognormal(SHAREGPT_MEAN_INPUT), 4, room // 2).astype(int)
        outputs = np.clip(lognormal(SHAREGPT_MEAN_OUTPUT), 4, room - lengths).astype(int)
    else:  # the shipped task's test prompts
        from ..task import take

        if tokenizer is None:
            raise SystemExit(f"--dataset task needs a checkpoint with a tokenizer; {args.model} has none")
        problems = take("test", n)
        prompts = [tokenizer.encode(p.prompt()) for p in problems]
        return [(p, int(args.output_len[1])) for p in prompts]
    return [([int(t) for t in rng.integers(0, vocab, int(m))], int(o)) for m, o in zip(lengths, outputs)]


# --json-schema: nested objects, an enum and strings, in an array whose minItems no request reaches
BENCH_SCHEMA = {"type": "object", "required": ["records"], "properties": {"records": {
    "type": "array", "minItems": 100000, "items": {
        "type": "object", "required": ["name", "kind", "value"], "properties": {
            "name": {"type": "string"}, "kind": {"enum": ["add", "sub", "mul"]}, "value": {"type": "integer"}}}}}}


def serve(llm, requests, request_rate: float, seed: int, max_concurrency: int | None = None,
          logprobs: int | None = None, structured=None) -> dict:
    """Serve the requests on llm's engine (arrivals at t=0, or Poisson at request_rate/s; at most max_concurrency
    in flight, a request arriving when it is admitted; logprobs: every request asks for them; structured: every
    request's StructuredOutputsParams), stamping each output token when the host sees it. With
    PD (llm.prefill_worker) a prompt goes to the prefill worker and its handoff to the decode worker, the two
    stepping in turn. Returns wall time, token counts and latency percentiles (ms)."""
    from ..engine.request import PLACEHOLDER_TOKEN, SamplingParams
    from ..engine.workers import needs_prefill, step_pair
    from .serve_pd import handoff_stats

    eng, prefill = llm.engine, llm.prefill_worker
    llm.reset_prefix_cache()  # hits come from this run's own requests
    before = llm.metrics()
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1 / request_rate, len(requests)) if request_rate > 0 else np.zeros(len(requests))
    arrivals = np.cumsum(gaps) - gaps[0]
    pending = list(zip(arrivals, requests))
    live: dict[int, tuple[float, list[float]]] = {}  # request number -> (arrival, token times)
    done: dict[int, tuple[float, list[float]]] = {}
    rid_of: dict[int, int] = {}  # request number -> its id in the (decode) engine
    in_prefill: dict[int, int] = {}  # prefill worker's id -> request number
    handoff_bytes: list[int] = []

    def route(handoffs) -> None:  # PD: a prompt's handoff to the decode worker
        for h in handoffs:
            prefill.forget(h.request_id)
            handoff_bytes.append(h.nbytes)
            rid_of[in_prefill.pop(h.request_id)] = eng.role.submit(h)

    for e in llm.engines:
        e.copies.handoff_seconds.clear()
    t0 = time.perf_counter()

    def stamp(now: float) -> None:
        for i, rid in list(rid_of.items()):
            req = eng.requests[rid]
            tokens = req.output_token_ids
            n = len(tokens)
            while n and tokens[n - 1] == PLACEHOLDER_TOKEN:  # async scheduling: values still in flight
                n -= 1
            times = live[i][1]
            times += [now] * (n - len(times))
            if req.finish_reason is not None and n == len(tokens):
                done[rid] = live.pop(i)
                del rid_of[i]

    busy = lambda: eng.has_unfinished or (prefill is not None and prefill.has_unfinished)  # noqa: E731
    while pending or busy():
        now = time.perf_counter() - t0
        while pending and pending[0][0] <= now and len(live) < (max_concurrency or len(requests)):
            arrival, (prompt, max_tokens) = pending.pop(0)
            i, sp = len(requests) - len(pending) - 1, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                                                          logprobs=logprobs, structured_outputs=structured)
            if prefill is not None and needs_prefill(prompt):
                in_prefill[prefill.role.submit(prompt, sp)] = i
            else:
                rid_of[i] = eng.add_request(prompt, sp)
            live[i] = (max(arrival, now), [])
        if prefill is not None and (prefill.has_unfinished or eng.has_unfinished):
            step_pair(prefill, eng, route)
        elif eng.has_unfinished:
            eng.step()
        elif live and not in_prefill:
            eng.flush()  # async scheduling: the tokens of requests that all finished
        elif pending and not busy():
            time.sleep(max(0.0, pending[0][0] - (time.perf_counter() - t0)))
        stamp(time.perf_counter() - t0)
    eng.run_until_done()  # async scheduling: the last launch's tokens
    stamp(time.perf_counter() - t0)
    wall = time.perf_counter() - t0
    ttft, tpot, itl = [], [], []
    for arrival, times in done.values():
        if times:
            ttft.append((times[0] - arrival) * 1e3)
            if len(times) > 1:
                tpot.append((times[-1] - times[0]) / (len(times) - 1) * 1e3)
                itl += list(np.diff(times) * 1e3)
    errors = [eng.requests[r].error for r in done if eng.requests[r].error is not None]
    prompt_tokens = sum(len(p) for p, _ in requests)
    output_tokens = sum(len(times) for _, times in done.values())
    after = llm.metrics()
    looked_up = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    found = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    out = {"handoffs": handoff_stats(llm, handoff_bytes)} if prefill is not None else {}
    return {**out, "wall_s": wall, "requests": len(requests), "finished": len(done), "errors": len(errors),
            "first_errors": errors[:3],
            "prefix_cache_hit_rate": found / looked_up if looked_up else None, "prefix_cache_hit_tokens": found,
            "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
            "total_tokens_per_s": (prompt_tokens + output_tokens) / wall, "output_tokens_per_s": output_tokens / wall,
            "ttft_ms": percentiles(ttft), "tpot_ms": percentiles(tpot), "itl_ms": percentiles(itl)}


def bound_s(cfg, params, requests, batch: int, matmul_tflops: float, bandwidth_gbs: float) -> dict:
    """The time the requests need at least: prompt FLOPs over the matmul rate, plus the decode steps (the
    output tokens over the batch reached) each moving the weights and the batch's states once."""
    from .roofline import decode_bytes, model_sizes, prefill_flops

    sizes = model_sizes(params, cfg)
    flops = sum(prefill_flops(cfg, sizes, 1, len(p)) for p, _ in requests)
    outputs = sum(o for _, o in requests)
    mean_context = float(np.mean([len(p) + o / 2 for p, o in requests]))
    steps = -(-outputs // max(batch, 1))
    step_bytes = decode_bytes(cfg, sizes, batch, int(mean_context))
    prefill_s, decode_s = flops / (matmul_tflops * 1e12), steps * step_bytes / (bandwidth_gbs * 1e9)
    return {"prefill_s": prefill_s, "decode_s": decode_s, "total_s": prefill_s + decode_s, "decode_steps": steps,
            "batch": batch, "matmul_tflops": matmul_tflops, "bandwidth_gbs": bandwidth_gbs}


@contextlib.contextmanager
def prefix_caching_off(llm):
    """Serve without looking up or filling the prefix cache, on the same engine (programs and memory plan)."""
    saved = [e.prefix.enabled for e in llm.engines]
    for e in llm.engines:
        e.prefix.enabled = False
    try:
        yield
    finally:
        for e, enabled in zip(llm.engines, saved):
            e.prefix.enabled = enabled


def engine_config(args):
    from ..engine.config import EngineConfig
    from ..engine_args import use_memory_fraction

    use_memory_fraction(args.gpu_memory_utilization)
    return EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        max_model_len=args.max_model_len, dtype=args.dtype,
                        num_speculative_tokens=args.num_speculative_tokens,
                        gpu_memory_utilization=args.gpu_memory_utilization,
                        decode_steps_per_launch=args.decode_steps_per_launch,
                        library_gemms_min_tokens=args.library_gemms_min_tokens,
                        tensor_parallel_size=args.tensor_parallel_size, pd=args.pd,
                        enable_prefix_caching=args.enable_prefix_caching)


def child_run(args) -> dict:
    """One fresh process: start-up, the workload cold and warm (or start-up only with --child startup)."""
    import jax

    t_start = time.perf_counter()
    from ..engine.runner import enable_compilation_cache
    from ..llm import LLM
    from .common import measured_bandwidth_gbs, measured_matmul_tflops

    enable_compilation_cache(args.cache_dir)  # before any engine: its own call then keeps this directory
    llm = LLM(args.model, engine_config(args))
    startup = time.perf_counter() - t_start
    out = {"startup_s": startup, "startup_phases": llm.startup, "programs": sum(e.runner.num_programs for e in llm.engines),
           "memory": llm.engine.memory.describe(llm.config)}
    if args.child == "startup":
        return out
    requests = make_requests(args, llm.model_config.vocab_size, llm.tokenizer)
    if args.dataset == "multiturn":
        from .multiturn import make_conversations, serve_conversations

        conversations = make_conversations(args, llm.model_config.vocab_size)
        run = lambda: serve_conversations(llm, conversations, args.max_model_len)  # noqa: E731
    else:
        structured = None
        if args.json_schema:
            from ..engine.structured import Grammars, StructuredOutputsParams

            structured = StructuredOutputsParams(json=BENCH_SCHEMA)
            for e in llm.engines if llm.tokenizer is None else ():  # a random-weight preset: a stand-in vocabulary
                e.grammars = Grammars.synthetic(llm.model_config.vocab_size, llm.model_config.eos_token_ids)
        run = lambda: serve(llm, requests, args.request_rate, args.seed, args.max_concurrency, args.logprobs,  # noqa: E731
                            structured)
    out["cold"] = run()
    out["cold"]["from_process_start_s"] = time.perf_counter() - t_start
    out["warm"] = run()
    if args.dataset in ("prefix", "multiturn") or args.compare_prefix_caching:
        with prefix_caching_off(llm):  # the same engine and programs, the cache left unused
            out["warm_no_prefix_caching"] = run()
    out["compiles_after_startup"] = llm.compiles_after_startup
    if llm.prefill_worker is not None:
        from .serve_pd import handoff_device_ms

        lengths = sorted(len(p) for p, _ in requests if len(p) > 1)
        out["handoff_device_ms"] = [handoff_device_ms(llm, n) for n in (lengths[len(lengths) // 2], lengths[-1])]
    stats = jax.devices()[0].memory_stats() or {}
    out["peak_device_bytes"] = stats.get("peak_bytes_in_use")
    eng = llm.engine
    batch = min(args.max_num_seqs, args.num_prompts, args.max_concurrency or args.num_prompts)  # the batch reached
    rates = (measured_matmul_tflops(args.matmul_size), measured_bandwidth_gbs(args.bandwidth_bytes))
    out["bound"] = bound_s(llm.model_config, eng.runner.params, requests, batch, *rates)
    out["warm"]["fraction_of_bound"] = out["bound"]["total_s"] / out["warm"]["wall_s"]
    return out


def _child(args, which: str, cache_dir: str) -> dict:
    """Run `bench serve --child which` in a fresh process on the compilation cache cache_dir."""
    cmd = [sys.executable, "-m", "jaxgdn.bench", "serve", *_forwarded(args), "--child", which, "--cache-dir", cache_dir]
    t0 = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if run.returncode:
        raise SystemExit(f"bench serve: the {which} process failed:\n{run.stderr[-4000:]}")
    result = json.loads(run.stdout.strip().splitlines()[-1])
    result["process_wall_s"] = time.perf_counter() - t0
    return result


def _forwarded(args) -> list[str]:
    """The workload and engine flags, for the child processes."""
    flags = ["--model", args.model, "--dataset", args.dataset, "--prefix-len", str(args.prefix_len),
             "--num-turns", str(args.num_turns), *(["--compare-prefix-caching"] if args.compare_prefix_caching else []),
             "--num-prompts", str(args.num_prompts),
             "--input-len", *map(str, args.input_len), "--output-len", *map(str, args.output_len),
             "--request-rate", str(args.request_rate), "--seed", str(args.seed),
             *(["--max-concurrency", str(args.max_concurrency)] if args.max_concurrency else []),
             *(["--logprobs", str(args.logprobs)] if args.logprobs is not None else []),
             *(["--json-schema"] if args.json_schema else []),
             "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
             "--max-model-len", str(args.max_model_len), "--dtype", args.dtype,
             "--num-speculative-tokens", str(args.num_speculative_tokens),
             "--gpu-memory-utilization", str(args.gpu_memory_utilization),
             "--tensor-parallel-size", str(args.tensor_parallel_size), *(["--pd"] if args.pd else []),
             "--enable-prefix-caching" if args.enable_prefix_caching else "--no-enable-prefix-caching",
             "--matmul-size", str(args.matmul_size), "--bandwidth-bytes", str(args.bandwidth_bytes)]
    if args.decode_steps_per_launch is not None:
        flags += ["--decode-steps-per-launch", str(args.decode_steps_per_launch)]
    min_tokens = args.library_gemms_min_tokens
    return flags + ["--library-gemms-min-tokens", "off" if min_tokens is None else str(min_tokens)]


def bench_serve(args) -> dict:
    """A process on an empty compilation cache (start-up, the workload cold and warm), then a start-up on the
    cache it filled; with --cache-dir one process on that cache (filled by an earlier run: a server's, for an
    in-process comparison on the same programs)."""
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="jaxgdn-serve-cache-")
    cold = _child(args, "workload", cache_dir)
    warm_start = None if args.cache_dir else _child(args, "startup", cache_dir)
    colocated = None
    if args.pd:  # the same workload on the colocated engine, on the same device, for the ratio
        import argparse

        plain = argparse.Namespace(**{**vars(args), "pd": False})
        colocated = _child(plain, "workload", args.cache_dir or tempfile.mkdtemp(prefix="jaxgdn-serve-cache-"))
    payload = {"benchmark": "serve", "model": args.model, "dataset": args.dataset, "num_prompts": args.num_prompts,
               **({"prefix_len": args.prefix_len} if args.dataset == "prefix" else {}),
               **({"num_turns": args.num_turns} if args.dataset == "multiturn" else {}),
               "input_len": args.input_len, "output_len": args.output_len, "request_rate": args.request_rate,
               "max_concurrency": args.max_concurrency, "seed": args.seed, "logprobs": args.logprobs,
               "json_schema": BENCH_SCHEMA if args.json_schema else None, "engine": {k: getattr(args, k) for k in (
                   "max_num_seqs", "max_num_batched_tokens", "max_model_len", "dtype", "num_speculative_tokens",
                   "gpu_memory_utilization", "decode_steps_per_launch", "library_gemms_min_tokens", "pd",
                   "enable_prefix_caching")},
               "cold_process": cold}
    if colocated is not None:
        payload["colocated_process"] = colocated
        payload["pd_over_colocated_warm_wall"] = cold["warm"]["wall_s"] / colocated["warm"]["wall_s"]
    if warm_start is None:
        payload["note"] = f"one process on the compilation cache {args.cache_dir} as earlier runs left it"
    else:
        payload["warm_cache_startup"] = warm_start
    args.save_partial(payload)
    w = cold["warm"]
    if w["errors"] == w["requests"]:
        raise SystemExit(f"every request failed: {w['first_errors']}")
    filled = f"{warm_start['startup_s']:.1f}" if warm_start else "-"
    print(f"start-up {cold['startup_s']:.1f} s (cache filled: {filled} s), "
          f"{cold['programs']} programs; cold {cold['cold']['from_process_start_s']:.1f} s from process start, "
          f"warm {w['wall_s']:.2f} s: {w['total_tokens_per_s']:.0f} tok/s total, {w['output_tokens_per_s']:.0f} out, "
          f"{w['fraction_of_bound']:.0%} of the bound; TTFT p50 {w['ttft_ms']['p50']:.0f} ms, TPOT p50 "
          f"{w['tpot_ms']['p50']:.1f} ms; compiles after start-up {cold['compiles_after_startup']}", flush=True)
    if colocated is not None:
        from .serve_pd import print_ratio

        print_ratio(cold, colocated)
    if "warm_no_prefix_caching" in cold:
        off = cold["warm_no_prefix_caching"]
        print(f"prefix cache: hit rate {w['prefix_cache_hit_rate']:.0%}, warm {w['wall_s']:.2f} s, TTFT p50 "
              f"{w['ttft_ms']['p50']:.0f} ms; with it off {off['wall_s']:.2f} s, TTFT p50 {off['ttft_ms']['p50']:.0f} ms",
              flush=True)
    if not args.no_peer:
        requests = make_requests(args, _vocab(args), _tokenizer(args))
        try:
            from .transformers_peer import serve_peer

            payload["transformers"] = serve_peer(args, requests)
        except Exception as e:  # noqa: BLE001
            payload["transformers"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(f"transformers: {payload['transformers']}", flush=True)
    return payload


def _vocab(args) -> int:
    from ..model.config import PRESETS, ModelConfig

    if args.model in PRESETS:
        return PRESETS[args.model]().vocab_size
    return ModelConfig.from_json_file(os.path.join(args.model, "config.json")).vocab_size


def _tokenizer(args):
    from ..model.config import PRESETS
    from ..model.tokenizer import load_tokenizer

    return None if args.model in PRESETS else load_tokenizer(args.model)
