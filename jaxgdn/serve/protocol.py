"""The OpenAI request bodies the server accepts (pydantic), their sampling parameters, and OpenAI's error
shape."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ..engine.logprobs import MAX_LOGPROBS
from ..engine.request import INT32_MAX, MAX_TEMPERATURE, SEED_RANGE, SamplingParams


class BadRequest(ValueError):
    """A client error: HTTP `status` with OpenAI's error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.param, self.status, self.kind = param, status, kind


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields both endpoints share. Unknown fields are ignored, as OpenAI-compatible servers do; fields that
    would change the output but are not implemented are refused (see check_unsupported)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0, le=INT32_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], lt=SEED_RANGE[1])
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None
    logprobs: bool | int | None = None

    def check_unsupported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise BadRequest(f"{name} is not supported by jaxgdn", name)
        if self.logit_bias:
            raise BadRequest("logit_bias is not supported by jaxgdn", "logit_bias")
        if getattr(self, "suffix", None):
            raise BadRequest("suffix is not supported by jaxgdn", "suffix")
        if self.max_tokens == 0 and not self.scores_prompt_only:
            raise BadRequest("max_tokens must be at least 1 (0 only with echo on /v1/completions, which scores the "
                             "prompt)", "max_tokens")

    @property
    def scores_prompt_only(self) -> bool:
        """max_tokens 0 with echo: the prompt and its logprobs come back, nothing is generated."""
        return False

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """(logprobs, prompt_logprobs) of the engine's SamplingParams."""
        return None, None

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def sampling_params(self, index: int, default_max_tokens: int) -> SamplingParams:
        """The engine's parameters for choice number `index` of n (a seeded request's choices get seed + index,
        so they differ yet reproduce)."""
        logprobs, prompt_logprobs = self.logprob_counts()
        sp = SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            max_tokens=1 if self.scores_prompt_only else (self.max_tokens or default_max_tokens),
            seed=None if self.seed is None else (self.seed + index) % 2**64,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )
        try:
            sp.validate()
        except ValueError as e:  # the message starts with the field's name
            raise BadRequest(str(e), str(e).split(" ", 1)[0]) from None
        return sp


class CompletionRequest(SamplingFields):
    """prompt: text, token ids, or a list of either (one choice group per prompt). logprobs: N, each token's
    logprob and the top N; echo: the prompt comes back before the completion (with logprobs, the prompt's
    too); prompt_logprobs (vLLM's): the prompt's top N without echo."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @property
    def scores_prompt_only(self) -> bool:
        return self.max_tokens == 0 and self.echo

    def logprob_counts(self) -> tuple[int | None, int | None]:
        n = self.logprobs
        if isinstance(n, bool) or (n is not None and not 0 <= n <= MAX_LOGPROBS):
            raise BadRequest(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] on /v1/completions, got "
                             f"{n!r}", "logprobs")
        prompt = self.prompt_logprobs if self.prompt_logprobs is not None else (n if self.echo else None)
        return n, prompt


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None

    def text(self) -> str:
        """The message's text (a list of content parts: its text parts joined)."""
        if isinstance(self.content, list):
            parts = [p.get("text", "") for p in self.content if p.get("type") == "text"]
            if len(parts) != len(self.content):
                raise BadRequest("only text content parts are supported", "messages")
            return "".join(parts)
        return self.content or ""


class ChatRequest(SamplingFields):
    """logprobs: true returns each token's logprob, with the top `top_logprobs` (0..20) beside it."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def logprob_counts(self) -> tuple[int | None, int | None]:
        if self.logprobs not in (None, True, False):
            raise BadRequest(f"logprobs must be true or false on /v1/chat/completions, got {self.logprobs!r}",
                             "logprobs")
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None, None
