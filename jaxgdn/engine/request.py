"""Requests, sampling parameters, row kinds and outputs (names follow vLLM)."""

from __future__ import annotations

import dataclasses
import enum
import math

import numpy as np

from .logprobs import MAX_LOGPROBS, Logprob, entry_dict
from .penalties import MAX_LOGIT_BIAS
from .structured import StructuredOutputsParams


class RowKind(enum.IntEnum):
    """What one request's slice of a step is. Computed once, on the host, from request state; the same
    value drives input assembly, the GDN state path, the logits rows and the sampler."""

    PAD = 0  # a padding row of a bucket: null slot, no logits used
    PREFILL_CHUNK = 1  # prompt (or recompute) tokens, more than one left before this chunk
    PROMPT_TAIL = 2  # exactly the last prompt token (a PD handoff's x_N, or a 1-token final chunk)
    DECODE = 3  # one token: the last sampled
    SPEC_VERIFY = 4  # the last sampled token followed by K drafts


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


# Beyond this temperature every token is equally likely at fp32 precision; larger values only risk overflow.
MAX_TEMPERATURE = 1e4
INT32_MAX = 2**31 - 1
SEED_RANGE = (-(2**63), 2**64)  # a seed is taken modulo 2**64: int64 and uint64 values are both accepted


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy. top_k 0 or -1 disables top-k; top_p 1.0 disables nucleus sampling.
    seed: the noise is keyed by (seed, position), so a seeded request reproduces in any batch; None keys
    it by (request id, position) instead. A seed is 64 bits: any integer in [-2**63, 2**64), modulo 2**64."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # each sampled token's logprob and the top `logprobs` (logprobs.py)
    prompt_logprobs: int | None = None  # the same for each prompt token after the first
    structured_outputs: StructuredOutputsParams | None = None  # the output follows a grammar (structured.py)
    # vLLM's penalties (penalties.py): presence and frequency over the output, repetition over prompt + output
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] | dict | None = None  # {token id: bias in [-100, 100]}
    min_tokens: int = 0  # stop tokens (EOS, stop_token_ids) are masked until this many outputs
    bad_words: tuple[str, ...] | None = None  # words the output never completes (host_masks.py)

    def __post_init__(self):
        if self.logit_bias is not None:  # hashable pairs in a fixed order (JSON's keys are strings)
            pairs = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
            try:
                object.__setattr__(self, "logit_bias", tuple(sorted((int(k), float(v)) for k, v in pairs)))
            except (TypeError, ValueError):
                pass  # validate() names the problem
        if isinstance(self.bad_words, list):
            object.__setattr__(self, "bad_words", tuple(self.bad_words))

    def validate(self) -> None:
        """Raise ValueError naming the bad field."""
        t = self.temperature
        if not (isinstance(t, (int, float)) and math.isfinite(t) and 0 <= t <= MAX_TEMPERATURE):
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {t}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (_is_int(self.top_k) and -1 <= self.top_k <= INT32_MAX):
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer below 2**31, got {self.top_k}")
        if not (_is_int(self.max_tokens) and 1 <= self.max_tokens <= INT32_MAX):
            raise ValueError(f"max_tokens must be an integer in [1, 2**31), got {self.max_tokens}")
        if self.seed is not None and not (_is_int(self.seed) and SEED_RANGE[0] <= self.seed < SEED_RANGE[1]):
            raise ValueError(f"seed must be an integer in [-2**63, 2**64), got {self.seed}")
        if not all(_is_int(t) and 0 <= t <= INT32_MAX for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {list(self.stop_token_ids)[:5]}")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and not (_is_int(n) and 0 <= n <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {n}")
        self._validate_penalties()
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError("structured_outputs must be a StructuredOutputsParams")
            self.structured_outputs.validate()

    @classmethod
    def from_dict(cls, fields: dict) -> "SamplingParams":
        """The inverse of `dataclasses.asdict` after a JSON round trip: lists back to tuples, structured_outputs
        back to its dataclass."""
        fields = dict(fields)
        fields["stop_token_ids"] = tuple(fields.get("stop_token_ids", ()))
        if isinstance(fields.get("structured_outputs"), dict):
            fields["structured_outputs"] = StructuredOutputsParams(**fields["structured_outputs"])
        return cls(**fields)

    def _validate_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and -2.0 <= v <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
        r = self.repetition_penalty
        if not (isinstance(r, (int, float)) and math.isfinite(r) and r > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {r}")
        bias = self.logit_bias or ()
        if not (isinstance(bias, tuple) and all(isinstance(e, tuple) and len(e) == 2 and _is_int(e[0]) and 0 <= e[0]
                                                and isinstance(e[1], float) and math.isfinite(e[1]) for e in bias)):
            raise ValueError("logit_bias must map token ids to finite numbers")
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}")
        if any(not -100 <= v <= 100 for _, v in bias):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if not (_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens):
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens}")
        if self.bad_words is not None and not all(isinstance(w, str) and w for w in self.bad_words):
            raise ValueError("bad_words must be a list of non-empty strings")

    @property
    def seed_words(self) -> tuple[int, int]:
        """(low, high) 32-bit words of the seed modulo 2**64 ((0, 0) unseeded)."""
        s = (self.seed or 0) % 2**64
        return s & 0xFFFFFFFF, s >> 32


def validate_request(ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int) -> str | None:
    """The error message for a bad request (empty, ids outside the vocabulary, too long, bad parameters), or None."""
    if not ids:
        return "empty prompt"
    bad = [t for t in ids if not (isinstance(t, (int, np.integer)) and 0 <= t < vocab_size)]
    if bad:
        return f"token id(s) outside the vocabulary [0, {vocab_size}): {bad[:5]}"
    if len(ids) >= max_model_len:
        return f"prompt of {len(ids)} tokens leaves no room under max_model_len {max_model_len}"
    try:
        params.validate()
    except ValueError as e:
        return str(e)
    bad_bias = [t for t, _ in params.logit_bias or () if t >= vocab_size]
    if bad_bias:
        return f"logit_bias: token id(s) outside the vocabulary [0, {vocab_size}): {bad_bias[:5]}"
    return None


