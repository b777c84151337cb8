"""The shipped model's requests and engines for tests/test_structured.py and tests/test_penalties.py: one engine per
K (0 and 2) serves both modules' requests in one batch (building engines and their programs is most of these tests'
time). The two modules are in the xdist group "serve": one worker builds the engines once, and never while the
server's latency tests run (both are heavy on a two-core machine)."""

import functools

from jaxgdn import task
from jaxgdn.engine.config import EngineConfig
from jaxgdn.engine.request import SamplingParams
from jaxgdn.engine.structured import StructuredOutputsParams
from jaxgdn.generate import default_checkpoint
from jaxgdn.llm import LLM

SCHEMA = {  # a nested object, an enum, a bounded array (short names: the CPU runs every token of 200 outputs)
    "type": "object",
    "properties": {
        "id": {"type": "string", "maxLength": 4},
        "op": {"enum": ["add", "sub", "mul"]},
        "xs": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 2},
        "m": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False},
    },
    "required": ["id", "op", "xs", "m"],
    "additionalProperties": False,
}
CHOICES = ("forty-two", "seven", 'say "no"')
REGEX = r"[0-9]{3}-[a-z]{2,4}"
GRAMMAR = 'root ::= "x=" [0-9]+ (" + " [0-9]+)* "."'
NUM_SCHEMA = 100
PENALTY_CASES = [  # strong penalties: the shipped model is confident
    SamplingParams(temperature=0, max_tokens=30, repetition_penalty=2.0, frequency_penalty=2.0),
    SamplingParams(temperature=0, max_tokens=30, presence_penalty=2.0, logit_bias={20: 4.0, 23: -3.0}),
    SamplingParams(temperature=0, max_tokens=30, frequency_penalty=-2.0, repetition_penalty=0.5),
    SamplingParams(temperature=0.8, seed=5, max_tokens=40, frequency_penalty=1.5, repetition_penalty=1.5),
    SamplingParams(temperature=0.7, top_p=0.9, seed=9, max_tokens=40, presence_penalty=-1.0, logit_bias={30: 3.0}),
    SamplingParams(temperature=0, max_tokens=40),  # unpenalized, beside the others
]


def structured_requests():
    """100 JSON-schema requests (odd: greedy; even: seeded at temperature 0.8), then one each of choice, regex and
    EBNF, and two unconstrained greedy ones."""
    problems = task.take("test", NUM_SCHEMA + 5)
    schema = StructuredOutputsParams(json=SCHEMA)
    sps = [SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=60, structured_outputs=schema)
           for i in range(NUM_SCHEMA)]
    sps += [SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(**kw))
            for kw in (dict(choice=CHOICES), dict(regex=REGEX), dict(grammar=GRAMMAR))]
    sps += [SamplingParams(temperature=0, max_tokens=40)] * 2
    return [p.question[:48] for p in problems], sps  # short prompts: the outputs are what is tested


def penalty_prompts() -> list[str]:
    return [p.prompt() for p in task.take("test", len(PENALTY_CASES))]


@functools.cache
def served(K: int) -> dict:
    """With K drafts: "structured" (structured_requests' outputs), "cases" (PENALTY_CASES'), "rules" (min_tokens
    past the plain output's EOS, and bad_words of a word it writes), "plain" (the first two penalty prompts greedy,
    K = 0's), "word"; with K = 0 also "alone" (the two unconstrained structured requests served by themselves)."""
    config = EngineConfig(max_num_seqs=32, max_num_batched_tokens=512, max_model_len=512, dtype="float32",
                          precompile=False, num_speculative_tokens=K)
    prompts, sps = structured_requests()
    pen = penalty_prompts()
    with LLM(str(default_checkpoint()), config) as llm:
        out = {}
        if K == 0:
            out["plain"] = llm.generate(pen[:2], SamplingParams(temperature=0, max_tokens=200), use_tqdm=False)
            out["word"] = out["plain"][1].text.split()[1]  # a word the model writes unasked
        else:
            out["plain"], out["word"] = served(0)["plain"], served(0)["word"]
        rules = [SamplingParams(temperature=0, max_tokens=200, min_tokens=len(out["plain"][0].token_ids) + 15),
                 SamplingParams(temperature=0, max_tokens=200, bad_words=[out["word"]])]
        batch = llm.generate(prompts + pen + pen[:2], sps + PENALTY_CASES + rules, use_tqdm=False)
        n, m = len(prompts), len(PENALTY_CASES)
        out |= {"structured": batch[:n], "cases": batch[n : n + m], "rules": batch[n + m :]}
        if K == 0:
            out["alone"] = llm.generate(prompts[-2:], sps[-2:], use_tqdm=False)
    return out
