"""PrefillWorker and DecodeWorker: two engines with their own pools (and devices), joined by Handoffs."""

from __future__ import annotations

from typing import Callable

from .llm_engine import LLMEngine
from .pd import Handoff
from .request import SamplingParams


class PrefillWorker(LLMEngine):
    """Runs prompt[:-1] of each request and exports a Handoff when it is done."""

    def submit(self, prompt: list[int], params: SamplingParams) -> int:
        return self.add_prefill_request(prompt, params)

    def pop_handoffs(self) -> list[Handoff]:
        out, self.handoffs_out = self.handoffs_out, []
        return out


class DecodeWorker(LLMEngine):
    """Imports Handoffs into fresh pages/slots and serves the request from the prompt tail on."""

    def submit(self, handoff: Handoff) -> int:
        return self.add_handoff(handoff)


def run_disaggregated(prefill: PrefillWorker, decode: DecodeWorker, prompts: list[list[int]],
                      params: list[SamplingParams], transport_bytes: bool = False,
                      on_step: Callable[[], None] | None = None) -> list[int]:
    """Serve prompts through P then D; returns the decode worker's request ids in prompt order.

    P and D steps interleave, so handoffs arrive while D already has running requests (the case that
    broke vLLM). Prompts of one token, or invalid ones, go straight to D (nothing to prefill / to fail
    there with their error).
    """
    decode_ids: list[int | None] = [None] * len(prompts)
    from_prefill: dict[int, int] = {}
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        if len(prompt) > 1 and decode.validate(prompt, sp) is None:
            from_prefill[prefill.submit(prompt, sp)] = i
        else:
            decode_ids[i] = decode.add_request(prompt, sp)
    while prefill.has_unfinished or decode.has_unfinished:
        if prefill.has_unfinished:
            prefill.step()
            for h in prefill.pop_handoffs():
                if transport_bytes:
                    h = Handoff.from_bytes(h.to_bytes())
                decode_ids[from_prefill[h.request_id]] = decode.submit(h)
        if decode.has_unfinished:
            decode.step()
        if on_step:
            on_step()
    return decode_ids  # type: ignore[return-value]
