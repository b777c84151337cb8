"""The server's engine in a process of its own (`serve/engine_process.py`, what `python -m jaxgdn.serve` runs for
role both): over HTTP its greedy outputs equal LLM.generate's, streams cut midway free their pages, bad requests
are refused in the API process; an engine process that dies fails the requests in flight and no later one hangs;
shutdown lets requests finish or aborts them."""

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI
from servers import ROOT, hang_up_after, serve_processes

from jaxgdn import task
from jaxgdn.bench.serve import make_requests
from jaxgdn.engine.config import EngineConfig
from jaxgdn.engine.request import SamplingParams
from jaxgdn.generate import default_checkpoint
from jaxgdn.llm import LLM
from jaxgdn.serve.async_engine import EngineDead
from jaxgdn.serve.engine_process import EngineClient

pytestmark = pytest.mark.xdist_group("serve")
MODEL = "qwen35-tiny-arith"
CONFIG = EngineConfig(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=512, dtype="float32",
                      precompile=False)
ARGS = ["--max-num-seqs", "16", "--max-num-batched-tokens", "256", "--max-model-len", "512", "--dtype", "float32",
        "--no-precompile", "--served-model-name", MODEL]
PROBLEMS = task.take("test", 40)


@pytest.fixture(scope="module")
def reference():
    return LLM(str(default_checkpoint()), CONFIG)


def greedy(n):
    return SamplingParams(temperature=0, max_tokens=n)


def test_server_with_engine_process_equals_generate(reference, tmp_path):
    rng = random.Random(0)
    jobs = [(p.prompt()[: rng.randint(8, 160)], rng.randint(1, 40), i % 5 == 2) for i, p in enumerate(PROBLEMS)]
    kept = [i for i, job in enumerate(jobs) if not job[2]]
    offline = reference.generate([jobs[i][0] for i in kept], [greedy(jobs[i][1]) for i in kept], use_tqdm=False)
    with serve_processes(ARGS) as (url,):
        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        batch = client.completions.create(model=MODEL, prompt=[jobs[i][0] for i in kept[:3]], max_tokens=40,
                                          temperature=0)
        want = reference.generate([jobs[i][0] for i in kept[:3]], greedy(40), use_tqdm=False)
        assert [c.model_extra["token_ids"] for c in batch.choices] == [o.token_ids for o in want]
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x" * 600}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"

        async def run_all():  # 40 requests from 16 clients, streaming and not; every 5th hangs up after 2 chunks
            aclient = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
            gate, results = asyncio.Semaphore(16), {}

            async def one(i, prompt, max_tokens, hang_up):
                async with gate:
                    r = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                                         temperature=0, stream=hang_up or i % 2 == 0)
                    if hang_up:
                        await hang_up_after(r, 2)
                    elif i % 2 == 0:
                        results[i] = "".join([c.choices[0].text async for c in r])
                    else:
                        results[i] = r.choices[0].text

            await asyncio.wait_for(asyncio.gather(*(one(i, *job) for i, job in enumerate(jobs))), timeout=300)
            await aclient.close()
            return results

        results = asyncio.run(run_all())
        assert [results[i] for i in kept] == [o.text for o in offline]
        for _ in range(100):  # the engine process applies the last aborts on its next pass
            metrics = httpx.get(url + "/metrics").text
            if 'jaxgdn_kv_pages_used{role="both"} 0.0' in metrics and 'jaxgdn_requests_running{role="both"} 0.0' in metrics:
                break
            time.sleep(0.1)
        assert 'jaxgdn_kv_pages_used{role="both"} 0.0' in metrics and 'jaxgdn_gdn_slots_used{role="both"} 0.0' in metrics

        # the serving benchmark's client against this server: every token counted, none lost
        out = tmp_path / "http.json"
        run = subprocess.run([sys.executable, "-m", "jaxgdn.bench", "serve", "--http", url, "--model",
                              str(default_checkpoint()), "--num-prompts", "12", "--input-len", "8", "40", "--output-len",
                              "4", "16", "--max-concurrency", "4", "--http-repeat", "0", "--out", str(out)],
                             capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert run.returncode == 0, run.stderr[-3000:]
        first = json.loads(out.read_text())["first"]
        args = argparse.Namespace(seed=0, num_prompts=12, dataset="random", input_len=[8, 40], output_len=[4, 16])
        assert first["errors"] == 0 and first["requests"] == 12
        assert first["output_tokens"] == first["server_generation_tokens"] == sum(o for _, o in make_requests(args, 99))
        assert 0 < first["ttft_ms"]["p50"] <= first["ttft_ms"]["p99"]


def test_engine_process_death_and_shutdown(reference):
    prompt = reference.tokenizer.encode(PROBLEMS[0].prompt())
    long = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)

    async def collect(client, params):
        deltas = [d async for d in client.generate(prompt, params)]
        return deltas[-1].finish_reason, sum(len(d.token_ids) for d in deltas)

    async def scenario():
        client = EngineClient(str(default_checkpoint()), CONFIG)
        assert (await collect(client, greedy(12)))[0] in ("stop", "length")
        finishing = asyncio.create_task(collect(client, greedy(8)))
        await asyncio.sleep(0)
        client.shutdown(abort=False, timeout=120)  # a request in flight finishes first
        assert (await finishing)[0] in ("stop", "length") and not client.process.is_alive()
        with pytest.raises(EngineDead):
            await collect(client, greedy(4))

        client = EngineClient(str(default_checkpoint()), CONFIG)
        running = asyncio.create_task(collect(client, long))
        deadline = time.monotonic() + 120
        while not client.snapshot.get("running"):
            assert client.alive and time.monotonic() < deadline, client.error
            await asyncio.sleep(0.05)
        client.process.kill()  # the engine process dies mid-request
        reason, _ = await asyncio.wait_for(running, 60)
        assert reason == "error" and not client.alive and "exited" in client.error
        with pytest.raises(EngineDead):
            await collect(client, greedy(4))
        client.shutdown()

    asyncio.run(scenario())
