"""Structured output (xgrammar) on the shipped model: 100 requests held to a JSON schema give outputs that parse and
validate, with MTP on and off; greedy and seeded tokens with MTP equal those without (verify windows masked position by
position); regex, choice and EBNF constraints; the other requests of a batch are untouched; bad constraints are
refused with a message naming the problem."""

import json
import re

import jsonschema
import pytest

from sampling_runs import CHOICES, NUM_SCHEMA, REGEX, SCHEMA, served

from jaxgdn.engine.host_masks import HostMasks, launch_bitmask
from jaxgdn.engine.request import SamplingParams
from jaxgdn.engine.structured import StructuredOutputsParams

pytestmark = pytest.mark.xdist_group("serve")  # sampling_runs builds its engines once, on the server tests' worker


@pytest.fixture(scope="session")
def outputs():
    """{K: (structured_requests' outputs, the unconstrained two served alone (K = 0) or None)}."""
    return {K: (served(K)["structured"], served(K).get("alone")) for K in (0, 2)}


@pytest.mark.parametrize("K", [0, 2])
def test_json_schema_outputs_parse_and_validate(outputs, K):
    outs = outputs[K][0]
    for o in outs[:NUM_SCHEMA]:
        assert o.finish_reason == "stop", (o.text, o.finish_reason)
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert len({o.text for o in outs[:NUM_SCHEMA]}) > NUM_SCHEMA // 2  # the prompts and the noise do shape them


@pytest.mark.parametrize("K", [0, 2])
def test_choice_regex_and_grammar_constraints_hold(outputs, K):
    choice, regex, grammar = outputs[K][0][NUM_SCHEMA : NUM_SCHEMA + 3]
    assert choice.text in CHOICES and choice.finish_reason == "stop"
    assert re.fullmatch(REGEX, regex.text), regex.text
    assert re.fullmatch(r"x=[0-9]+( \+ [0-9]+)*\.", grammar.text) or grammar.finish_reason == "length", grammar.text


def test_mtp_keeps_greedy_and_seeded_tokens_and_drafts_outside_the_grammar_are_rejected(outputs):
    plain, mtp = outputs[0][0], outputs[2][0]
    assert [o.token_ids for o in plain] == [o.token_ids for o in mtp]
    drafted = sum(o.num_drafted for o in mtp[:NUM_SCHEMA])
    accepted = sum(o.num_accepted_drafts for o in mtp[:NUM_SCHEMA])
    assert 0 < accepted < drafted  # the model's own drafts: many in the grammar, some not


def test_unconstrained_requests_are_untouched_by_constrained_ones_beside_them(outputs):
    alone = [o.token_ids for o in outputs[0][1]]
    for K in (0, 2):  # (greedy tokens with MTP are those without)
        batch = outputs[K][0]
        assert [o.token_ids for o in batch[-2:]] == alone
        assert not all(c in "{}[]\":,0123456789" for c in batch[-1].text)  # free text, not JSON


def test_a_launch_masks_each_verify_position_after_the_drafts_before_it():
    import xgrammar as xgr

    vocab = ["a", "b", "c", "<eos>"]
    info = xgr.TokenizerInfo(vocab, vocab_size=4, stop_token_ids=[3])
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar('root ::= "ab" [c]*'))
    masks = HostMasks(matcher, stop_ids=[3], min_tokens=0, bad_words=[], outputs=[])
    row = type("Row", (), dict(samples=True, spec_tokens=[0, 2, 2], request=type("Req", (), dict(host_masks=masks))()))()
    mask = launch_bitmask([row], 2, 4, 4)
    bits = lambda r: [t for t in range(4) if mask[r, 0] >> t & 1]  # noqa: E731
    assert bits(0) == [0]  # "a" first
    assert bits(1) == [1]  # after draft "a": "b"
    assert bits(2) == [0, 1, 2, 3]  # draft "c" is outside the grammar: the window stops there, later rows unused
    assert all(mask[4:].ravel() == -1)  # the padding row
    assert matcher.accept_token(0) and matcher.accept_token(1)  # the matcher was rolled back
    free = type("Row", (), dict(samples=True, spec_tokens=[], request=type("Req", (), dict(host_masks=None))()))()
    assert launch_bitmask([free], 1, 4, 4) is None  # no constrained row: the launch's program has no mask
    rules = HostMasks(None, stop_ids=[3], min_tokens=2, bad_words=[(0, 1), (2,)], outputs=[0])
    row.request.host_masks, row.spec_tokens = rules, [0, 1]
    mask = launch_bitmask([row], 1, 4, 4)
    assert bits(0) == [0]  # after "a": "b" completes the bad word "ab", "c" is one, EOS waits for 2 outputs
    assert bits(1) == [0, 3]  # after draft "a" (2 outputs): EOS allowed, "b" still not
    assert bits(2) == bits(3) == [0, 1, 2, 3]  # draft "b" is refused there: the window ends
    assert rules.history == [0]


@pytest.mark.parametrize("kw, problem", [
    (dict(json={"type": "objecx"}), 'invalid json: Unsupported type "objecx"'),
    (dict(json="{not json"), "invalid json: Failed to parse JSON"),
    (dict(regex="(ab"), "invalid regex"),
    (dict(grammar="root ::= foo"), 'Rule "foo" is not defined'),
    (dict(choice=[]), "choice must be a non-empty list"),
    (dict(regex="a", choice=["x"]), "exactly one of"),
    (dict(), "exactly one of"),
])
def test_bad_constraints_are_refused_with_the_problem(kw, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        SamplingParams(structured_outputs=StructuredOutputsParams(**kw)).validate()
