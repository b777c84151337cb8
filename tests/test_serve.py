"""The OpenAI server (`jaxgdn.serve`) on the shipped model, driven by real clients over 127.0.0.1: the `openai`
package and httpx. Greedy outputs equal LLM.generate's; errors have OpenAI's shape and touch no other request;
200 requests from 32 concurrent clients, some aborted midway, lose nothing and leave every page and slot free."""

import asyncio
import queue
import random

import httpx
import pytest
from servers import drained, serve_in_thread
from openai import AsyncOpenAI, OpenAI

from jaxgdn import task
from jaxgdn.engine.config import EngineConfig
from jaxgdn.engine.request import SamplingParams
from jaxgdn.generate import default_checkpoint
from jaxgdn.llm import LLM
from jaxgdn.serve.async_engine import AsyncEngine, EngineDead

CONFIG = EngineConfig(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=512, dtype="float32",
                      precompile=False)
pytestmark = pytest.mark.xdist_group("serve")  # one worker compiles the server's programs
MODEL = "qwen35-tiny-arith"
PROBLEMS = task.take("test", 200)


@pytest.fixture(scope="module")
def reference():
    """The offline engine of the same configuration (its compiled programs are the server's too)."""
    return LLM(str(default_checkpoint()), CONFIG)


@pytest.fixture(scope="module")
def server():
    with serve_in_thread(str(default_checkpoint()), CONFIG, MODEL) as (url, state):
        yield url, state


def greedy(n):
    return SamplingParams(temperature=0, max_tokens=n)


def assert_all_free(state):
    usage = drained(state.front)
    assert (usage["running"], usage["waiting"], usage["kv_pages_used"], usage["slots_used"]) == (0, 0, 0, 0), usage


