import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import torch  # noqa: E402

# Parity tests compare fp32 numbers: no reduced-precision matmuls on any backend.
jax.config.update("jax_default_matmul_precision", "highest")
torch.set_num_threads(max(1, os.cpu_count() or 1))
