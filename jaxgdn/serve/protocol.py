"""The OpenAI request bodies the server accepts (pydantic), their sampling parameters, and OpenAI's error
shape."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ..engine.logprobs import MAX_LOGPROBS
from ..engine.request import INT32_MAX, MAX_TEMPERATURE, SEED_RANGE, SamplingParams
from ..engine.structured import StructuredOutputsParams


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
    repetition_penalty: float | None = None
    logit_bias: dict | None = None
    min_tokens: int = Field(default=0, ge=0, le=INT32_MAX)
    bad_words: list[str] | None = None
    logprobs: bool | int | None = None
    # structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def check_unsupported(self) -> None:
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

    def constraint(self) -> StructuredOutputsParams | None:
        """The one structured-output constraint the request names, or None (BadRequest for several, or a bad
        response_format)."""
        found = {}
        fmt = self.response_format
        if fmt is not None:
            kind = fmt.get("type")
            if kind == "json_object":
                found["response_format"] = StructuredOutputsParams(json_object=True)
            elif kind == "json_schema":
                schema = (fmt.get("json_schema") or {}).get("schema")
                if not isinstance(schema, dict):
                    raise BadRequest("response_format json_schema needs json_schema.schema, an object", "response_format")
                found["response_format"] = StructuredOutputsParams(json=schema)
            elif kind != "text":
                raise BadRequest(f"response_format type must be text, json_object or json_schema, got {kind!r}",
                                 "response_format")
        if self.structured_outputs:
            fields = {k: v for k, v in self.structured_outputs.items() if v not in (None, False)}
            unknown = set(fields) - {"json", "json_object", "regex", "choice", "grammar"}
            if unknown:
                raise BadRequest(f"structured_outputs: unknown field(s) {sorted(unknown)}", "structured_outputs")
            found["structured_outputs"] = StructuredOutputsParams(**fields)
        guided = {"json": self.guided_json, "regex": self.guided_regex, "choice": self.guided_choice,
                  "grammar": self.guided_grammar}
        for key, value in guided.items():
            if value is not None:
                found[f"guided_{key}"] = StructuredOutputsParams(**{key: value})
        if len(found) > 1:
            raise BadRequest(f"one structured-output constraint at a time, got {sorted(found)}", sorted(found)[1])
        for key, constraint in found.items():
            try:
                constraint.validate()
            except ValueError as e:
                raise BadRequest(str(e), key) from None
            return constraint
        return None

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
            structured_outputs=self.constraint(),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=self.logit_bias or None,
            min_tokens=self.min_tokens,
            bad_words=tuple(self.bad_words) if self.bad_words else None,
        )
        try:
            sp.validate()
        except ValueError as e:  # the message starts with the field's name
            raise BadRequest(str(e), str(e).split(" ", 1)[0].rstrip(":")) from None
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
