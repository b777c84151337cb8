import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import torch  # noqa: E402

# Parity tests compare fp32 numbers: no reduced-precision matmuls on any backend.
jax.config.update("jax_default_matmul_precision", "highest")
torch.set_num_threads(max(1, os.cpu_count() or 1))


import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop compiled XLA programs after each test module. A long CPU session otherwise keeps hundreds of
    executables mapped, and XLA's CPU compiler was seen to segfault late in the full suite."""
    yield
    import helpers
    from jaxgdn import runner

    runner._jitted_step.cache_clear()
    helpers._naive_fwd.clear()
    jax.clear_caches()
