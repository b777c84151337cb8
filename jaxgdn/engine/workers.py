"""The PD roles: a prefill worker and a decode worker are two LLMEngines with their own pools (and devices), one with
a PrefillRole and one with a DecodeRole, joined by Handoffs. `needs_prefill` is the routing rule every front uses.

A prefill worker keeps a finished prompt's pages and slot (`Parked`) until its handoff is taken: a decode worker on
the same devices copies the state straight from them into its own pages and slot (one transfer program for every
handoff it admits in a step); otherwise `Handoff.export` gathers it into arrays (bytes for another process, or a
decode worker on other devices) and frees them. Either way the prefill worker's pools are what holds a prompt
waiting for the decode worker, so a decode worker that falls behind slows its prefill worker instead of filling the
device with handoffs.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import weakref
from typing import Callable

from .llm_engine import LLMEngine
from .memory import handoff_bytes
from .pd import Handoff, config_fingerprint, handoff_problem
from .request import Request, SamplingParams
from .role import Role
from .state_copies import TRANSFER_HANDOFFS, HandoffImport, HandoffTransfer, handoff_buckets, transfer_buckets

STAGED_HANDOFFS = 16  # handoffs a decode server holds on the device ahead of their import (planned; fewer if tight)


def needs_prefill(prompt: list[int], problem: str | None = None) -> bool:
    """The PD routing rule: a prompt goes to the prefill side when it has more than one token and nothing is wrong
    with it (problem: its validation error, if any); a 1-token or bad prompt goes straight to decode (nothing to
    prefill there / it fails there with its error)."""
    return len(prompt) > 1 and problem is None


def prefill_engine(*args, **kwargs) -> LLMEngine:
    """An engine with a PrefillRole (LLMEngine's arguments)."""
    return LLMEngine(*args, role=PrefillRole(), **kwargs)


def decode_engine(*args, staged_handoffs: int = 0, **kwargs) -> LLMEngine:
    """An engine with a DecodeRole (LLMEngine's arguments; staged_handoffs: see DecodeRole)."""
    return LLMEngine(*args, role=DecodeRole(staged_handoffs), **kwargs)


class _PDRole(Role):
    @functools.cached_property
    def fingerprint(self) -> str:
        """What the other side of a handoff must match (config_fingerprint)."""
        e = self.engine
        return config_fingerprint(e.cfg, e.ecfg.dtype, e.ecfg.kv_page_size)


@dataclasses.dataclass(eq=False)
class Parked:
    """A prefill worker's finished prompt whose state stays in the worker's pages and slot until its handoff is
    taken (copied by a decode worker, or exported)."""

    role: "PrefillRole"
    request: Request

    @property
    def engine(self) -> LLMEngine:
        return self.role.engine

    @property
    def nbytes(self) -> int:
        e = self.engine
        pages = -(-self.request.num_computed // e.ecfg.kv_page_size)
        return handoff_bytes(e.cfg, e.ecfg, bool(e.runner.state.mtp_layers), pages)

    def export(self, handoff: Handoff) -> None:
        self.role.export(handoff)

    def release(self) -> None:
        self.role.release(self.request.request_id)


class PrefillRole(_PDRole):
    """Runs prompt[:-1] of each request; a finished one is parked and its Handoff queued (`pop_handoffs`)."""

    samples_outputs = False

    def __init__(self):
        self.handoffs_out: list[Handoff] = []
        self.parked: dict[int, Request] = {}
        self.exports = True  # start-up compiles the export programs (not when a decode worker copies in place)
        self._dropped: collections.deque[int] = collections.deque()  # parked ids whose Handoff was dropped untaken

    def submit(self, prompt: list[int], params: SamplingParams) -> int:
        """Queue prompt[:-1] for prefill; the last prompt token travels in the handoff."""
        return self.engine.add_request(list(prompt[:-1]), params, next_prompt_token=int(prompt[-1]))

    def applied(self, req: Request, end: int) -> None:
        if req.prefill_only and end == req.prefill_len:  # its last chunk's results (not a later launch's booking)
            e = self.engine
            prompt = req.prompt_token_ids + [req.next_prompt_token]
            e.cache.finished(req, req.prefill_len, prompt, e.runner.state)  # the prompt boundary
            e.scheduler.finish(req, "handoff", release=False)
            self.parked[req.request_id] = req
            h = Handoff(prompt_token_ids=prompt, num_computed=req.num_computed, sampling_params=req.sampling_params,
                        request_id=req.request_id, fingerprint=self.fingerprint,
                        num_cached_tokens=req.num_cached_tokens or 0,
                        prompt_logprobs=req.prompt_logprobs if req.sampling_params.prompt_logprobs is not None else None,
                        source=Parked(self, req))
            # a handoff dropped untaken frees its pages and slot at this worker's next step (its thread)
            weakref.finalize(h, self._dropped.append, req.request_id)
            self.handoffs_out.append(h)

    def pop_handoffs(self) -> list[Handoff]:
        out, self.handoffs_out = self.handoffs_out, []
        return out

    def export(self, handoff: Handoff) -> None:
        """Gather a parked prompt's state into the handoff's arrays (on this worker's devices) and free its pages
        and slot. Runs on this worker's thread."""
        e, req = self.engine, self.parked[handoff.request_id]
        pages = req.pages[: handoff.num_pages(e.ecfg.kv_page_size)]
        arrays = e.copies.export(e.runner.state, pages, req.slot)
        for name, array in zip(Handoff.ARRAYS, arrays):
            setattr(handoff, name, array)
        handoff.source, handoff.valid_pages = None, len(pages)
        self.release(handoff.request_id)

    def release(self, rid: int) -> None:
        """Free a parked prompt's pages and slot (its handoff was taken, or nobody will take it)."""
        req = self.parked.pop(rid, None)
        if req is not None:
            self.engine.scheduler.release(req)

    def aborted(self, rid: int) -> None:
        self.release(rid)

    def before_launch(self) -> None:
        while self._dropped:
            self.release(self._dropped.popleft())

    def waits_on_others(self) -> bool:
        return bool(self.parked)  # parked prompts hold pages and slots until a decode worker takes them

    def copy_peak(self, with_mtp: bool) -> int:
        e = self.engine
        largest = handoff_buckets(e.ecfg.max_pages_per_seq)[-1]  # an export
        return max(super().copy_peak(with_mtp), handoff_bytes(e.step_cfg, e.ecfg, with_mtp, largest))

    def handoff_programs(self) -> tuple[bool, bool, bool]:
        return False, self.exports, False


class DecodeRole(_PDRole):
    """Takes Handoffs into fresh pages and slots and serves the request from the prompt tail on."""

    caches_prefixes = False  # every prompt arrives as state; its prefill worker caches

    def __init__(self, staged_handoffs: int = 0):
        """staged_handoffs: handoffs a server would hold on the device ahead of their import (STAGED_HANDOFFS for a
        decode server); the memory plan grants at most that many (`staged_handoffs` afterwards)."""
        self.staged_handoffs = staged_handoffs
        self.handoff_bytes_in = 0
        self.pending: dict[int, Handoff] = {}  # request id -> its handoff, until the request is admitted
        self.source: PrefillRole | None = None  # the prefill worker whose pools it copies from (connect)

    def planned(self) -> None:
        self.staged_handoffs = self.engine.memory.staged_handoffs

    def connect(self, prefill: LLMEngine | None, transport: str = "object") -> None:
        """Where handoffs come from: a prefill engine in this process (copied straight from its pools when on the
        same devices with transport "object"; else exported there and imported here), or (None) another process."""
        connected = prefill is not None and transport == "object" and self.copies_from(prefill)
        self.source = prefill.role if connected else None
        if prefill is not None:
            prefill.role.exports = self.source is None

    def copies_from(self, prefill: LLMEngine) -> bool:
        """Whether prefill's pools can be copied into this worker's in one program: the same devices, layout and
        MTP layers."""
        e = self.engine
        return (prefill.placement == e.placement and prefill.ecfg.tensor_parallel_size == e.ecfg.tensor_parallel_size
                and self._mtp_matches(prefill))

    def _mtp_matches(self, prefill: LLMEngine) -> bool:
        return len(prefill.runner.state.mtp_layers) == len(self.engine.runner.state.mtp_layers)

    def handoff_programs(self) -> tuple[bool, bool, bool]:
        return self.source is None, False, self.source is not None  # connected: copies from the prefill pools

    def copy_peak(self, with_mtp: bool) -> int:
        e = self.engine
        pages = e.ecfg.max_pages_per_seq
        largest = max(handoff_bytes(e.step_cfg, e.ecfg, with_mtp, transfer_buckets(pages)[-1], TRANSFER_HANDOFFS),
                      handoff_bytes(e.step_cfg, e.ecfg, with_mtp, handoff_buckets(pages)[-1]))
        return max(super().copy_peak(with_mtp), largest)

    def staged(self, with_mtp: bool) -> tuple[int, int]:
        e = self.engine
        largest = handoff_buckets(e.ecfg.max_pages_per_seq)[-1]
        return self.staged_handoffs, handoff_bytes(e.step_cfg, e.ecfg, with_mtp, largest)

    def transfer_source(self):
        return self.source.engine.runner.state if self.source is not None else None

    def submit(self, handoff: Handoff) -> int:
        """Queue a request whose first num_computed tokens arrive as state. A handoff from another model or
        configuration, or with arrays of the wrong sizes, finishes its request with an error."""
        e, error = self.engine, self.check(handoff)
        state = error is None and handoff.num_computed > 0  # the state it brings (none for a 1-token prompt's)
        extra = {} if handoff.prompt_logprobs is None else {"prompt_logprobs": list(handoff.prompt_logprobs)}
        rid = e.add_request(list(handoff.prompt_token_ids), handoff.sampling_params, error=error,
                            num_computed=handoff.num_computed if state else 0,
                            num_cached_tokens=handoff.num_cached_tokens, **extra)
        if state and e.requests[rid].error is None:
            self.pending[rid] = handoff
            self.handoff_bytes_in += handoff.nbytes
        elif handoff.source is not None:
            handoff.source.release()
        return rid

    def check(self, handoff: Handoff) -> str | None:
        """Why this worker cannot serve the handoff (another model or configuration, wrong sizes), or None."""
        if handoff.source is not None and not self._mtp_matches(handoff.source.engine):
            return "handoff from a prefill worker without this worker's MTP layers (num_speculative_tokens differs)"
        return handoff_problem(handoff, self.engine.cfg, self.fingerprint, self.engine.ecfg.kv_page_size,
                               len(self.engine.runner.state.mtp_layers))

    def aborted(self, rid: int) -> None:
        h = self.pending.pop(rid, None)
        if h is not None and h.source is not None:
            h.source.release()  # never admitted: its prefill worker's pages and slot are free again

    def admitted(self, req: Request) -> list:
        """The state copy that brings an admitted request's handoff into its fresh pages and slot."""
        h = self.pending.pop(req.request_id, None)
        if h is None:
            return []
        n = h.num_pages(self.engine.ecfg.kv_page_size)
        parked = h.source
        if parked is not None and parked.role is self.source:  # connected on the same devices: copy in place
            op = HandoffTransfer(parked.engine.runner, parked.request.slot, tuple(parked.request.pages[:n]), req.slot,
                                 tuple(req.pages[:n]), h.num_computed)
            parked.release()  # its pages are read before the prefill worker's next launch can write them
            return [op]
        return [HandoffImport(h.export().arrays, req.slot, tuple(req.pages[:n]), h.num_computed)]


def step_pair(prefill: LLMEngine, decode: LLMEngine, route: Callable[[list[Handoff]], None]) -> None:
    """One round of a PD pair in one process, each worker synchronous: the decode worker's launch is dispatched,
    the prefill worker's last launch applied (its finished prompts' handoffs go to route) and its next one
    dispatched, then the decode worker's applied. So each worker's host work runs while the other's launch runs on
    the device (and on a CPU both launches run at once)."""
    if decode.has_unfinished:
        decode.launch()
    prefill.finish()
    route(prefill.role.pop_handoffs())
    if prefill.has_unfinished:
        prefill.launch()
    decode.finish()


def run_disaggregated(prefill: LLMEngine, decode: LLMEngine, prompts: list[list[int]],
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
        if needs_prefill(prompt, decode.validate(prompt, sp)):
            from_prefill[prefill.role.submit(prompt, sp)] = i
        else:
            decode_ids[i] = decode.add_request(prompt, sp)

    def route(handoffs: list[Handoff]) -> None:
        for h in handoffs:
            if transport_bytes:
                h = Handoff.from_bytes(h.to_bytes())
            decode_ids[from_prefill[h.request_id]] = decode.role.submit(h)

    while prefill.has_unfinished or decode.has_unfinished:
        step_pair(prefill, decode, route)
        if on_step:
            on_step()
    return decode_ids  # type: ignore[return-value]
