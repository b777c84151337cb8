"""PrefillWorker and DecodeWorker: two engines with their own pools (and devices), joined by Handoffs."""

from __future__ import annotations

import functools
from typing import Callable

from .llm_engine import LLMEngine
from .pd import Handoff, config_fingerprint, export_handoff, handoff_problem, import_handoff
from .request import Request, SamplingParams
from .tensor_parallel import conv_channel_order


class _Worker(LLMEngine):
    @functools.cached_property
    def conv_order(self):
        """The conv channel order of this worker's pools (None on one device; see tensor_parallel)."""
        tp = self.ecfg.tensor_parallel_size
        return conv_channel_order(self.cfg, tp) if tp > 1 else None

    @functools.cached_property
    def fingerprint(self) -> str:
        """What the other side of a handoff must match (config_fingerprint)."""
        return config_fingerprint(self.cfg, self.ecfg.dtype, self.ecfg.kv_page_size)


class PrefillWorker(_Worker):
    """Runs prompt[:-1] of each request and exports a Handoff when it is done (in `handoffs_out`)."""

    samples_outputs = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.handoffs_out: list[Handoff] = []

    def submit(self, prompt: list[int], params: SamplingParams) -> int:
        rid = self.add_request(list(prompt[:-1]), params)
        req = self.requests[rid]
        req.prefill_only = True
        req.next_prompt_token = int(prompt[-1])
        return rid

    def _applied(self, req: Request) -> None:
        if req.prefill_only and req.num_computed == req.prefill_len:
            prompt = req.prompt_token_ids + [req.next_prompt_token]
            self.handoffs_out.append(export_handoff(self.cfg, self.runner.state, req, prompt, self.fingerprint,
                                                    self.conv_order))
            self.prefix_caching.finished(req, req.prefill_len, prompt, self.runner.state)  # the prompt boundary
            self.scheduler.finish(req, "handoff")

    def pop_handoffs(self) -> list[Handoff]:
        out, self.handoffs_out = self.handoffs_out, []
        return out


class DecodeWorker(_Worker):
    """Imports Handoffs into fresh pages/slots and serves the request from the prompt tail on."""

    caches_prefixes = False  # every prompt arrives as state; its prefill worker caches

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.handoff_bytes_in = 0

    def submit(self, handoff: Handoff) -> int:
        """Queue a request whose first num_computed tokens arrive as state. A handoff from another model or
        configuration, or with arrays of the wrong sizes, finishes its request with an error."""
        rid = self.add_request(list(handoff.prompt_token_ids), handoff.sampling_params, error=self.check(handoff))
        req = self.requests[rid]
        req.num_cached_tokens = handoff.num_cached_tokens
        if handoff.prompt_logprobs is not None:
            req.prompt_logprobs = list(handoff.prompt_logprobs)
        if req.error is None and handoff.num_computed:
            req.num_computed = handoff.num_computed
            req.handoff = handoff
            self.handoff_bytes_in += handoff.nbytes
        return rid

    def check(self, handoff: Handoff) -> str | None:
        """Why this worker cannot serve the handoff (another model or configuration, wrong sizes), or None."""
        return handoff_problem(handoff, self.cfg, self.fingerprint, self.ecfg.kv_page_size,
                               len(self.runner.state.mtp_layers))

    def _admitted(self, req: Request) -> None:
        if req.handoff is not None:  # admitted this step: its state goes into the fresh slot and pages
            self.runner.state = import_handoff(self.cfg, self.runner.state, req.handoff, req.slot, req.pages,
                                               self.runner.buffer_sharding, self.conv_order)
            req.handoff = None


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
