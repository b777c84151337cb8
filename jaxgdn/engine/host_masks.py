"""Masks the host computes for a request's logits rows: its grammar (structured output), min_tokens (its stop
tokens are masked until it has that many outputs) and bad_words (a word's last token is masked where the output
ends with the rest of the word).

A launch carries, for each logits row of such a request, the bitmask of the tokens it may take there
([rows * (1 + K), ceil(V / 32)] int32, only in launches that have one: split launches, sampler variant GUIDED), and
the step masks the logits with it before sampling and draft verification; logprobs stay those of the raw
distribution. A verify window is masked position by position: position k's mask is the state after the window's
drafts 1..k, so a draft the masks refuse is rejected, and the tokens equal those of the same request without MTP.
The next masks need the sampled tokens, so such a request waits for its launch's results before its next row,
and a launch with one runs a single model step; the other requests' rows go on asynchronously. A request whose
only rule is min_tokens is back to asynchronous once it has that many outputs.
"""

from __future__ import annotations

import functools

import numpy as np

from .structured import Grammars, words


class HostMasks:
    """One request's masks, with the interface of xgrammar's GrammarMatcher that launch_bitmask and the engine use.
    grammar: an xgrammar matcher or None; stop_ids: the tokens min_tokens masks; bad_words: token-id sequences;
    outputs: the request's output tokens so far."""

    def __init__(self, grammar, stop_ids, min_tokens: int, bad_words: list[tuple[int, ...]], outputs: list[int]):
        self.grammar, self.stop_ids, self.min_tokens = grammar, list(stop_ids), min_tokens
        self.bad_words = bad_words
        self.history = list(outputs)

    @property
    def active(self) -> bool:
        """Whether the request's next rows need masks from the host."""
        return self.grammar is not None or bool(self.bad_words) or len(self.history) < self.min_tokens

    def ban(self, mask: np.ndarray, index: int) -> None:
        """Clear, in row `index` of mask, the tokens min_tokens and bad_words refuse after the history."""
        banned = list(self.stop_ids) if len(self.history) < self.min_tokens else []
        for word in self.bad_words:
            if len(word) == 1 or tuple(self.history[-(len(word) - 1):]) == word[:-1]:
                banned.append(word[-1])
        row = mask[index].view(np.uint32)
        for t in banned:
            row[t // 32] &= np.uint32(0xFFFFFFFF ^ (1 << (t % 32)))

    def fill_next_token_bitmask(self, mask: np.ndarray, index: int) -> None:
        if self.grammar is not None:
            self.grammar.fill_next_token_bitmask(mask, index)
        self.ban(mask, index)

    def accept_token(self, token: int) -> bool:
        if self.grammar is not None and not self.grammar.accept_token(token):
            return False
        self.history.append(token)
        return True

    def rollback(self, n: int) -> None:
        if self.grammar is not None:
            self.grammar.rollback(n)
        del self.history[len(self.history) - n:]

    def is_terminated(self) -> bool:
        return self.grammar is not None and self.grammar.is_terminated()


def attach_host_masks(req, grammars: Grammars | None, eos_token_ids) -> str | None:
    """Give a request with structured_outputs, min_tokens or bad_words its HostMasks; the error message if it
    cannot have them (no tokenizer)."""
    sp = req.sampling_params
    stop_ids = (() if sp.ignore_eos else tuple(eos_token_ids)) + tuple(sp.stop_token_ids)
    if sp.structured_outputs is None and not sp.min_tokens and not sp.bad_words:
        return None
    if (sp.structured_outputs is not None or sp.bad_words) and grammars is None:
        return "structured_outputs and bad_words need the model's tokenizer (this engine has none)"
    grammar = grammars.matcher(sp.structured_outputs) if sp.structured_outputs is not None else None
    bad = []
    for word in sp.bad_words or ():
        for text in (word, " " + word):  # as vLLM: the word alone and after a space
            ids = tuple(grammars.tokenizer.encode(text))
            if ids and ids not in bad:
                bad.append(ids)
    req.host_masks = HostMasks(grammar, stop_ids, sp.min_tokens, bad,
                               [t for t in req.output_token_ids if t >= 0])
    return None


def needs_host_masks(req) -> bool:
    return req.host_masks is not None and req.host_masks.active


def launch_bitmask(rows, num_rows: int, width: int, vocab_size: int) -> np.ndarray | None:
    """The bitmask of a launch's logits rows [num_rows * width, words(V)] (all ones where unconstrained), or None
    when no sampling row needs one. Row b's position k is at b * width + k: the state after the request's tokens
    and the row's drafts 1..k (positions after a draft the masks refuse stay all ones; the verification rejects
    that draft before them)."""
    masked = [(b, row) for b, row in enumerate(rows) if row.samples and needs_host_masks(row.request)]
    if not masked:
        return None
    mask = np.full((num_rows * width, words(vocab_size)), -1, np.int32)
    grammars = [(b, row.request.host_masks.grammar) for b, row in masked if row.request.host_masks.grammar is not None]
    if grammars:
        _batch_matcher().batch_fill_next_token_bitmask([g for _, g in grammars], mask, [b * width for b, _ in grammars])
    for b, row in masked:
        m, accepted = row.request.host_masks, 0
        m.ban(mask, b * width)
        for draft in row.spec_tokens:  # (-1: a prompt tail's placeholder; a draft the last mask refuses ends it)
            allowed_there = draft >= 0 and mask[b * width + accepted, draft // 32] >> (draft % 32) & 1
            if not allowed_there or not m.accept_token(int(draft)):
                break
            accepted += 1
            m.fill_next_token_bitmask(mask, b * width + accepted)
        if accepted:
            m.rollback(accepted)
    return mask


@functools.cache
def _batch_matcher():
    """xgrammar's threaded filler of many matchers' bitmasks."""
    import xgrammar as xgr

    return xgr.BatchGrammarMatcher()
