"""What an engine serves: a whole request (the default), or one side of prefill/decode disaggregation.

An engine holds one Role and calls its hooks at fixed points of a step; workers.py has the PD roles. The role
is the only place that differs between a colocated engine, a prefill worker and a decode worker.
"""

from __future__ import annotations

from .memory import handoff_bytes
from .request import Request
from .state_copies import COPIES


class Role:
    """A colocated engine: it caches prefixes, samples outputs, and neither imports nor exports handoffs."""

    caches_prefixes = True  # with enable_prefix_caching (a PD decode worker imports its prompts instead)
    samples_outputs = True  # a PD prefill worker samples nothing (structured output is the decode worker's)
    engine = None  # the LLMEngine this role was given to (attach)

    def attach(self, engine) -> None:
        """Called first thing by the engine this role is given to (before its memory plan)."""
        self.engine = engine

    def planned(self) -> None:
        """Called once the engine's memory plan is made."""

    def copy_peak(self, with_mtp: bool) -> int:
        """Bytes the largest state copy program the engine runs gathers (page copies and snapshots; a PD worker's
        handoffs)."""
        e = self.engine
        return handoff_bytes(e.step_cfg, e.ecfg, with_mtp, COPIES, COPIES)

    def staged(self, with_mtp: bool) -> tuple[int, int]:
        """(handoffs held on the device ahead of their import at most, bytes of one): a PD decode server's."""
        return 0, 0

    def handoff_programs(self) -> tuple[bool, bool, bool]:
        """Whether the engine imports, exports and transfers PD handoffs (a decode worker, a prefill worker)."""
        return False, False, False

    def transfer_source(self):
        """The state of the prefill worker whose pools the engine copies handoffs from (a decode worker's), or None."""
        return None

    def before_launch(self) -> None:
        """Called before each launch is scheduled."""

    def admitted(self, req: Request) -> list:
        """Called for every row's request as its step is prepared; returns the state copies it needs first (a PD
        decode worker's handoffs)."""
        return []

    def applied(self, req: Request, end: int) -> None:
        """Called for every row's request that goes on once its launch's results are applied, end: the position after
        the row's tokens (a PD prefill worker parks finished prompts here)."""

    def waits_on_others(self) -> bool:
        """Whether an empty schedule may wait for another engine to free this one's pages or slots (a PD prefill
        worker whose finished prompts wait for their decode worker)."""
        return False

    def aborted(self, rid: int) -> None:
        """Called as request rid is aborted, before the engine finishes it."""
