"""The OpenAI server (`jaxgdn.serve`) on the shipped model, driven by real clients over 127.0.0.1: the `openai`
package and httpx. Greedy outputs equal LLM.generate's; errors have OpenAI's shape and touch no other request;
200 requests from 32 concurrent clients, some aborted midway, lose nothing and leave every page and slot free."""

import asyncio
import gc
import json
import logging
import queue
import random
import re
import threading
import time
import warnings
from pathlib import Path

import httpx
import openai
import pytest
from servers import aborts_after, drained, hang_up_after, serve_in_thread
from openai import AsyncOpenAI, OpenAI

from jaxgdn import task
from jaxgdn.engine.config import EngineConfig
from jaxgdn.engine.request import SamplingParams
from jaxgdn.engine.structured import StructuredOutputsParams
from jaxgdn.generate import default_checkpoint
from jaxgdn.llm import LLM
from jaxgdn.serve.async_engine import AsyncEngine, EngineDead

CONFIG = EngineConfig(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=512, dtype="float32",
                      precompile=False, prefix_cache_state_interval=32)
pytestmark = pytest.mark.xdist_group("serve")  # one worker compiles the server's programs
MODEL = "qwen35-tiny-arith"
PROBLEMS = task.take("test", 200)
ROOT = Path(__file__).resolve().parent.parent


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
            "model": MODEL, "prompt": probs[0].prompt(), "max_tokens": 340, "ignore_eos": True, "temperature": 0})
    assert aborts_after(state.front, before + 1) == before + 1  # aborted, its pages and slot freed

    assert client.models.list().data[0].id == MODEL
    assert httpx.get(url + "/health").json()["status"] == "ok"
    metrics = httpx.get(url + "/metrics").text
    assert "jaxgdn_kv_pages_used" in metrics and "jaxgdn_compiles_after_startup" in metrics
    assert_all_free(state)


def test_chat_requests_sharing_a_long_prefix_report_cached_tokens(server, reference):
    """Two chat requests that share their first turns (a solved example: a prefix of 150+ tokens): the second
    reports cached prompt tokens, and both answer as LLM.generate does."""
    url, _ = server
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    shots = PROBLEMS[10:11]
    history = [m for p in shots for m in ({"role": "user", "content": p.question},
                                          {"role": "assistant", "content": p.solution})]
    usages = []
    for p in PROBLEMS[20:22]:
        r = client.chat.completions.create(model=MODEL, messages=history + [{"role": "user", "content": p.question}],
                                           max_tokens=32, temperature=0)
        text = task.format_prompt(p.question, tuple((s.question, s.solution) for s in shots))  # the chat template's
        offline = reference.generate([text], greedy(32), use_tqdm=False)[0]
        assert r.choices[0].message.content == offline.text
        assert r.usage.prompt_tokens == len(offline.prompt_token_ids)
        usages.append(r.usage.prompt_tokens_details.cached_tokens)
    assert len(offline.prompt_token_ids) > 150 and usages[1] > 0
    assert "jaxgdn_prefix_cache_hits" in httpx.get(url + "/metrics").text


def test_logprobs_echo_and_prompt_scoring_through_the_openai_client(server, reference):
    """Completions' logprobs (streamed too), echo with max_tokens 0 (how lm-eval scores a prompt) and chat's
    logprobs/top_logprobs carry the values LLM.generate reports."""
    url, _ = server
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    prompt = PROBLEMS[30].prompt()
    offline = reference.generate([prompt], SamplingParams(temperature=0, max_tokens=12, logprobs=3, prompt_logprobs=3),
                                 use_tqdm=False)[0]
    expected = [e[t].logprob for t, e in zip(offline.token_ids, offline.logprobs)]
    expected_prompt = [e[t].logprob for t, e in zip(offline.prompt_token_ids[1:], offline.prompt_logprobs[1:])]

    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert r.choices[0].model_extra["token_ids"] == offline.token_ids
    assert lp.token_logprobs == pytest.approx(expected, abs=1e-5)
    assert all(1 <= len(top) <= 4 for top in lp.top_logprobs) and "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]

    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=3, stream=True) if c.choices[0].logprobs]
    assert [x for c in streamed for x in c.token_logprobs] == pytest.approx(expected, abs=1e-5)

    scored = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    c = scored.choices[0]
    assert c.text == prompt and c.model_extra["token_ids"] == [] and scored.usage.completion_tokens == 0
    assert c.logprobs.token_logprobs[0] is None and len(c.logprobs.tokens) == len(offline.prompt_token_ids)
    assert c.logprobs.token_logprobs[1:] == pytest.approx(expected_prompt, abs=1e-5)

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROBLEMS[30].question}],
                                          max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(x.top_logprobs) == 2 for x in content)
    assert "".join(x.token for x in content) == chat.choices[0].message.content
    assert all(x.top_logprobs[0].logprob >= x.logprob - 1e-6 for x in content)


