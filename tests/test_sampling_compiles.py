"""Every sampling feature runs on programs compiled at start-up (engine/split_step.py): once `LLM(...)` returns, a
batch mixing logprobs, prompt logprobs, penalties, logit bias, min_tokens, bad_words, grammars, seeds, top-k and
top-p causes no JAX compile event, and its plain greedy requests keep the tokens they get alone."""

import json

import pytest

from jaxgdn.engine.compile_times import CompileEvents
from jaxgdn.engine.config import EngineConfig
from jaxgdn.engine.request import SamplingParams
from jaxgdn.engine.structured import StructuredOutputsParams
from jaxgdn.generate import default_checkpoint
from jaxgdn.llm import LLM

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
          "additionalProperties": False}


def features() -> list[SamplingParams]:
    greedy = dict(temperature=0, max_tokens=8)
    return [
        SamplingParams(**greedy),
        SamplingParams(**greedy, logprobs=3),
        SamplingParams(**greedy, prompt_logprobs=2),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=3, max_tokens=8, logprobs=0),
        SamplingParams(**greedy, presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.3),
        SamplingParams(**greedy, logit_bias={20: 3.0}),
        SamplingParams(temperature=0, max_tokens=12, min_tokens=10),
        SamplingParams(**greedy, bad_words=["the"]),
        SamplingParams(temperature=0, max_tokens=16, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
        SamplingParams(temperature=0.7, seed=5, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[a-c]{4}")),
        SamplingParams(temperature=0.9, seed=1, max_tokens=8),
        SamplingParams(**greedy),
    ]


@pytest.mark.parametrize("K", [0, 1])
def test_no_sampling_feature_compiles_after_start_up(K):
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, dtype="float32",
                          num_speculative_tokens=K)
    prompts = ["What is 3 + 4?", "Name a colour.", "Count to five.", "Say hello."] * 3
    sps = features()
    with LLM(str(default_checkpoint()), config) as llm:
        with CompileEvents() as events:
            outs = llm.generate(prompts, sps, use_tqdm=False)
            alone = llm.generate([prompts[0], prompts[-1]], [sps[0], sps[-1]], use_tqdm=False)
        assert events.count == 0, dict(events.names)
        assert llm.compiles_after_startup == 0
    assert all(o.error is None for o in outs)
    assert [outs[0].token_ids, outs[-1].token_ids] == [a.token_ids for a in alone]
    assert len(outs[1].logprobs) == len(outs[1].token_ids) and len(outs[3].logprobs) == len(outs[3].token_ids)
    assert len(outs[2].prompt_logprobs) == len(outs[2].prompt_token_ids)
    assert len(outs[6].token_ids) >= 10
    assert 0 <= json.loads(outs[8].text)["n"] <= 9
    assert len(outs[9].text) == 4 and set(outs[9].text) <= set("abc")
