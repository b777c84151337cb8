"""The soak benchmark's traffic: a realistic mix of OpenAI requests over the shipped task, and one client call per
request that checks what came back.

Each request draws its features independently: chat or completion, stream or not (some streams hang up midway),
n = 2, a seeded sample or greedy, logprobs, a JSON schema, a stop string, a few-shot prefix shared with other
requests (prefix-cache hits, and evictions once the pool of prefixes outgrows the cache), and its max_tokens.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time

from .. import task

ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
STOP = "####"  # every solution of the task ends "#### N": a stop string that fires
NUM_PREFIXES = 48  # few-shot prefixes, drawn Zipf-like: a few hot, many cold


@dataclasses.dataclass
class Mix:
    """Each feature's share of the requests."""

    chat: float = 0.25
    stream: float = 0.5
    hang_up: float = 0.1  # of all requests: a stream whose client leaves after a few chunks
    n2: float = 0.1
    seeded: float = 0.3  # temperature 0.8 with a seed (else greedy)
    logprobs: float = 0.1
    json_schema: float = 0.05
    stop: float = 0.15
    prefix: float = 0.6
    max_tokens: tuple[int, int] = (32, 160)


@dataclasses.dataclass
class SoakRequest:
    route: str  # /v1/completions or /v1/chat/completions
    body: dict
    features: list[str]
    hang_up_after: int | None = None  # chunks read before the client leaves


class Traffic:
    """Seeded requests of the mix over the task's test questions and few-shot prefixes of its train solutions."""

    def __init__(self, model: str, seed: int = 0, mix: Mix | None = None):
        self.model, self.mix, self.rng = model, mix or Mix(), random.Random(seed)
        self.questions = task.take("test", 256)
        shots = task.take("train", 3 * NUM_PREFIXES)
        self.prefixes = [tuple((p.question, p.solution) for p in shots[3 * i : 3 * i + 1 + i % 3])
                         for i in range(NUM_PREFIXES)]
        self.weights = [1 / (i + 1) for i in range(NUM_PREFIXES)]

    def next(self) -> SoakRequest:
        m, r = self.mix, self.rng
        shots = r.choices(self.prefixes, self.weights)[0] if r.random() < m.prefix else ()
        question = r.choice(self.questions).question
        features = ["prefix"] if shots else []
        chat = r.random() < m.chat
        body: dict = {"model": self.model, "max_tokens": r.randint(*m.max_tokens)}
        if chat:
            features.append("chat")
            messages = [x for q, a in shots for x in ({"role": "user", "content": q}, {"role": "assistant", "content": a})]
            body["messages"] = messages + [{"role": "user", "content": question}]
        else:
            body["prompt"] = task.format_prompt(question, shots)
        hang_up = r.random() < m.hang_up
        if hang_up or r.random() < (m.stream - m.hang_up) / (1 - m.hang_up):
            features.append("stream")
            body["stream"] = True
        if not hang_up and r.random() < m.n2:
            features.append("n2")
            body["n"] = 2
        if r.random() < m.seeded:
            features.append("seeded")
            body |= {"temperature": 0.8, "seed": r.randrange(1 << 31)}
        else:
            body["temperature"] = 0.0
        if r.random() < m.logprobs:
            features.append("logprobs")
            body |= {"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2}
        if r.random() < m.json_schema:
            features.append("json_schema")
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}
        elif r.random() < m.stop:
            features.append("stop")
            body["stop"] = [STOP]
        route = "/v1/chat/completions" if chat else "/v1/completions"
        return SoakRequest(route, body, features, r.randint(1, 4) if hang_up else None)


def probe_requests(model: str) -> list[SoakRequest]:
    """The greedy probes sent before and after the traffic: their tokens must not change."""
    questions = task.take("test", 4, seed_offset=10_000)
    shots = tuple((p.question, p.solution) for p in task.take("train", 2))
    return [SoakRequest("/v1/completions", {"model": model, "prompt": task.format_prompt(q.question, shots if i % 2 else ()),
                                            "max_tokens": 64, "temperature": 0.0}, ["probe"])
            for i, q in enumerate(questions)]


