"""Incremental detokenization with OpenAI `stop` strings, and chat templates."""

from __future__ import annotations

import functools
from typing import Callable


class TextStream:
    """One request's text as its tokens arrive. add() returns the new text that is safe to send: text that
    could still turn into a stop string is held back, and a decoder's incomplete character (U+FFFD at the end)
    waits for its next token. Once a stop string appears the text ends before it and `stopped` is set.
    decode None (a model without a tokenizer): the text stays empty.

    Decoding is incremental, as vLLM's: each call decodes a window of the last few tokens, not the whole
    output, so a long stream costs the same per token at its end as at its start."""

    def __init__(self, decode: Callable[[list[int]], str] | None, stop: list[str] = ()):
        self.decode, self.stop = decode, [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.decoded = ""  # text of token_ids[:_read]
        self._prefix = self._read = 0  # the decoder's window: tokens [_prefix, _read) give the window's known text
        self.text = ""  # sent so far
        self.stopped = False

    def _decode_new(self, final: bool) -> None:
        ids = self.token_ids
        known = self.decode(ids[self._prefix:self._read]) if self._read > self._prefix else ""
        window = self.decode(ids[self._prefix:])
        if len(window) > len(known) and (final or not window.endswith("\ufffd")):
            self.decoded += window[len(known):]
            self._prefix, self._read = self._read, len(ids)

    def add(self, token_ids: list[int], final: bool = False) -> str:
        if self.stopped or self.decode is None:
            self.token_ids += [] if self.stopped else token_ids
            return ""
        self.token_ids += token_ids
        self._decode_new(final)
        full = self.decoded
        start = max(0, len(self.text) - self.hold)
        hits = [i for i in (full.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            end = min(hits)
        elif final:
            end = len(full)
        else:
            end = len(full) - self.hold
        new = full[len(self.text):end] if end > len(self.text) else ""
        self.text += new
        return new


@functools.lru_cache(maxsize=4)
def _compiled_template(template: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(template)


def render_chat(template: str, messages: list[dict]) -> str:
    """The prompt a chat template makes of messages (Jinja in a sandbox, as transformers renders them)."""
    return _compiled_template(template).render(messages=messages, add_generation_prompt=True)
