"""PD as two real processes, as deployed: `serve --role prefill` and `serve --role decode --prefill-url`, with
MTP. Over HTTP at concurrency 8 the tokens equal `python -m jaxgdn.eval`'s one-process engine's; the bug switch
(on the decode process) diverges at concurrency 8 and not at 1; lm-evaluation-harness scores the shipped task
against the plain server and the PD pair with jaxgdn.eval's accuracy. Handoff bytes from another configuration,
or cut short, fail that request alone."""

import asyncio
import json

import httpx
import pytest
from servers import ROOT, drained, free_port, serve_in_thread, serve_processes

from jaxgdn import eval as jeval
from jaxgdn import task
from jaxgdn.generate import default_checkpoint

pytestmark = pytest.mark.xdist_group("serve_pd")  # one worker starts the servers, once
MODEL = "qwen35-tiny-arith"
NUM_PROBLEMS = 8
EVAL_ARGS = jeval.parse_args(["--limit", str(NUM_PROBLEMS), "--dtype", "float32", "--max-model-len", "512",
                              "--max-num-batched-tokens", "256", "--quiet"])
PROBLEMS = task.take("test", NUM_PROBLEMS)
# the flags of eval's configuration at concurrency 16 (test_task_eval's too), with MTP K=1, for both PD processes
SERVE_ARGS = ["--max-num-seqs", "16", "--max-num-batched-tokens", "256", "--max-model-len", "512",
              "--num-kv-pages", str(1 + 16 * 32), "--dtype", "float32", "--no-precompile",
              "--num-speculative-tokens", "1", "--served-model-name", MODEL]


@pytest.fixture(scope="module")
def baseline():
    """jaxgdn.eval's baseline row (no PD, no MTP, one process) on the first test problems."""
    sc = jeval.ServeConfig("baseline", concurrency=16)
    return jeval.run_config(str(default_checkpoint()), [p.prompt() for p in PROBLEMS], [p.answer for p in PROBLEMS],
                            sc, EVAL_ARGS, None)


@pytest.fixture(scope="module")
def pd_servers():
    """(decode URL, bug-switched decode URL, prefill URL): one prefill process feeding two decode processes."""
    prefill_port = free_port()
    prefill_url = f"http://127.0.0.1:{prefill_port}"
    with serve_processes(["--role", "prefill", "--port", str(prefill_port), *SERVE_ARGS],
                         ["--role", "decode", "--prefill-url", prefill_url, *SERVE_ARGS],
                         ["--role", "decode", "--prefill-url", prefill_url, "--reproduce-pd-mtp-bug", *SERVE_ARGS]
                         ) as (_, decode, bug):
        yield decode, bug, prefill_url


def complete(url: str, concurrency: int, problems=PROBLEMS) -> list[list[int]]:
    """Each problem's greedy completion tokens from the server, at most `concurrency` requests at a time."""
    async def run():
        gate = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            async def one(p):
                async with gate:
                    r = await client.post("/v1/completions", json={
                        "model": MODEL, "prompt": p.prompt(), "max_tokens": EVAL_ARGS.max_tokens, "temperature": 0})
                    assert r.status_code == 200, r.text
                    return r.json()["choices"][0]["token_ids"]
            return await asyncio.wait_for(asyncio.gather(*(one(p) for p in problems)), timeout=600)
    return asyncio.run(run())


def test_two_process_pd_mtp_equals_one_process_and_the_bug_diverges_at_8_only(pd_servers, baseline):
    decode, bug, _ = pd_servers
    assert complete(decode, 8) == baseline.token_ids
    assert complete(bug, 1, PROBLEMS[:3]) == baseline.token_ids[:3]
    diverged = sum(a != b for a, b in zip(complete(bug, 8), baseline.token_ids))
    assert diverged > 0


def test_two_precompiled_pd_processes_compile_nothing_after_start_up(baseline):
    """The PD pair started as deployed (every program compiled at start-up): over HTTP at concurrency 8 they serve
    the baseline's tokens, with no JAX compile event in either process after start-up (their /metrics), and the
    prefill server holds no page or slot once every handoff was fetched."""
    from jaxgdn.bench.serve_http import _metric

    # every program compiled at start-up; smaller steps and fewer slots than the other servers' (fewer programs),
    # which greedy decoding does not see
    args = [a for a in SERVE_ARGS if a != "--no-precompile"]
    args[args.index("--max-num-batched-tokens") + 1], args[args.index("--max-num-seqs") + 1] = "64", "8"
    prefill_port = free_port()
    prefill_url = f"http://127.0.0.1:{prefill_port}"
    with serve_processes(["--role", "prefill", "--port", str(prefill_port), *args],
                         ["--role", "decode", "--prefill-url", prefill_url, *args]) as (_, decode):
        assert complete(decode, 8) == baseline.token_ids
        for url in (prefill_url, decode):
            metrics = httpx.get(url + "/metrics", timeout=30).text
            assert _metric(metrics, "jaxgdn_xla_compiles_after_startup") == 0, url
            assert _metric(metrics, "jaxgdn_compiles_after_startup") == 0, url
            assert _metric(metrics, "jaxgdn_gdn_slots_used") == 0, url


