"""Where start-up's time goes: JAX's own monitoring events (tracing, lowering, compiling, loading from the
persistent compilation cache) and jaxgdn's program cache loads, summed over every program built while a
`CompileTimes` is entered."""

from __future__ import annotations

import collections
import threading

from .program_cache import HIT_EVENT, LOAD_EVENT, MISS_EVENT

# JAX's event names (jax/_src/dispatch.py, compiler.py); "compile" includes a cache load, which is taken out
_DURATIONS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace_s",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
    "/jax/core/compile/backend_compile_duration": "compile_s",
    "/jax/compilation_cache/cache_retrieval_time_sec": "cache_load_s",
    LOAD_EVENT: "program_load_s",
}
_COUNTS = {"/jax/compilation_cache/cache_hits": "cache_hits", "/jax/compilation_cache/cache_misses": "cache_misses",
           HIT_EVENT: "program_hits", MISS_EVENT: "program_misses"}


class CompileTimes:
    """with CompileTimes() as t: ... -> t.totals: seconds of tracing, lowering, compiling and cache loading
    (summed over programs, so concurrent compiles add up to more than the wall time), cache hits/misses, and
    the same for the program cache (`program_cache`)."""

    def __init__(self):
        self.totals: collections.Counter = collections.Counter()
        self._lock = threading.Lock()  # compiles finish on a pool of threads

    def _duration(self, event: str, seconds: float, **_) -> None:
        if event in _DURATIONS:
            with self._lock:
                self.totals[_DURATIONS[event]] += seconds

    def _event(self, event: str, **_) -> None:
        if event in _COUNTS:
            with self._lock:
                self.totals[_COUNTS[event]] += 1

    def __enter__(self) -> "CompileTimes":
        import jax

        jax.monitoring.register_event_duration_secs_listener(self._duration)
        jax.monitoring.register_event_listener(self._event)
        return self

    def __exit__(self, *exc) -> None:
        import jax

        jax.monitoring.unregister_event_duration_listener(self._duration)
        jax.monitoring.unregister_event_listener(self._event)

    def summary(self) -> dict:
        """{trace_s, lower_s, compile_s (without cache loads), cache_load_s, cache_hits, cache_misses,
        program_load_s, program_hits, program_misses}."""
        t = self.totals
        return {"trace_s": t["trace_s"], "lower_s": t["lower_s"], "compile_s": max(0.0, t["compile_s"] - t["cache_load_s"]),
                "cache_load_s": t["cache_load_s"], "cache_hits": t["cache_hits"], "cache_misses": t["cache_misses"],
                "program_load_s": t["program_load_s"], "program_hits": t["program_hits"],
                "program_misses": t["program_misses"]}


def startup_line(phases: dict) -> str:
    """One log line of LLM.startup: each phase's wall seconds, and the compile work inside them."""
    def work(t: dict) -> str:
        loads = f"program cache loads {t['program_load_s']:.1f} s ({t['program_hits']} hits), " if "program_hits" in t else ""
        return (f"{loads}tracing {t['trace_s']:.1f} s, lowering {t['lower_s']:.1f} s, compiling {t['compile_s']:.1f} s, "
                f"JAX cache loads {t['cache_load_s']:.1f} s ({t['cache_hits']} hits, {t['cache_misses']} misses)")

    line = (f"start-up {phases.get('total_s', 0):.1f} s: weights {phases['weights_s']:.1f} s, memory plan "
            f"{phases['plan_s']:.1f} s ({work(phases['plan'])})")
    if "precompile_s" in phases:
        copies = f" and {phases['copy_programs']} state copy programs" if phases.get("copy_programs") else ""
        line += (f", {phases['programs']} step programs{copies} {phases['precompile_s']:.1f} s "
                 f"({work(phases['precompile'])}; "
                 f"compiles run on several threads)")
    return line


COMPILE_EVENT_PREFIX = "/jax/core/compile/"  # JAX's tracing, lowering and compiling events


class CompileEvents:
    """Counts JAX's compile events (tracing, lowering, compiling) in the process from `start()` on: a program built
    after an engine's start-up shows here whatever built it (a step or copy program, an eager op of a new shape)."""

    def __init__(self):
        self.count = 0
        self.names: collections.Counter = collections.Counter()
        self._lock = threading.Lock()

    def _duration(self, event: str, seconds: float, **_) -> None:
        if event.startswith(COMPILE_EVENT_PREFIX):
            with self._lock:
                self.count += 1
                self.names[event] += 1

    def start(self) -> "CompileEvents":
        import jax

        jax.monitoring.register_event_duration_secs_listener(self._duration)
        return self

    def stop(self) -> None:
        import jax

        jax.monitoring.unregister_event_duration_listener(self._duration)

    def __enter__(self) -> "CompileEvents":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
