import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if os.environ["JAX_PLATFORMS"] == "cpu":
    # The CPU suite is mostly XLA compiles of programs that then run a few times: less LLVM optimisation
    # compiles them faster than it slows them (tests/test_multi_step.py rejected-drafts test: 62 -> 36 s).
    os.environ["XLA_FLAGS"] = " ".join(filter(None, [
        os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"]))
# One persistent compilation cache per test run, fresh each run (hermetic), shared by the xdist workers and
# the processes tests start: a program two tests compile is compiled once. test_engine checks the switch.
os.environ.setdefault("JAXGDN_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"jaxgdn-test-cache-{os.environ.get('PYTEST_XDIST_TESTRUNUID') or os.getpid()}"))

import jax  # noqa: E402
import torch  # noqa: E402

# Parity tests compare fp32 numbers: no reduced-precision matmuls on any backend.
jax.config.update("jax_default_matmul_precision", "highest")
torch.set_num_threads(max(1, os.cpu_count() or 1))


import pytest  # noqa: E402


def _mapped_regions() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


@pytest.fixture(autouse=True)
def _release_compiled_programs():
    """Drop compiled XLA programs when the process maps many regions. Every CPU executable keeps memory
    mappings; hundreds of them exceed vm.max_map_count (65530) late in the suite, and XLA's CPU compiler
    then segfaults in mmap. Clearing once past 20k mappings keeps the suite far below the limit."""
    yield
    if _mapped_regions() > 20000:
        import helpers

        from jaxgdn.engine import runner

        runner.clear_compiled_programs()
        helpers._naive_fwd.clear()
        jax.clear_caches()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Keep each xdist_group on one worker under --dist loadgroup: pytest-xdist names a test's group by rewriting
    item._nodeid, which pytest 9 no longer reads (a node's id lives in item._id), so every group was split."""
    if not getattr(config.option, "loadgroup", False):  # (set on xdist workers under --dist loadgroup)
        return
    try:
        from _pytest.nodeid import coerce_node_id
    except ImportError:  # an older pytest: xdist's own suffix works
        return
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        if names and "@" not in item.nodeid:
            item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(names)}")
