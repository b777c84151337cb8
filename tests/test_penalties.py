"""Penalties, logit bias, min_tokens and bad_words (vLLM's semantics): the device's penalties equal a numpy
reference position by position in verify windows; greedy tokens equal a full-recompute reference; greedy and
seeded tokens with MTP equal those without; min_tokens and bad_words hold."""

import dataclasses

import numpy as np
import pytest
from helpers import full_logits, shipped_model
from sampling_runs import PENALTY_CASES, served

from jaxgdn.engine import penalties
from jaxgdn.engine.request import SamplingParams

pytestmark = pytest.mark.xdist_group("serve")  # sampling_runs builds its engines once, on the server tests' worker


def reference_penalize(logits, prompt, outputs, sp):
    """numpy: logits [V] after sp's logit bias, repetition, frequency and presence penalties (vLLM's order)."""
    x = logits.astype(np.float64).copy()
    for t, v in sp.logit_bias or ():
        x[t] += v
    counts = np.bincount(np.asarray(outputs, int), minlength=x.size)[: x.size]
    seen = (counts > 0) | np.isin(np.arange(x.size), prompt)
    r = np.where(seen, sp.repetition_penalty, 1.0)
    x = np.where(x > 0, x / r, x * r)
    return x - sp.frequency_penalty * counts - sp.presence_penalty * (counts > 0)


@dataclasses.dataclass
class Slots:
    """The two EngineState fields penalties.seed writes."""

    output_counts: object
    prompt_tokens: object

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)


def test_device_penalties_equal_the_reference_at_each_verify_position():
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    R, K, V = 3, 2, 70
    logits = rng.standard_normal((R, K + 1, V)).astype(np.float32) * 3
    prompts = [list(rng.integers(0, V, 9)), list(rng.integers(0, V, 4)), [5]]
    outputs = [list(rng.integers(0, V, 6)), [], [7, 7, 7]]
    drafts = np.array([[3, 4], [9, -1], [7, 2]], np.int32)
    n_draft = np.array([2, 1, 0], np.int32)
    sps = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.7, logit_bias={3: 2.5}),
           SamplingParams(repetition_penalty=0.6, logit_bias={9: -100.0, 1: 7.0}),
           SamplingParams(frequency_penalty=-1.2)]
    state = Slots(jnp.zeros((5, V), jnp.int32), jnp.full((5, -(-V // 32)), -1, jnp.int32))  # garbage bits
    for slot in range(3):
        state = penalties.seed(state, slot + 1, prompts[slot], outputs[slot], penalties.SEED_BUCKET)
    rows = [type("Row", (), dict(samples=True, request=type("Q", (), dict(sampling_params=sp))())) for sp in sps]
    pen, bias = penalties.penalty_arrays(rows, R)
    slots = np.arange(1, R + 1)
    got = np.asarray(penalties.apply(jnp.asarray(logits), state.output_counts[slots], state.prompt_tokens[slots],
                                     jnp.asarray(drafts), jnp.asarray(n_draft), jnp.asarray(pen), jnp.asarray(bias)))
    for b in range(R):
        for k in range(1 + n_draft[b]):
            want = reference_penalize(logits[b, k], prompts[b], outputs[b] + list(drafts[b, :k]), sps[b])
            np.testing.assert_allclose(got[b, k], want, rtol=1e-5, atol=1e-4)
    counted = penalties.count(state.output_counts, jnp.asarray([1, 0, 4]), jnp.asarray([[3, 4, -1], [1, 1, 1], [2, -1, -1]]),
                              jnp.asarray([2, 0, 1]))
    assert np.asarray(counted[1, [3, 4]]).tolist() == [np.sum(np.equal(outputs[0], t)) + 1 for t in (3, 4)]
    assert int(counted.sum()) == sum(map(len, outputs)) + 3  # row 1 emitted nothing; slot 4 is out of range


CASES = PENALTY_CASES


@pytest.fixture(scope="session")
def runs():
    """{K: (outputs of CASES, the plain outputs, outputs of the rules requests, the bad word)} on the shipped model."""
    return {K: (served(K)["cases"], served(K)["plain"], served(K)["rules"], served(K)["word"]) for K in (0, 2)}


def test_greedy_penalized_tokens_equal_a_full_recompute_reference(runs):
    params, cfg, _ = shipped_model()
    outs = runs[0][0]
    for o, sp in zip(outs, CASES):
        if sp.temperature:
            continue
        prompt, ids = list(o.prompt_token_ids), list(o.prompt_token_ids)
        for _ in range(len(o.token_ids)):
            logits = full_logits(params, cfg, ids)[-1]
            ids.append(int(np.argmax(reference_penalize(logits, prompt, ids[len(prompt):], sp))))
        assert ids[len(prompt):] == o.token_ids
    assert outs[0].token_ids != runs[0][1][0].token_ids[: len(outs[0].token_ids)]  # the penalties changed the output


def test_mtp_keeps_greedy_and_seeded_penalized_tokens(runs):
    for part in (0, 2):
        assert [o.token_ids for o in runs[0][part]] == [o.token_ids for o in runs[2][part]]
    assert sum(o.num_accepted_drafts for o in runs[2][0]) > 0


def test_min_tokens_and_bad_words_hold(runs):
    _, plain, (longer, clean), word = runs[0]
    assert plain[0].finish_reason == "stop"
    assert len(longer.token_ids) >= len(plain[0].token_ids) + 15
    assert longer.token_ids[: len(plain[0].token_ids) - 1] == plain[0].token_ids[:-1]  # the same until the EOS
    assert word in plain[1].text and word not in clean.text


@pytest.mark.parametrize("kw, problem", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logit_bias={5: 101.0}), "logit_bias"), (dict(logit_bias={"x": 1.0}), "logit_bias"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens"), (dict(bad_words=[""]), "bad_words"),
])
def test_bad_penalties_are_refused(kw, problem):
    with pytest.raises(ValueError, match=problem):
        SamplingParams(**kw).validate()