async def send(client, req: SoakRequest) -> dict:
    """Send one request (httpx.AsyncClient) and check its answer. Returns its outcome: status "ok", "hung_up" (the
    client left as planned) or "error" (with `error`); latency and (streams) TTFT in s; output tokens; the token
    ids of each choice."""
    t0 = time.perf_counter()
    out = {"features": req.features, "status": "ok", "tokens": 0}
    try:
        if req.body.get("stream"):
            choices = await _stream(client, req, out, t0)
        else:
            r = await client.post(req.route, json=req.body)
            if r.status_code != 200:
                raise _Failed(f"HTTP {r.status_code}: {r.text[:300]}")
            choices = {c["index"]: c for c in r.json()["choices"]}
            for c in choices.values():
                c["text"] = c["message"]["content"] if "message" in c else c["text"]
        if out["status"] == "ok":
            _check(req, choices)
            out["token_ids"] = [choices[i]["token_ids"] for i in sorted(choices)]
            out["tokens"] = sum(len(t) for t in out["token_ids"])
    except _Failed as e:
        out |= {"status": "error", "error": str(e)}
    except Exception as e:  # noqa: BLE001 - a transport failure is this request's, the run goes on
        out |= {"status": "error", "error": f"{type(e).__name__}: {e!r}"}
    out["latency"] = time.perf_counter() - t0
    return out


class _Failed(Exception):
    pass


async def _stream(client, req: SoakRequest, out: dict, t0: float) -> dict:
    """A streamed request's choices, each with its text, token ids, finish_reason and chunk count of logprobs."""
    choices: dict[int, dict] = {}
    chunks = 0
    async with client.stream("POST", req.route, json=req.body) as r:
        if r.status_code != 200:
            raise _Failed(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                raise _Failed(f"error event: {obj['error']}")
            for item in obj["choices"]:
                c = choices.setdefault(item["index"], {"text": "", "token_ids": [], "finish_reason": None, "logprobs": []})
                c["text"] += (item["delta"].get("content") or "") if "delta" in item else item["text"]
                c["token_ids"] += item.get("token_ids") or []
                c["finish_reason"] = item.get("finish_reason") or c["finish_reason"]
                if item.get("logprobs"):
                    c["logprobs"].append(item["logprobs"])
            if chunks == 0:
                out["ttft"] = time.perf_counter() - t0
            chunks += 1
            if req.hang_up_after is not None and chunks >= req.hang_up_after:
                out["status"] = "hung_up"
                break  # leaving the block closes the connection mid-stream
    return choices


def _check(req: SoakRequest, choices: dict) -> None:
    """What every answer must satisfy: n choices, each finished, with logprobs when asked, schema-valid JSON when
    a schema ended it, no stop string in its text."""
    n = req.body.get("n", 1)
    if sorted(choices) != list(range(n)):
        raise _Failed(f"choices {sorted(choices)}, asked for n={n}")
    for i, c in choices.items():
        reason, text = c.get("finish_reason"), c["text"]
        if reason not in ("stop", "length"):
            raise _Failed(f"choice {i} finished with {reason!r}: {c.get('error')}")
        if "logprobs" in req.features and not c.get("logprobs") and c["token_ids"]:
            raise _Failed(f"choice {i} has no logprobs")
        if "json_schema" in req.features and reason == "stop":
            try:
                value = json.loads(text)
            except ValueError:
                raise _Failed(f"choice {i} stopped on invalid JSON: {text[:200]!r}") from None
            if not isinstance(value, dict) or not isinstance(value.get("answer"), int):
                raise _Failed(f"choice {i} does not follow the schema: {text[:200]!r}")
        if "stop" in req.features and STOP in text:
            raise _Failed(f"choice {i} contains its stop string: {text[-100:]!r}")
