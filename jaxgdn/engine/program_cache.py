"""Compiled step programs kept on disk, so a later start-up loads them without tracing or lowering.

JAX's persistent compilation cache keys a program by its lowered module, so every start-up still traces
and lowers each step program (most of a start-up on a filled cache). This cache keys a program by what
determines it instead: jaxgdn's source, the JAX and XLA versions and flags, the device, the engine's static
settings, the launch key and the shapes of the weights and state. A hit deserializes the executable.
It lives beside JAX's cache, in its `jaxgdn-programs` folder, on GPUs (`program_cache`).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import logging
import os
import pickle
import tempfile
import time
import zlib
from pathlib import Path

import jax

logger = logging.getLogger("jaxgdn")

LOAD_EVENT = "/jaxgdn/program_cache/load_duration"  # seconds of one load (CompileTimes sums them)
HIT_EVENT, MISS_EVENT = "/jaxgdn/program_cache/hits", "/jaxgdn/program_cache/misses"
_PACKAGES = ("jaxgdn", "pallas_kernels")  # the code traced into a step program


@functools.cache
def source_digest() -> str:
    """sha256 of every Python file of the packages a step program is traced from."""
    h = hashlib.sha256()
    for package in _PACKAGES:
        root = Path(__import__(package).__file__).parent
        for path in sorted(root.rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _environment(xla_flags: str) -> tuple:
    """What besides the code and the shapes decides a compiled program: versions, flags, the devices."""
    import jaxlib

    devices = jax.devices()
    return (jax.__version__, jaxlib.__version__, xla_flags, devices[0].client.platform,
            devices[0].client.platform_version, tuple(d.device_kind for d in devices),
            jax.config.jax_enable_x64, str(jax.config.jax_default_matmul_precision),
            str(jax.config.jax_default_prng_impl))


@functools.cache
def _prepare_runtime() -> None:
    """Let loaded programs find the Mosaic GPU runtime: importing its module points its custom calls at the
    runtime library, which a process that only loads programs (tracing none) has not done yet."""
    if jax.devices()[0].platform == "gpu":
        try:
            importlib.import_module("jax.experimental.mosaic.gpu")
        except ImportError:  # a jaxlib without Mosaic GPU: its programs have no such calls
            pass


class ProgramCache:
    """Serialized compiled programs in `directory`, one file per key (any repr-stable tuple); xla_flags: the
    process's $XLA_FLAGS, part of every key."""

    def __init__(self, directory: str | os.PathLike, xla_flags: str = ""):
        self.directory = Path(directory)
        self.environment = _environment(xla_flags)

    def path(self, key: tuple) -> Path:
        digest = hashlib.sha256(repr((source_digest(), self.environment, key)).encode()).hexdigest()
        return self.directory / f"{digest}.program"

    def load(self, key: tuple):
        """The compiled program stored under key, or None (absent, or unreadable: then removed)."""
        path = self.path(key)
        t0 = time.perf_counter()
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            jax.monitoring.record_event(MISS_EVENT)
            return None
        from jax.experimental.serialize_executable import deserialize_and_load

        _prepare_runtime()
        try:
            program = deserialize_and_load(*pickle.loads(zlib.decompress(data)))
        except Exception as e:  # noqa: BLE001 - a damaged or foreign entry is recompiled, not fatal
            logger.warning("program cache: dropping unreadable %s (%s: %s)", path.name, type(e).__name__, e)
            path.unlink(missing_ok=True)
            jax.monitoring.record_event(MISS_EVENT)
            return None
        jax.monitoring.record_event_duration_secs(LOAD_EVENT, time.perf_counter() - t0)
        jax.monitoring.record_event(HIT_EVENT)
        return program

    def store(self, key: tuple, program) -> None:
        """Write program under key (atomically: a concurrent reader sees the whole file or none)."""
        from jax.experimental.serialize_executable import serialize

        try:
            data = zlib.compress(pickle.dumps(serialize(program)), 1)
        except (ValueError, NotImplementedError) as e:  # a backend without serialization
            logger.debug("program cache: not stored (%s)", e)
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self.path(key))
        except OSError as e:  # a full or read-only disk costs the next start-up a compile, nothing more
            logger.warning("program cache: not stored (%s)", e)
            Path(tmp).unlink(missing_ok=True)


def enable_compilation_cache(directory: str | None = None) -> str | None:
    """Turn on JAX's persistent compilation cache (process-wide) unless the user already chose one.
    Directory: the argument, else $JAXGDN_CACHE_DIR, else ~/.cache/jaxgdn/jax; an empty
    $JAXGDN_CACHE_DIR turns it off. Returns the directory in use (None when off)."""
    if jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    directory = directory if directory is not None else os.environ.get(
        "JAXGDN_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "jaxgdn", "jax"))
    if not directory:
        return None
    jax.config.update("jax_compilation_cache_dir", directory)
    # every program is kept, below JAX's own 1 s floor: a GPU compiles even a small program in a fraction of a
    # second, and a start-up runs dozens of them
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    return directory


def program_cache() -> ProgramCache | None:
    """The cache of compiled step programs beside JAX's persistent compilation cache on a GPU, or None when that
    is off or off a GPU (a loaded XLA:CPU program once failed to find one of its own kernels; there JAX's cache
    serves alone)."""
    directory = jax.config.jax_compilation_cache_dir
    if not directory or jax.devices()[0].platform != "gpu":
        return None
    return ProgramCache(os.path.join(directory, "jaxgdn-programs"), os.environ.get("XLA_FLAGS", ""))