def test_lm_eval_loglikelihood_task_through_the_server_scores_as_llm_does(server, reference):
    """The multiple-choice task (evals/lm_eval/jaxgdn_arith_mc.yaml) through lm-eval's local-completions with the
    server's /tokenize: each choice's loglikelihood equals LLM's own prompt-logprobs scoring, so the accuracy does."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from jaxgdn import eval as jeval

    url, _ = server
    n = 12
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"base_url": url + "/v1/completions", "model": MODEL, "tokenizer_backend": "remote",
                    "num_concurrent": 8, "max_retries": 1, "timeout": 300},
        tasks=["jaxgdn_arith_mc"], task_manager=TaskManager(include_path=str(ROOT / "evals" / "lm_eval"),
                                                            include_defaults=False),
        limit=n, log_samples=True)
    served = {s["doc_id"]: [float(r[0]) for r in s["filtered_resps"]] for s in out["samples"]["jaxgdn_arith_mc"]}
    offline = jeval.choice_loglikelihoods(reference, PROBLEMS[:n])
    assert [served[i] for i in range(n)] == [pytest.approx(s, abs=1e-3) for s in offline]
    accuracy = out["results"]["jaxgdn_arith_mc"]["acc,none"]
    assert accuracy == jeval.multiple_choice_accuracy(reference, PROBLEMS[:n]) and accuracy > 0.6  # chance: 0.25


def test_structured_output_through_the_openai_client(server, reference):
    import jsonschema

    url, state = server
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}, "unit": {"enum": ["apples", "pears"]}},
              "required": ["answer", "unit"], "additionalProperties": False}
    question = PROBLEMS[0].question
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    jsonschema.validate(json.loads(chat.choices[0].message.content), schema)
    assert chat.choices[0].finish_reason == "stop"
    chunks = client.completions.create(model=MODEL, prompt=question, max_tokens=60, temperature=0, stream=True,
                                       extra_body={"structured_outputs": {"json": schema}})
    streamed = "".join(c.choices[0].text for c in chunks)
    offline = reference.generate([question], SamplingParams(temperature=0, max_tokens=60, structured_outputs=(
        StructuredOutputsParams(json=schema))), use_tqdm=False)[0]
    assert streamed == offline.text and json.loads(streamed)["unit"] in ("apples", "pears")
    for extra, allowed in (({"guided_choice": ["yes", "no"]}, ("yes", "no")),
                           ({"guided_regex": "[0-9]{2}-[a-z]{2}"}, None)):
        text = client.completions.create(model=MODEL, prompt=question, max_tokens=20, temperature=0.8, seed=3,
                                         extra_body=extra).choices[0].text
        assert text in allowed if allowed else re.fullmatch("[0-9]{2}-[a-z]{2}", text), text
    assert_all_free(state)


def test_penalties_bias_and_rules_through_the_openai_client(server, reference):
    url, state = server
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    question = PROBLEMS[1].prompt()
    fields = dict(presence_penalty=1.0, frequency_penalty=1.5, repetition_penalty=1.8, min_tokens=3, bad_words=["so"])
    offline = reference.generate([question], SamplingParams(temperature=0, max_tokens=40, logit_bias={20: 2.0}, **fields),
                                 use_tqdm=False)[0]
    served = client.completions.create(model=MODEL, prompt=question, max_tokens=40, temperature=0,
                                       presence_penalty=1.0, frequency_penalty=1.5, logit_bias={"20": 2.0},
                                       extra_body=dict(repetition_penalty=1.8, min_tokens=3, bad_words=["so"]))
    assert served.choices[0].text == offline.text and "so" not in offline.text
    assert_all_free(state)


@pytest.mark.parametrize("body, param", [
    ({"prompt": ""}, "prompt"),
    ({"prompt": "x", "model": "another-model"}, "model"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x" * 600}, "prompt"),  # past max_model_len
    ({"prompt": [10**6]}, "prompt"),  # outside the vocabulary
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "logprobs": True}, "logprobs"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objecx"}}}},
     "response_format"),
    ({"prompt": "x", "response_format": {"type": "xml"}}, "response_format"),
    ({"prompt": "x", "guided_regex": "(a"}, "guided_regex"),
    ({"prompt": "x", "structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"prompt": "x", "guided_choice": ["a"], "guided_regex": "a"}, "guided_regex"),  # two constraints
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "x", "logit_bias": {"100000": 1}}, "logit_bias"),  # outside the vocabulary
    ({"prompt": "x", "logit_bias": {"5": 200}}, "logit_bias"),
    ({"prompt": "x", "max_tokens": 5, "min_tokens": 9}, "min_tokens"),
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
                    await hang_up_after(await client.completions.create(
                        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True), 3)
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



# ------------------------------------------------------------------------------------ adversarial input
class HealthPoller:
    """Polls /health from a thread for as long as it is entered; `worst` is the slowest answer in seconds."""

    def __init__(self, url):
        self.url, self.times, self.stop = url, [], threading.Event()

    def __enter__(self):
        def poll():
            with httpx.Client(base_url=self.url, timeout=30) as c:
                while not self.stop.is_set():
                    t0 = time.perf_counter()
                    assert c.get("/health").status_code == 200
                    self.times.append(time.perf_counter() - t0)
                    time.sleep(0.005)

        for _ in range(3):
            httpx.get(self.url + "/health")
        self.thread = threading.Thread(target=poll, daemon=True)
        self.thread.start()
        time.sleep(0.1)
        return self

    def __exit__(self, *exc):
        time.sleep(0.1)
        self.stop.set()
        self.thread.join(30)

    @property
    def worst(self) -> float:
        return max(self.times)


def post_raw(url, path, data: bytes):
    return httpx.post(url + path, content=data, headers={"content-type": "application/json"}, timeout=120)


def assert_openai_error(r, status, param=None, kind="invalid_request_error"):
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["type"] == kind and error["message"], error
    if param is not None:
        assert error["param"] == param, error


def test_huge_prompts_are_refused_without_blocking_the_event_loop(server):
    """Multi-megabyte prompts (text, token ids, chat) are refused before they are parsed or tokenized, and a
    long text that is tokenized is tokenized off the event loop: /health answers within 100 ms throughout."""
    url, state = server
    huge = "a " * 5_242_880
    # the bodies are serialized before polling: the server runs in this process, so a json.dumps here would
    # hold the GIL and delay /health on the test's account
    completion, ids, chat = ({"prompt": huge}, {"prompt": [[5] * 300_000] * 4},
                             {"messages": [{"role": "user", "content": huge}]})
    long_completion, long_chat = {"prompt": huge[:900_000]}, {"messages": [{"role": "user", "content": huge[:900_000]}]}
    bodies = [json.dumps(b).encode() for b in (completion, ids, chat, long_completion, long_chat)]
    with HealthPoller(url) as health:
        assert_openai_error(post_raw(url, "/v1/completions", bodies[0]), 413)
        assert_openai_error(post_raw(url, "/v1/completions", bodies[1]), 413)
        assert_openai_error(post_raw(url, "/v1/chat/completions", bodies[2]), 413)
        # within the body limit, yet more characters than max_model_len tokens can hold: refused untokenized
        assert_openai_error(post_raw(url, "/v1/completions", bodies[3]), 400, "prompt")
        assert_openai_error(post_raw(url, "/v1/chat/completions", bodies[4]), 400, "messages")
    assert health.worst < 0.1, health.worst

    # a text that passes the size check is tokenized in a worker thread (the engine then refuses its length)
    per_token, state.max_request_bytes = state.tokenizer.max_token_bytes, 1 << 24
    state.tokenizer.max_token_bytes = 10_000
    try:
        body = json.dumps({"prompt": huge[:1_000_000]}).encode()
        with HealthPoller(url) as health:
            r = post_raw(url, "/v1/completions", body)
        assert_openai_error(r, 400, "prompt")
        assert "1000000 tokens" in r.json()["error"]["message"]
        assert health.worst < 0.1, health.worst
    finally:
        state.tokenizer.max_token_bytes, state.max_request_bytes = per_token, None


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", b'{"prompt": "a\\ud800b"}', "prompt"),  # a lone surrogate
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages"),
    ("/v1/completions", b'{"prompt": "caf\xe9"}', None),  # invalid UTF-8 in the body
    ("/v1/completions", b'{"prompt": "x", "n": "many"}', "n"),  # pydantic's validation
    ("/v1/completions", b'{"prompt": "x", "seed": 1180591620717411303424}', "seed"),  # 2**70
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 1000000000}', "max_tokens"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 600}', "max_tokens"),  # prompt + max_tokens > max_model_len
    ("/v1/completions", b'{"prompt": "x", "temperature": 1e308}', "temperature"),
    ("/v1/completions", b'{"prompt": "x", "top_k": 1180591620717411303424}', "top_k"),
])
def test_malformed_input_gets_400_in_openai_shape(server, path, body, param):
    url, _ = server
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. no overflow in a cast
        assert_openai_error(post_raw(url, path, body), 400, param)


def test_unknown_route_gets_openai_shape(server):
    url, _ = server
    assert_openai_error(httpx.get(url + "/v1/nothing"), 404)


def test_seeds_are_64_bit(server):
    url, _ = server
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    sample = lambda seed: client.completions.create(  # noqa: E731
        model=MODEL, prompt=PROBLEMS[0].prompt(), max_tokens=24, temperature=5.0, seed=seed).choices[0].text
    texts = {seed: sample(seed) for seed in (0, 2**32, -(2**32), 2**63 - 1, 2**64 - 1)}
    assert len(set(texts.values())) == len(texts), texts
    assert sample(2**64 - 1) == texts[2**64 - 1] and sample(-1) == texts[2**64 - 1]  # modulo 2**64


def test_timeout_is_an_error_not_a_cut_off_answer(server):
    """A request that runs past --request-timeout: a non-streaming one gets 408 in OpenAI's shape, a stream
    ends with an error event (which the openai client raises); both are aborted and free their pages."""
    url, state = server
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    body = dict(model=MODEL, prompt=PROBLEMS[0].prompt(), max_tokens=340, temperature=0, extra_body={"ignore_eos": True})
    state.request_timeout = 0.3
    try:
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(**body)
        assert e.value.status_code == 408 and e.value.body["type"] == "timeout_error"
        with pytest.raises(openai.APIError, match="request-timeout"):
            for _ in client.completions.create(**body, stream=True):
                pass
    finally:
        state.request_timeout = None
    assert_all_free(state)


def test_client_hang_up_is_aborted_quietly(server, caplog):
    """A client that hangs up on non-streaming requests: each is aborted, and nothing but a line per request
    is logged (no never-retrieved exception of a cancelled choice)."""
    url, state = server
    before = drained(state.front).get("finished_abort", 0)
    body = {"model": MODEL, "prompt": PROBLEMS[0].prompt(), "max_tokens": 340, "ignore_eos": True, "n": 3}
    with caplog.at_level(logging.INFO):
        for _ in range(3):
            with pytest.raises(httpx.TimeoutException):
                httpx.post(url + "/v1/completions", timeout=0.5, json=body)
        assert aborts_after(state.front, before + 9) == before + 9
        gc.collect()
    noisy = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not noisy, [r.getMessage() for r in noisy]
    assert sum("hung up" in r.getMessage() for r in caplog.records) <= 3
    assert_all_free(state)
