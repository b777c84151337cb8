"""OpenAI's logprobs shapes, built from the engine's raw entries ((token, logprob, rank, ((id, logprob), ...)),
`logprobs.Scores.entry`)."""

from __future__ import annotations

import math
from typing import Callable

from ..engine.logprobs import entry_dict


def _finite(x: float) -> float:
    """JSON has no -inf: a token the model rules out gets the most negative float, as vLLM sends -9999.0."""
    return x if math.isfinite(x) else -9999.0


class CompletionLogprobs:
    """/v1/completions' `logprobs` object, grown as tokens arrive: tokens, token_logprobs, top_logprobs (the token's
    and the top ones' texts to their logprobs) and text_offset (each token's start in the choice's text)."""

    def __init__(self, decode: Callable[[list[int]], str], offset: int = 0):
        self.decode, self.offset = decode, offset

    def add(self, token_ids: list[int], entries: list) -> dict:
        """The object for these tokens (entries: one per token, None where unscored: the prompt's first)."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, entry in zip(token_ids, entries):
            text = self.decode([token])
            out["tokens"].append(text)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            _, lp, _, top = entry
            out["token_logprobs"].append(_finite(lp))
            tops = {text: _finite(lp)}
            for t, v in top:
                tops.setdefault(self.decode([t]), _finite(v))
            out["top_logprobs"].append(tops)
        return out


def merge_completion(a: dict | None, b: dict) -> dict:
    return b if a is None else {k: a[k] + b[k] for k in a}


def chat_logprobs(decode: Callable[[list[int]], str], token_ids: list[int], entries: list) -> dict:
    """/v1/chat/completions' `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs}, ...]}."""

    def item(token: int, lp: float) -> dict:
        text = decode([token])
        return {"token": text, "logprob": _finite(lp), "bytes": list(text.encode("utf-8"))}

    content = []
    for token, (_, lp, _, top) in zip(token_ids, entries):
        content.append(item(token, lp) | {"top_logprobs": [item(t, v) for t, v in top]})
    return {"content": content}


def choice_completion_logprobs(decode, c, token_ids: list[int], entries: list, first: bool) -> dict | None:
    """The completions `logprobs` of a choice's new tokens (None when it did not ask); with echo the first call's
    starts with the prompt's. c: the server's _Choice (params, echo, prompt_ids, prompt_entries, completion_logprobs:
    the stream's object, which keeps the text offset between chunks)."""
    if c.params.logprobs is None:
        return None
    if first or c.completion_logprobs is None:
        c.completion_logprobs = CompletionLogprobs(decode)
        if c.echo:
            prompt = c.completion_logprobs.add(c.prompt_ids, c.prompt_entries or [None] * len(c.prompt_ids))
            return merge_completion(prompt, c.completion_logprobs.add(token_ids, entries))
    return c.completion_logprobs.add(token_ids, entries)


def choice_chat_logprobs(decode, c, token_ids: list[int], entries: list) -> dict | None:
    return None if c.params.logprobs is None else chat_logprobs(decode, token_ids, entries)


def prompt_logprobs_json(decode, entries: list) -> list:
    """vLLM's prompt_logprobs field: per prompt token None or {token id: {logprob, rank, decoded_token}}."""
    return [None if e is None else {str(t): {"logprob": _finite(v.logprob), "rank": v.rank, "decoded_token": v.decoded_token}
                                    for t, v in entry_dict(e, decode).items()} for e in entries]
