"""Structured output with xgrammar: a request's output held to a JSON schema, any JSON object, a regex, a choice
of strings or an EBNF grammar (vLLM's StructuredOutputsParams).

The host keeps one xgrammar matcher per constrained request, inside its `host_masks.HostMasks`: a launch carries
the bitmask of the tokens each logits row may take, and the step masks the logits with it (`allowed`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import re

import jax.numpy as jnp

# JSON output without free whitespace: a model cannot loop on it, and the text parses the same
JSON_SEPARATORS = (",", ":")


def _clean(error: Exception) -> str:
    """xgrammar's message without its time stamp and source location."""
    message = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(error)).strip()
    return re.sub(r"^Check failed: .*? is false: ", "", message)


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint: json (a JSON schema, as text or a dict), json_object (any JSON object), regex,
    choice (one of these strings) or grammar (EBNF, xgrammar's dialect of GBNF)."""

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self):
        if isinstance(self.json, dict):  # hashable, and the text the grammar cache keys on
            object.__setattr__(self, "json", json.dumps(self.json))
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))

    def validate(self) -> None:
        """Raise ValueError (starting "structured_outputs") naming the problem: none or several constraints, a bad
        schema, regex or grammar."""
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of json, json_object, regex, choice, grammar; "
                             f"got {given or 'none'}")
        if self.choice is not None and not (isinstance(self.choice, tuple) and self.choice
                                            and all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs: choice must be a non-empty list of non-empty strings")
        for key in ("json", "regex", "grammar"):
            if getattr(self, key) is not None and not isinstance(getattr(self, key), str):
                raise ValueError(f"structured_outputs: {key} must be {'a JSON schema' if key == 'json' else 'a string'}")
        if importlib.util.find_spec("xgrammar") is None:
            raise ValueError("structured_outputs needs xgrammar: pip install 'jaxgdn[structured]'")
        try:
            _grammar(self)
        except RuntimeError as e:
            raise ValueError(f"structured_outputs: invalid {given[0]}: {_clean(e)}") from None


@functools.lru_cache(maxsize=256)
def _grammar(params: StructuredOutputsParams):
    """The xgrammar Grammar of params (no tokenizer needed); RuntimeError for a bad one."""
    import xgrammar as xgr

    if params.json is not None:
        return xgr.Grammar.from_json_schema(params.json, any_whitespace=False, separators=JSON_SEPARATORS)
    if params.json_object:
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, separators=JSON_SEPARATORS)
    if params.regex is not None:
        return xgr.Grammar.from_regex(params.regex)
    if params.choice is not None:  # EBNF string literals take JSON's escapes
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice))
    return xgr.Grammar.from_ebnf(params.grammar)


class Grammars:
    """An engine's grammar compiler over its tokenizer's vocabulary (built on first use) and the matchers of its
    requests. tokenizer: a `model.tokenizer.Tokenizer` with a backend (tokenizers or transformers); vocab_size:
    the model's (ids past the tokenizer's are never allowed); stop_token_ids: the tokens that end an output once
    its grammar is complete."""

    def __init__(self, tokenizer=None, vocab_size: int = 0, stop_token_ids: tuple = (), encoded_vocab=None):
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, list(stop_token_ids)
        self.encoded_vocab = encoded_vocab

    @classmethod
    def synthetic(cls, vocab_size: int, stop_token_ids: tuple) -> "Grammars":
        """A stand-in vocabulary of vocab_size tokens for a model without a tokenizer (random-weight presets in
        benchmarks): every printable ASCII character, then the 2- and 3-character strings of them in order."""
        chars = [chr(c) for c in range(32, 127)]
        vocab, n = [], vocab_size
        for length in (1, 2, 3):
            for i in range(len(chars) ** length):
                if len(vocab) >= n:
                    break
                s, k = "", i
                for _ in range(length):
                    s, k = chars[k % len(chars)] + s, k // len(chars)
                vocab.append(s)
        for t in stop_token_ids:
            if t < len(vocab):
                vocab[t] = f"<|stop{t}|>"
        return cls(vocab_size=vocab_size, stop_token_ids=stop_token_ids, encoded_vocab=vocab)

    @functools.cached_property
    def compiler(self):
        import xgrammar as xgr

        if self.encoded_vocab is not None:
            info = xgr.TokenizerInfo(self.encoded_vocab, xgr.VocabType.RAW, vocab_size=self.vocab_size,
                                     stop_token_ids=self.stop_token_ids)
        else:
            info = xgr.TokenizerInfo.from_huggingface(_hf_tokenizer(self.tokenizer.backend), vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids or None)
        return xgr.GrammarCompiler(info)

    def matcher(self, params: StructuredOutputsParams):
        """A fresh matcher of params' grammar (compiled grammars are cached by the compiler; it rolls back any
        number of tokens)."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compiler.compile_grammar(_grammar(params)))


def _hf_tokenizer(backend):
    """A transformers tokenizer over backend (a `tokenizers.Tokenizer`, or already a transformers one)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=backend) if not hasattr(backend, "convert_ids_to_tokens") else backend


def words(vocab_size: int) -> int:
    """int32 words of a bitmask over vocab_size tokens."""
    return -(-vocab_size // 32)


def allowed(bitmask, vocab_size: int):
    """Device side: bitmask [N, words(V)] int32 -> [N, V] bool, token t allowed where bit t % 32 of word t // 32 is
    set."""
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size] == 1
