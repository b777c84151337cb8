"""Incremental detokenization with OpenAI `stop` strings, and chat templates."""

from __future__ import annotations

from typing import Callable


class TextStream:
    """One request's text as its tokens arrive. add() returns the new text that is safe to send: text that
    could still turn into a stop string is held back, and a decoder's incomplete character (U+FFFD at the end)
    waits for its next token. Once a stop string appears the text ends before it and `stopped` is set.
    decode None (a model without a tokenizer): the text stays empty."""

    def __init__(self, decode: Callable[[list[int]], str] | None, stop: list[str] = ()):
        self.decode, self.stop = decode, [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""  # sent so far
        self.stopped = False

    def add(self, token_ids: list[int], final: bool = False) -> str:
        if self.stopped or self.decode is None:
            self.token_ids += [] if self.stopped else token_ids
            return ""
        self.token_ids += token_ids
        full = self.decode(self.token_ids)
        start = max(0, len(self.text) - self.hold)
        hits = [i for i in (full.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            end = min(hits)
        elif final:
            end = len(full)
        else:
            end = len(full) - self.hold
            while end > len(self.text) and full[end - 1] == "\ufffd":
                end -= 1
        new = full[len(self.text):end] if end > len(self.text) else ""
        self.text += new
        return new


def render_chat(template: str, messages: list[dict]) -> str:
    """The prompt a chat template makes of messages (Jinja in a sandbox, as transformers renders them)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(messages=messages, add_generation_prompt=True)