def test_bad_handoffs_fail_their_request_only(pd_servers, baseline):
    """Handoff bytes pushed to the decode server's /v1/handoff: cut short, or from another configuration (a
    different fingerprint), get a 400 naming the problem; the intact bytes are served."""
    from jaxgdn.engine.pd import Handoff
    from jaxgdn.model.tokenizer import load_tokenizer

    decode, _, prefill_url = pd_servers
    prompt = load_tokenizer(default_checkpoint()).encode(PROBLEMS[0].prompt())
    data = httpx.post(prefill_url + "/v1/prefill", timeout=120, json={
        "prompt_token_ids": prompt, "sampling_params": {"temperature": 0, "max_tokens": 8}}).content
    other = Handoff.from_bytes(data)
    other.fingerprint = "0" * 16
    for bad, message in ((data[: len(data) // 2], "truncated"), (other.to_bytes(), "another model or configuration")):
        r = httpx.post(decode + "/v1/handoff", content=bad, timeout=120)
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    r = httpx.post(decode + "/v1/handoff", content=data, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == baseline.token_ids[0][:8]


def test_a_json_schema_request_through_the_pd_pair(pd_servers):
    """Structured output across the two processes: the decode server's prefill request carries the schema."""
    decode, _, _ = pd_servers
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    r = httpx.post(decode + "/v1/completions", timeout=300, json={
        "model": MODEL, "prompt": PROBLEMS[0].prompt(), "max_tokens": 40, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"].lstrip().startswith("{")
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["text"])["answer"], int)


def lm_eval_accuracy(completions_url: str) -> float:
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"base_url": completions_url + "/v1/completions", "model": MODEL, "tokenizer_backend": None,
                    "tokenized_requests": False, "num_concurrent": 8, "max_retries": 1, "timeout": 300},
        tasks=["jaxgdn_arith"], task_manager=TaskManager(include_path=str(ROOT / "evals" / "lm_eval"),
                                                         include_defaults=False),
        limit=NUM_PROBLEMS, log_samples=False)
    return out["results"]["jaxgdn_arith"]["exact_match,none"]


def test_lm_eval_on_the_plain_server_and_the_pd_pair_equals_jaxgdn_eval(pd_servers, baseline):
    decode, _, _ = pd_servers
    config = jeval.engine_config(jeval.ServeConfig("baseline", concurrency=16), EVAL_ARGS)
    with serve_in_thread(str(default_checkpoint()), config, MODEL) as (plain, _):
        assert lm_eval_accuracy(plain) == pytest.approx(baseline.accuracy)
    assert lm_eval_accuracy(decode) == pytest.approx(baseline.accuracy)


def test_one_process_pd_behind_the_async_front_equals_the_baseline(baseline):
    """`serve --pd` (both workers in the server process, handoffs routed on the engine thread) serves the
    baseline's tokens; this front is what the HTTP routes drive."""
    from jaxgdn.llm import LLM
    from jaxgdn.serve.async_engine import AsyncEngine
    from jaxgdn.engine.request import SamplingParams

    config = jeval.engine_config(jeval.ServeConfig("pd+mtp", pd=True, num_speculative_tokens=1, concurrency=16),
                                 EVAL_ARGS)
    llm = LLM(str(default_checkpoint()), config)
    front = AsyncEngine(llm.engine, llm.prefill_worker).start()
    sp = SamplingParams(temperature=0, max_tokens=EVAL_ARGS.max_tokens)
    ids = [llm.tokenizer.encode(p.prompt()) for p in PROBLEMS]

    async def run():
        async def one(prompt):
            tokens = []
            async for delta in front.generate(prompt, sp):
                tokens += delta.token_ids
            return tokens
        return await asyncio.wait_for(asyncio.gather(*(one(p) for p in ids)), timeout=600)

    try:
        assert asyncio.run(run()) == baseline.token_ids
        snap = drained(front)
        assert snap["kv_pages_used"] == 0 and snap["slots_used"] == 0
    finally:
        front.shutdown()

