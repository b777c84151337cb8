"""The engine core's loop: one launch at a time, schedule (scheduler.py) -> execute (execute.py: state copies, host
arrays, dispatch) -> book, and later apply its results (update.py), as vLLM's EngineCore.step runs schedule ->
execute_model -> update_from_output.
"""

from __future__ import annotations

import time

from .execute import Executor
from .role import Role
from .scheduler import Scheduler, SchedulerOutput
from .update import InFlight, Update


class EngineCore:
    """Steps an engine's scheduler, executor and update. decode_steps_per_launch: the most model steps a launch runs
    (EngineConfig.resolved_decode_steps); async_scheduling: EngineConfig.uses_async_scheduling."""

    def __init__(self, scheduler: Scheduler, executor: Executor, update: Update, role: Role,
                 decode_steps_per_launch: int, async_scheduling: bool):
        self.scheduler, self.executor, self.update, self.role = scheduler, executor, update, role
        self.decode_steps_per_launch, self.async_scheduling = decode_steps_per_launch, async_scheduling
        self.in_flight: InFlight | None = None  # async scheduling: the launch whose results are not applied yet
        self.num_steps = self.num_launches = 0  # model steps, device launches
        self.closed = False

    def step(self) -> SchedulerOutput:
        """Schedule and launch one step (with decode_steps_per_launch, a launch of several); returns what was
        scheduled. Synchronous scheduling applies the launch's results before returning; async scheduling (the
        default) applies the previous launch's, so the host's work overlaps the device's (update.py). The launch in
        flight is applied first when the coming schedule could preempt (a preempted request is recomputed from its
        real tokens) and, with MTP, near max_model_len. Equal to `launch()` then `finish()`."""
        out = self.launch()
        self.finish()
        return out

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def run_until_done(self, on_step=None) -> None:
        while self.has_unfinished:
            self.step()
            if on_step:
                on_step()
        self.flush()  # async: a last step of requests that had all finished

    @property
    def _asynchronous(self) -> bool:
        return self.async_scheduling and self.update.draft_override is None

    def launch(self) -> SchedulerOutput:
        """The first half of step(): schedule and dispatch. A synchronous engine's results are applied by `finish()`
        (or its next launch), so an orchestrator of two synchronous engines (PD) can do one's host work while the
        other's launch runs."""
        if self.closed:
            raise RuntimeError("this engine is closed (LLM.close()): build a new one")
        self.role.before_launch()
        asynchronous = self._asynchronous
        if self.in_flight is not None and (not asynchronous or self.scheduler.may_preempt()
                                            or self.scheduler.near_length_limit(self.decode_steps_per_launch)):
            self.apply_in_flight(sync=not asynchronous)
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        self.executor.runner.timings["schedule"] += time.perf_counter() - t0
        if not out.rows and self.scheduler.has_unfinished and self.in_flight is None and not self.role.waits_on_others():
            raise RuntimeError("scheduler made no progress: a waiting request cannot fit the KV pool")
        previous, self.in_flight = self.in_flight, (self._launch(out) if out.rows else None)
        if previous is not None:  # the launch just dispatched is the later one
            self.update.apply(previous, self.in_flight, False, self.role.applied)
        return out

    def finish(self) -> None:
        """The second half of step(): a synchronous engine applies its launch's results (an asynchronous one applies
        them in a later step)."""
        if not self._asynchronous:
            self.apply_in_flight(sync=True)

    def flush(self) -> None:
        """Apply the launch in flight, if any (async scheduling; run when no request is left to step)."""
        self.apply_in_flight(sync=not self._asynchronous)

    def _launch(self, out: SchedulerOutput) -> InFlight:
        """Execute the scheduled rows (execute.py, after the role's state copies) and book them (update.py)."""
        num_steps = self.scheduler.launch_steps(out, 1 if self.update.draft_override else self.decode_steps_per_launch)
        in_flight = {id(row.request) for row in self.in_flight.out.rows} if self.in_flight else set()
        copies = [op for row in out.rows for op in self.role.admitted(row.request)]
        pending = self.executor.execute(out.rows, num_steps, [id(row.request) in in_flight for row in out.rows], copies)
        self.executor.cache.after(out.rows, [r.request.num_computed for r in out.rows], self.executor.runner.state)
        self.num_steps += num_steps
        self.num_launches += 1
        return self.update.book(out, pending)

    def apply_in_flight(self, sync: bool = False) -> None:
        previous, self.in_flight = self.in_flight, None
        if previous is not None:
            self.update.apply(previous, None, sync, self.role.applied)