def test_openai_client_completions_chat_streaming_equal_generate(server, reference):
    url, state = server
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    probs = PROBLEMS[:3]
    offline = reference.generate([p.prompt() for p in probs], greedy(96), use_tqdm=False)

    batch = client.completions.create(model=MODEL, prompt=[p.prompt() for p in probs], max_tokens=96, temperature=0)
    assert [c.text for c in batch.choices] == [o.text for o in offline]
    assert [c.model_extra["token_ids"] for c in batch.choices] == [o.token_ids for o in offline]
    assert batch.usage.completion_tokens == sum(len(o.token_ids) for o in offline)

    ids = client.completions.create(model=MODEL, prompt=offline[0].prompt_token_ids, max_tokens=96, temperature=0)
    assert ids.choices[0].text == offline[0].text and ids.choices[0].finish_reason == offline[0].finish_reason

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": probs[1].question}],
                                          max_tokens=96, temperature=0)
    assert chat.choices[0].message.content == offline[1].text

    chunks = list(client.completions.create(model=MODEL, prompt=probs[2].prompt(), max_tokens=96, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == offline[2].text
    assert len(chunks) > 1 and chunks[-1].choices[0].finish_reason == offline[2].finish_reason
    chat_chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": probs[2].question}], max_tokens=96, temperature=0,
        stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chat_chunks) == offline[2].text

    stopped = client.completions.create(model=MODEL, prompt=probs[0].prompt(), max_tokens=96, temperature=0, stop="\n")
    assert stopped.choices[0].text == offline[0].text.split("\n")[0] and stopped.choices[0].finish_reason == "stop"

    sampled = [client.completions.create(model=MODEL, prompt=probs[0].prompt(), max_tokens=24, temperature=5.0,
                                         seed=7, n=2) for _ in range(2)]
    assert [c.text for c in sampled[0].choices] == [c.text for c in sampled[1].choices]  # seeded: reproducible
    assert sampled[0].choices[0].text != sampled[0].choices[1].text  # choice i samples with seed + i

    before = drained(state.front).get("finished_abort", 0)
    with pytest.raises(httpx.TimeoutException):  # a client that hangs up on a long non-streaming request
        httpx.post(url + "/v1/completions", timeout=1.0, json={
            "model": MODEL, "prompt": probs[0].prompt(), "max_tokens": 400, "ignore_eos": True, "temperature": 0})
    assert drained(state.front)["finished_abort"] == before + 1  # aborted, its pages and slot freed

    assert client.models.list().data[0].id == MODEL
    assert httpx.get(url + "/health").json()["status"] == "ok"
    metrics = httpx.get(url + "/metrics").text
    assert "jaxgdn_kv_pages_used" in metrics and "jaxgdn_compiles_after_startup" in metrics
    assert_all_free(state)


@pytest.mark.parametrize("body, param", [
    ({"prompt": ""}, "prompt"),
    ({"prompt": "x", "model": "another-model"}, "model"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x" * 600}, "prompt"),  # past max_model_len
    ({"prompt": [10**6]}, "prompt"),  # outside the vocabulary
    ({"prompt": "x", "logprobs": 1}, "logprobs"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
])
def test_bad_requests_get_openai_errors(server, body, param):
    url, _ = server
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_200_requests_from_32_clients_some_aborted_lose_nothing(server, reference):
    """Mixed prompt lengths (a task prompt cut to 1-48 tokens, or whole one time in ten) and output lengths;
    every 7th request streams and hangs up after three chunks. Every other request's output equals the offline
    engine's, every request is accounted for, and the server ends with every KV page and request slot free."""
    url, state = server
    rng = random.Random(0)
    cut = lambda text: text if rng.random() < 0.1 else text[: rng.randint(1, 48)]  # noqa: E731
    jobs = [(cut(p.prompt()), rng.randint(1, 24), i % 7 == 3) for i, p in enumerate(PROBLEMS)]
    before = dict(state.front.snapshot)

    async def run_all():
        client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
        queue: asyncio.Queue = asyncio.Queue()
        for i, job in enumerate(jobs):
            queue.put_nowait((i, *job))
        results: dict[int, str | None] = {}

        async def worker():
            while not queue.empty():
                i, prompt, max_tokens, hang_up = queue.get_nowait()
                if hang_up:
                    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                                             temperature=0, stream=True)
                    n = 0
                    async for _ in stream:
                        n += 1
                        if n == 3:
                            break
                    await stream.close()
                    results[i] = None
                else:
                    r = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                                        temperature=0, stream=i % 2 == 0)
                    if i % 2 == 0:
                        results[i] = "".join([c.choices[0].text async for c in r])
                    else:
                        results[i] = r.choices[0].text

        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(32))), timeout=600)
        await client.close()
        return results

    results = asyncio.run(run_all())
    assert len(results) == len(jobs)
    kept = [i for i, (_, _, hang_up) in enumerate(jobs) if not hang_up]
    offline = reference.generate([jobs[i][0] for i in kept], [greedy(jobs[i][1]) for i in kept], use_tqdm=False)
    assert [results[i] for i in kept] == [o.text for o in offline]
    after = drained(state.front)  # the engine applies the last aborts on its next pass
    finished = sum(after.get(k, 0) - before.get(k, 0) for k in after if k.startswith("finished_"))
    assert finished == len(jobs)
    assert after.get("finished_abort", 0) - before.get("finished_abort", 0) <= len(jobs) - len(kept)
    assert after.get("finished_error", 0) == before.get("finished_error", 0)
    assert_all_free(state)


def test_shutdown_aborts_or_finishes_the_requests_in_flight(reference):
    """shutdown(abort=True) ends every request in flight with its tokens so far and finish_reason "abort";
    shutdown(abort=False) lets them finish. Either way each request gets its last delta and the pools drain;
    a request submitted afterwards is refused."""
    prompts = [reference.tokenizer.encode(p.prompt()) for p in PROBLEMS[:4]]
    for abort in (True, False):
        front = AsyncEngine(reference.engine).start()
        deltas: queue.Queue = queue.Queue()
        for i, ids in enumerate(prompts):
            front.submit(ids, greedy(64), lambda d, i=i: deltas.put((i, d)))
        first = deltas.get(timeout=120)  # a step has run
        front.shutdown(abort=abort, timeout=120)
        got = [first] + [deltas.get_nowait() for _ in range(deltas.qsize())]
        last = {i: d for i, d in got if d.finished}
        assert sorted(last) == list(range(len(prompts)))
        reasons = {d.finish_reason for d in last.values()}
        if abort:  # a request may have ended on its own in the step that ran before the abort
            assert "abort" in reasons and reasons <= {"abort", "stop", "length"}
        else:
            assert reasons <= {"stop", "length"}
        assert reference.engine.usage()["kv_pages_used"] == 0 and reference.engine.usage()["slots_used"] == 0
        with pytest.raises(EngineDead):
            front.submit(prompts[0], greedy(4), lambda d: None)