@dataclasses.dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_drafted: int = 0
    num_accepted_drafts: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    def tpot(self, num_output_tokens: int) -> float | None:
        if self.finished_time is None or self.first_token_time is None or num_output_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (num_output_tokens - 1)


# Async scheduling: an output token whose step is dispatched but whose value is still on the device.
PLACEHOLDER_TOKEN = -1


@dataclasses.dataclass(eq=False)
class Request:
    """Host-side request state. The first `num_computed` tokens of prompt + outputs are in the caches.
    Compared by identity: the scheduler's membership checks must not compare token lists."""

    request_id: int
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    metrics: RequestMetrics
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed: int = 0
    # Tokens the current (re)computation must prefill: the prompt, or prompt + outputs after preemption.
    prefill_len: int = 0
    slot: int = 0  # persistent request slot (0 = none; slot 0 is the null slot)
    pages: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    spec_token_ids: list[int] = dataclasses.field(default_factory=list)  # drafts for the next step
    # a PD prefill worker's request (prefill_only): the prompt token after this worker's tokens (x_N); it stops
    # after the prompt and exports a handoff
    next_prompt_token: int | None = None
    # Async scheduling: the last output this request may produce is in flight; do not schedule it again.
    awaiting_final_token: bool = False
    # Async scheduling with MTP: a verify launch in flight is booked as if it accepted every draft
    # (num_computed and placeholder outputs); output_slack is how many of those placeholders it may not
    # fill, spec_excess counts the unused ones removed so far (engine._apply).
    output_slack: int = 0
    spec_excess: int = 0
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache when it started
    # The masks the host computes for its logits rows (host_masks.HostMasks: grammar, min_tokens, bad_words);
    # masks_in_flight: a launch of its sampling row is not applied yet (its next masks need those tokens; the
    # scheduler waits)
    host_masks: object | None = dataclasses.field(default=None, repr=False)
    masks_in_flight: bool = False
    # logprobs.Scores.entry of each output token, and of each prompt token (None at position 0) as computed
    sampled_logprobs: list = dataclasses.field(default_factory=list, repr=False)
    prompt_logprobs: list = dataclasses.field(default_factory=lambda: [None], repr=False)
    _prompt_array: np.ndarray | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self):
        self.prefill_len = len(self.prompt_token_ids)

    def prompt_array(self) -> np.ndarray:
        """prompt_token_ids (never changed after construction) as int32, made once (the engine makes it when
        it admits the request): a step's assembly copies prompt tokens from it instead of converting the list
        in every step."""
        if self._prompt_array is None:
            self._prompt_array = np.asarray(self.prompt_token_ids, np.int32)
        return self._prompt_array

    def token_slice(self, start: int, end: int) -> list[int]:
        """(prompt + outputs)[start:end] without concatenating the whole sequence (host step assembly)."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[max(0, start - n_prompt) : end - n_prompt]

    def token_array(self, start: int, end: int) -> np.ndarray:
        """token_slice(start, end) as int32 (prompt tokens from prompt_array)."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_array()[start:end]
        return np.asarray(self.token_slice(start, end), np.int32)

    def token_after(self, end: int) -> int:
        """The token at position `end` if known, else the PD prefill worker's next prompt token (or 0)."""
        if end < self.num_tokens:
            return self.token_slice(end, end + 1)[0]
        return self.next_prompt_token or 0

    @property
    def prefill_only(self) -> bool:
        return self.next_prompt_token is not None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def output(self, decode=None) -> "RequestOutput":
        """What the request produced so far (async scheduling's placeholders left out); decode(ids) -> text."""
        tokens = [t for t in self.output_token_ids if t != PLACEHOLDER_TOKEN]
        m, sp = self.metrics, self.sampling_params
        text = decode if self.error is None else None
        return RequestOutput(
            request_id=self.request_id, prompt_token_ids=self.prompt_token_ids, token_ids=tokens,
            text=decode(tokens) if (decode and self.error is None) else None, finish_reason=self.finish_reason,
            error=self.error, ttft=m.ttft, tpot=m.tpot(len(tokens)), num_preemptions=m.num_preemptions,
            num_drafted=m.num_drafted, num_accepted_drafts=m.num_accepted_drafts,
            num_cached_tokens=self.num_cached_tokens or 0,
            logprobs=None if sp.logprobs is None else [entry_dict(e, text) for e in self.sampled_logprobs[: len(tokens)]],
            prompt_logprobs=None if sp.prompt_logprobs is None else [entry_dict(e, text) for e in self.prompt_logprobs])

    @property
    def num_outputs_lower_bound(self) -> int:
        """Outputs this request has for sure (placeholders of launches in flight included where they must
        be filled): len(output_token_ids) but for async scheduling with MTP."""
        return len(self.output_token_ids) - self.output_slack


@dataclasses.dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str | None  # "stop", "length", "error"
    error: str | None = None
    ttft: float | None = None
    tpot: float | None = None
    num_preemptions: int = 0
    num_drafted: int = 0  # drafts verified for this request
    num_accepted_drafts: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (not computed) when it started
    # with SamplingParams.logprobs: per output token {token id: Logprob} (the sampled token and the top ones)
    logprobs: list[dict[int, Logprob]] | None = None
    # with SamplingParams.prompt_logprobs: the same per prompt token, None at position 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
